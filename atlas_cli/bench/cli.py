"""The `atlas bench` command group. Thin: check flags, call the bench modules, print.

`atlas bench MODEL -p 512 -n 128` runs the throughput benchmark (llama-bench's interface):
`route_bench_args` puts the default subcommand in front before Typer parses.
Nothing heavy is imported at module level (the bench modules import numpy and the backend
only where they run): `atlas --help` loads this file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import typer

from atlas_cli.bench import gate  # light (json, dataclasses): its TOLERANCE is a default
from atlas_cli.bench import options as o
from atlas_cli.commands.errors import AtlasGroup, guarded
from atlas_cli.errors import UsageError
from atlas_cli.store.embedded import DEFAULT_MODEL

DEFAULT_COMMAND = "throughput"
HELP_FLAGS = ("--help", "-h")

bench_app = typer.Typer(
    cls=AtlasGroup,
    help=(
        "Benchmark a model: throughput (llama-bench style; the default), agentic replay, "
        "BFCL function calling, coherence. `atlas bench MODEL -p 512 -n 128` runs throughput."
    ),
    add_completion=False,
    pretty_exceptions_enable=False,
)


def route_bench_args(argv: list[str]) -> list[str]:
    """The words after `bench`, with the default subcommand put first unless they start with a
    subcommand name or a help flag: `MODEL -p 512` becomes `throughput MODEL -p 512`."""
    names = {command.name for command in bench_app.registered_commands}
    if argv and (argv[0] in names or argv[0] in HELP_FLAGS):
        return list(argv)
    return [DEFAULT_COMMAND, *argv]


def _check_output(output: str, formats: Sequence[str]) -> None:
    if output not in formats:
        raise UsageError(f"-o takes one of {', '.join(formats)}")


def _apply_threads(threads: int | None):
    from contextlib import nullcontext

    if threads is None:
        return nullcontext()
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    from atlas_cli.cpu_threads import limit_blas

    return limit_blas(threads)


def _load(model: str, device: str, ctx_size: int | None, kv_type: str | None = None):
    from atlas_cli.session import open_model

    return open_model(model, device=device, ctx_size=ctx_size, kv_dtype=kv_type)


def _gate(
    result: dict,
    baseline: Path | None,
    save_baseline: Path | None,
    tolerance: float,
    mlperf_rule: bool = False,
) -> None:
    """Compare with a baseline (exit 1 on a regression) and/or store this run as one."""
    if save_baseline:
        gate.save(save_baseline, result)
        typer.echo(f"baseline written to {save_baseline}", err=True)
    if baseline:
        reference = gate.load(baseline)
        if mlperf_rule:
            outcome = gate.mlperf_accuracy(result, reference)
        else:
            outcome = gate.compare(result, reference, tolerance)
        typer.echo(gate.report(outcome), err=True)
        if not outcome.passed:
            raise typer.Exit(1)


@bench_app.command("throughput")
@guarded
def throughput_cmd(
    model: o.Model = DEFAULT_MODEL,
    n_prompt: o.NPrompt = "512",
    n_gen: o.NGen = "128",
    pg: o.PromptGen = None,
    n_depth: o.NDepth = "0",
    repetitions: o.Repetitions = 5,
    threads: o.ThreadList = None,
    output: o.TableOutput = "md",
    warmup: o.Warmup = True,
    device: o.Device = "cpu",
    ctx_size: o.CtxSize = None,
    kv_type: o.KvType = None,
    baseline: o.Baseline = None,
    save_baseline: o.SaveBaseline = None,
    tolerance: o.Tolerance = gate.TOLERANCE,
):
    """Throughput as llama-bench measures it: pp (prompt), tg (generation), pp+tg, at depths."""
    from atlas_cli.bench import throughput

    _check_output(output, throughput.OUTPUT_FORMATS)
    specs = throughput.specs_from_flags(n_prompt, n_gen, pg or [], n_depth, threads)
    loaded = _load(model, device, ctx_size, kv_type)
    records = throughput.run_with_progress(loaded, specs, repetitions, warmup)
    typer.echo(throughput.render(records, output))
    _gate(throughput.as_result(records), baseline, save_baseline, tolerance)


@bench_app.command("agentic")
@guarded
def agentic_cmd(
    model: o.ServedModel = DEFAULT_MODEL,
    trajectories: o.Trajectories = None,
    limit_conversations: o.LimitConversations = None,
    limit_turns: o.LimitTurns = None,
    max_prompt_tokens: o.MaxPromptTokens = None,
    max_tokens: o.MaxTokens = o.MAX_NEW_TOKENS,
    seed_set: o.MlperfSeeds = o.SEED_SET,
    min_duration: o.MinDuration = None,
    url: o.Url = None,
    api_key: o.ApiKey = None,
    prefix_cache: o.PrefixCache = True,
    cold_ttft: o.ColdTtft = False,
    tool_format: o.ToolFormat = "auto",
    output: o.ReportOutput = "md",
    output_file: o.OutputFile = None,
    per_turn: o.PerTurn = False,
    threads: o.Threads = None,
    device: o.Device = "cpu",
    ctx_size: o.CtxSize = None,
    kv_type: o.KvType = None,
    baseline: o.Baseline = None,
    save_baseline: o.SaveBaseline = None,
    tolerance: o.Tolerance = gate.TOLERANCE,
):
    """Replay agentic coding trajectories turn by turn (MLPerf Edge Agentic).

    Reports TTFT, TPOT, latency, lengths and prefix-cache hits per turn and as percentiles."""
    from atlas_cli.bench import agentic
    from atlas_cli.bench import trajectories as traj

    if trajectories is None:
        raise UsageError(
            "atlas bench agentic replays a trajectory file: give --trajectories FILE "
            f"(MLCommons' Edge Agentic trajectories: {o.TRAJECTORIES_SOURCE})"
        )
    _check_output(output, agentic.OUTPUT_FORMATS)
    settings = agentic.Settings(
        trajectories=str(trajectories),
        limit_conversations=limit_conversations,
        limit_turns=limit_turns,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens=max_tokens,
        prefix_cache=prefix_cache,
        cold_ttft=cold_ttft,
        tool_format=tool_format,
        url=url,
        seeds=seed_set,
        min_duration_s=min_duration,
    )
    agentic.check_settings(settings, None)
    conversations = traj.load(trajectories)  # a bad file fails before a model loads
    with _apply_threads(threads):
        if url:
            key = api_key or os.environ.get("OPENAI_API_KEY")
            seed = settings.seed_set.model
            target = agentic.UrlTarget(url, model, max_tokens, key, tool_format, seed)
        else:
            target, settings = agentic.engine_target(
                _load(model, device, ctx_size, kv_type), settings
            )
        result = agentic.run(conversations, target, settings)
    if output_file:
        gate.save(output_file, result)  # the same document a baseline is
    if output == "json":
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(agentic.markdown_report(result, per_turn))
    _gate(result, baseline, save_baseline, tolerance)


@bench_app.command("bfcl")
@guarded
def bfcl_cmd(
    model: o.ServedModel = DEFAULT_MODEL,
    url: o.BfclUrl = None,
    api_key: o.ApiKey = None,
    mode: o.BfclMode = "fc",
    tool_choice: o.ToolChoice = "auto",
    categories: o.Categories = None,
    limit: o.Limit = None,
    max_tokens: o.BfclMaxTokens = o.BFCL_MAX_TOKENS,
    timeout: o.AnswerTimeout = o.BFCL_TIMEOUT_S,
    output: o.ReportOutput = "md",
    output_file: o.OutputFile = None,
    threads: o.Threads = None,
    device: o.Device = "cpu",
    ctx_size: o.CtxSize = None,
    baseline: o.Baseline = None,
    save_baseline: o.SaveBaseline = None,
    tolerance: o.Tolerance = gate.TOLERANCE,
    mlperf_rule: o.MlperfRule = False,
    mlperf: o.MlperfSet = False,
    resume: o.BfclResume = None,
):
    """Berkeley Function Calling Leaderboard v4, single-turn: BFCL's cases and checker.

    Needs the bfcl-eval package (pip install --no-deps bfcl-eval). Without --url it asks
    atlas serve, started in this process; prints accuracy per category and overall."""
    from atlas_cli.bench import bfcl

    _check_output(output, bfcl.OUTPUT_FORMATS)
    settings = bfcl.Settings(
        model=model,
        categories=bfcl.parse_categories(categories),
        limit=limit,
        mode=mode,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        url=url,
        timeout_s=timeout,
        mlperf=mlperf,
    )
    with _apply_threads(threads):
        if url:
            key = api_key or os.environ.get("OPENAI_API_KEY")
            result = bfcl.run(settings, url, key, resume=resume)
        else:
            result = bfcl.in_process(settings, device, ctx_size, resume=resume)
    if output_file:
        gate.save(output_file, result)
    typer.echo(json.dumps(result, indent=2) if output == "json" else bfcl.markdown_report(result))
    _gate(result, baseline, save_baseline, tolerance, mlperf_rule)


@bench_app.command("coherence")
@guarded
def coherence_cmd(
    model: o.Model = DEFAULT_MODEL,
    probe_set: o.ProbeSet = "facts",
    max_tokens: o.AnswerTokens = None,
    seeds: o.Seeds = 3,
    threads: o.Threads = None,
    device: o.Device = "cpu",
):
    """Fixed prompts; exit 1 on degenerate or wrong answers."""
    from atlas_cli.bench import coherence

    if probe_set not in coherence.SETS:
        raise UsageError(f"--set takes one of {', '.join(coherence.SETS)}")
    probes = coherence.SETS[probe_set]
    with _apply_threads(threads):
        loaded = _load(model, device, None)
        if probe_set == "facts":
            verdicts = coherence.run(loaded, probes, max_tokens or coherence.MAX_TOKENS)
        else:
            limit = max_tokens or coherence.CHAT_MAX_TOKENS
            verdicts = coherence.run_sampled(loaded, probes, seeds, limit)
    typer.echo(coherence.report(verdicts))
    if not all(v.passed for v in verdicts):
        raise typer.Exit(1)
