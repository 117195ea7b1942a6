"""The `atlas bench` command group. Thin: parse flags, call the bench modules, print.

`atlas bench MODEL -p 512 -n 128` runs the throughput benchmark (llama-bench's interface), so
the group routes any first argument that is not a subcommand name to `throughput`.
Nothing heavy is imported at module level: `atlas --help` loads this file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from atlas_cli.errors import UsageError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_COMMAND = "throughput"


class DefaultCommandGroup(TyperGroup):
    """A group whose first argument may be a model rather than a subcommand."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(
    cls=DefaultCommandGroup,
    help=(
        "Benchmark a model: throughput (llama-bench style; the default), agentic replay, "
        "coherence. `atlas bench MODEL -p 512 -n 128` runs throughput."
    ),
    add_completion=False,
    pretty_exceptions_enable=False,
)


def handle_errors(fn):
    """atlas's `handle_errors`, looked up at call time (atlas_cli.cli imports this module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from atlas_cli.cli import handle_errors as handle

        return handle(fn)(*args, **kwargs)

    return wrapper


def _apply_threads(threads: int | None):
    from contextlib import nullcontext

    if threads is None:
        return nullcontext()
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    import numpy  # noqa: F401  (loads the BLAS, so that threadpoolctl finds and limits it)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=threads, user_api="blas")


def _load(model: str, device: str, ctx_size: int | None):
    from atlas_cli.session import open_model

    return open_model(model, device=device, ctx_size=ctx_size)


def _gate(result: dict, baseline: Path | None, save_baseline: Path | None, tolerance: float):
    """Compare with a baseline (exit 1 on a regression) and/or store this run as one."""
    from atlas_cli.bench import gate

    if save_baseline:
        gate.save(save_baseline, result)
        typer.echo(f"baseline written to {save_baseline}", err=True)
    if baseline:
        outcome = gate.compare(result, gate.load(baseline), tolerance)
        typer.echo(gate.report(outcome), err=True)
        if not outcome.passed:
            raise typer.Exit(1)


Model = Annotated[str, typer.Argument(help="Model name or path.")]
Device = Annotated[str, typer.Option(help="cpu or cpu-ref (numpy float32 reference).")]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", help="Context length in tokens.")]
Baseline = Annotated[
    Path | None,
    typer.Option(help="Compare with this stored result; exit 1 on a regression.", dir_okay=False),
]
SaveBaseline = Annotated[
    Path | None, typer.Option("--save-baseline", help="Write this run's result here.")
]
Tolerance = Annotated[
    float, typer.Option(help="Allowed regression before the gate fails (0.10 = 10%).")
]


@bench_app.command("throughput")
@handle_errors
def throughput_cmd(
    model: Model = DEFAULT_MODEL,
    n_prompt: Annotated[
        str, typer.Option("-p", "--n-prompt", help="Prompt lengths (comma list; 0: none).")
    ] = "512",
    n_gen: Annotated[
        str, typer.Option("-n", "--n-gen", help="Generation lengths (comma list; 0: none).")
    ] = "128",
    pg: Annotated[
        list[str] | None,
        typer.Option("-pg", "--pg", help="Prompt+generation test PROMPT,GEN (repeatable)."),
    ] = None,
    n_depth: Annotated[
        str, typer.Option("-d", "--n-depth", help="Context depths to run at (comma list).")
    ] = "0",
    repetitions: Annotated[int, typer.Option("-r", "--repetitions", help="Timed runs.")] = 5,
    threads: Annotated[
        str | None, typer.Option("-t", "--threads", help="CPU threads (comma list).")
    ] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="md, json, jsonl or csv.")] = "md",
    warmup: Annotated[bool, typer.Option(help="Run each test once untimed first.")] = True,
    device: Device = "cpu",
    ctx_size: CtxSize = None,
    baseline: Baseline = None,
    save_baseline: SaveBaseline = None,
    tolerance: Tolerance = 0.10,
):
    """Throughput as llama-bench measures it: pp (prompt), tg (generation), pp+tg, at depths."""

    from atlas_cli.bench import progress, throughput

    if output not in throughput.OUTPUT_FORMATS:
        raise UsageError(f"-o takes one of {', '.join(throughput.OUTPUT_FORMATS)}")
    thread_list = throughput.parse_int_list(threads, "-t") if threads else [None]
    if any(t is not None and t < 1 for t in thread_list):
        raise UsageError("-t takes thread counts of at least 1")
    specs = throughput.expand(
        throughput.parse_int_list(n_prompt, "-p"),
        throughput.parse_int_list(n_gen, "-n"),
        [throughput.parse_pg(v) for v in pg or []],
        throughput.parse_int_list(n_depth, "-d"),
        thread_list,
    )
    loaded = _load(model, device, ctx_size)
    with progress.steps("bench", len(specs) * repetitions) as report:
        records = throughput.run(
            loaded,
            specs,
            repetitions=repetitions,
            warmup=warmup,
            on_sample=lambda spec, i, s: report(f"{spec.name} {spec.tokens / s:.2f} t/s"),
        )
    typer.echo(throughput.render(records, output))
    _gate(throughput.as_result(records), baseline, save_baseline, tolerance)


@bench_app.command("agentic")
@handle_errors
def agentic_cmd(
    model: Annotated[
        str, typer.Argument(help="Model name or path (with --url: the name sent to the server).")
    ] = DEFAULT_MODEL,
    trajectories: Annotated[
        Path,
        typer.Option(help="MLPerf Edge Agentic trajectory file (JSONL).", dir_okay=False),
    ] = ...,
    limit_conversations: Annotated[
        int | None, typer.Option(help="Replay only the first N conversations.")
    ] = None,
    limit_turns: Annotated[
        int | None, typer.Option(help="Replay only the first N requests of each conversation.")
    ] = None,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="Cap each prompt (drop the oldest steps, then cut long texts). Default "
            "in-process: the context minus --max-tokens."
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per request.")] = 1024,
    url: Annotated[
        str | None, typer.Option(help="Replay against this OpenAI-compatible server instead.")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="Bearer token for --url (default: $OPENAI_API_KEY).")
    ] = None,
    prefix_cache: Annotated[
        bool, typer.Option(help="Reuse the previous request's KV cache (in-process).")
    ] = True,
    cold_ttft: Annotated[
        bool, typer.Option(help="Also time each prompt from an empty cache (one more prefill).")
    ] = False,
    tool_format: Annotated[
        str,
        typer.Option(
            help="How tool calls reach the model: native (the chat template's tools support), "
            "text (<tool_call> JSON in the content) or auto (native when the template has it)."
        ),
    ] = "auto",
    output: Annotated[str, typer.Option("-o", "--output", help="md or json on stdout.")] = "md",
    output_file: Annotated[
        Path | None, typer.Option("--output-file", help="Also write the JSON result here.")
    ] = None,
    per_turn: Annotated[bool, typer.Option(help="Print one row per request too.")] = False,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    device: Device = "cpu",
    ctx_size: CtxSize = None,
    baseline: Baseline = None,
    save_baseline: SaveBaseline = None,
    tolerance: Tolerance = 0.10,
):
    """Replay agentic coding trajectories turn by turn (MLPerf Edge Agentic).

    Reports TTFT, TPOT, latency, lengths and prefix-cache hits per turn and as percentiles."""

    from atlas_cli.bench import agentic, progress, stats, sysinfo
    from atlas_cli.bench import trajectories as traj

    if output not in ("md", "json"):
        raise UsageError("-o takes md or json for agentic runs")
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
    )
    agentic.check_settings(settings, None)
    conversations = traj.load(trajectories)
    with _apply_threads(threads):
        if url:
            key = api_key or os.environ.get("OPENAI_API_KEY")
            target = agentic.UrlTarget(url, model, max_tokens, key, tool_format)
            facts = {"model": model}
        else:
            loaded = _load(model, device, ctx_size)
            if settings.max_prompt_tokens is None:
                cap = loaded.context_length - max_tokens
                if cap < 1:
                    raise UsageError(
                        f"--max-tokens {max_tokens} leaves no room for a prompt in a "
                        f"{loaded.context_length:,}-token context"
                    )
                settings = dataclasses.replace(settings, max_prompt_tokens=cap)
            agentic.check_settings(settings, loaded.context_length)
            target = agentic.EngineTarget(loaded, max_tokens, prefix_cache, cold_ttft, tool_format)
            settings = dataclasses.replace(settings, tool_format=target.tool_format)
            facts = sysinfo.model_facts(loaded)
        env = agentic.environment_for(target)
        total = agentic.total_requests(conversations, settings)

        try:
            with progress.steps("agentic", total) as report:

                def on_turn(turn, done):
                    ttft = stats.median([t.ttft_s for t in done])
                    tpot = stats.median([t.tpot_s for t in done])
                    report(
                        f"{turn.conversation_id} turn {turn.turn}: in {turn.input_tokens} "
                        f"(cached {turn.cached_tokens}) out {turn.output_tokens} | median "
                        f"TTFT {_ms(ttft)} TPOT {_ms(tpot)}"
                    )

                turns, wall = agentic.replay(conversations, target, settings, on_turn)
        finally:
            if url:
                target.close()
    result = agentic.as_result(turns, wall, settings, env, facts)
    if output_file:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        output_file.write_text(json.dumps(result, indent=2) + "\n")
    if output == "json":
        typer.echo(json.dumps(result, indent=2))
    else:
        if per_turn:
            typer.echo(agentic.turns_table(result) + "\n")
        typer.echo(agentic.summary_table(result))
    _gate(result, baseline, save_baseline, tolerance)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


@bench_app.command("coherence")
@handle_errors
def coherence_cmd(
    model: Model = DEFAULT_MODEL,
    max_tokens: Annotated[int, typer.Option(help="Token limit per answer.")] = 64,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    device: Device = "cpu",
):
    """Fixed prompts at temperature 0; exit 1 on degenerate or wrong answers."""

    from atlas_cli.bench import coherence

    with _apply_threads(threads):
        loaded = _load(model, device, None)
        verdicts = coherence.run(loaded, max_tokens=max_tokens)
    typer.echo(coherence.report(verdicts))
    if not all(v.passed for v in verdicts):
        raise typer.Exit(1)
