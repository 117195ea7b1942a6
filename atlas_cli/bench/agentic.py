"""Agentic replay: MLPerf Edge Agentic trajectories sent turn by turn, one request at a time,
temperature 0, streamed, under the v6.1 rules (bench/mlperf_rules.py: seeds, minimum
duration); per-turn timings and their distribution.

Two targets share the replay: the in-process engine (prefix reuse: the engine keeps the previous
request's KV cache and prefills only the new suffix) and any OpenAI-compatible URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from atlas_cli import __version__
from atlas_cli.bench import capping, mlperf_rules, progress, stats, sysinfo
from atlas_cli.bench import trajectories as traj
from atlas_cli.errors import UsageError

TEMPERATURE = 0.0
TOOL_FORMATS = ("auto", "native", "text")
OUTPUT_FORMATS = ("md", "json")
HTTP_CHARS_PER_TOKEN = 3  # prompt-size estimate over HTTP, where we have no tokenizer


@dataclass(frozen=True)
class TurnResult:
    conversation_id: str
    turn: int
    index: int
    input_tokens: int | None
    output_tokens: int
    cached_tokens: int | None  # prompt tokens served from the prefix cache
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    ttft_cold_s: float | None  # the same prompt from an empty cache (--cold-ttft)
    finish_reason: str | None
    dropped_messages: int
    truncated_to: int | None


@dataclass(frozen=True)
class Settings:
    trajectories: str
    limit_conversations: int | None
    limit_turns: int | None
    max_prompt_tokens: int | None
    max_tokens: int
    prefix_cache: bool
    cold_ttft: bool
    tool_format: str
    url: str | None
    seeds: str = mlperf_rules.ROUND  # a key of mlperf_rules.SEED_SETS
    min_duration_s: float | None = None  # None: mlperf_rules.default_min_duration

    @property
    def limited(self) -> bool:
        return self.limit_conversations is not None or self.limit_turns is not None

    @property
    def seed_set(self) -> mlperf_rules.SeedSet:
        return mlperf_rules.SEED_SETS[self.seeds]

    @property
    def min_duration(self) -> float:
        if self.min_duration_s is None:
            return mlperf_rules.default_min_duration(self.limited)
        return self.min_duration_s


class Target(Protocol):
    """Where the requests run: the in-process engine or an OpenAI-compatible server."""

    tool_format: str  # native or text, `auto` already resolved
    untimed_s: float  # time spent outside the measured requests, kept out of the wall time

    def render(self, messages: list[dict], tools: list[dict]) -> list[int] | None: ...
    def count(self, tools: list[dict]) -> Callable[[list[dict]], int]: ...
    def complete(self, messages: list[dict], tools: list[dict], ids) -> dict[str, Any]: ...
    def environment(self) -> dict[str, Any]: ...
    def model_facts(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def _tpot(first: float | None, last: float | None, n: int) -> float | None:
    if first is None or last is None or n < 2:
        return None
    return (last - first) / (n - 1)


class EngineTarget:
    """Runs requests on a loaded model, streaming in-process."""

    def __init__(
        self, model, max_tokens: int, prefix_cache: bool, cold_ttft: bool, tools: str, seed: int
    ):
        self.model = model
        self.seed = seed
        self.max_tokens = max_tokens
        self.prefix_cache = prefix_cache
        self.cold_ttft = cold_ttft
        template = model.tokenizer.chat_template
        if tools == "auto":
            tools = "native" if traj.template_supports_tools(template) else "text"
        self.tool_format = tools
        self.untimed_s = 0.0  # time spent on --cold-ttft prefills, kept out of the wall time

    def render(self, messages: list[dict], tools: list[dict]) -> list[int]:
        if self.tool_format == "text":
            return self.model.chat_prompt(traj.as_text_messages(messages, tools))
        return self.model.chat_prompt(messages, tools=tools or None)

    def count(self, tools: list[dict]) -> Callable[[list[dict]], int]:
        return lambda messages: len(self.render(messages, tools))

    def _stream(self, ids: list[int], max_tokens: int):
        from atlas_cli.backend.engine import GenerationStats
        from atlas_cli.backend.sample import SamplingOverrides

        stats = GenerationStats()
        first = last = None
        t0 = time.perf_counter()
        events = self.model.generate(
            ids,
            max_tokens=max_tokens,
            stats=stats,
            sampling=SamplingOverrides(temperature=TEMPERATURE, seed=self.seed),
        )
        for event in events:
            if event.token >= 0:  # -1 is held-back text flushed at the end
                last = time.perf_counter() - t0
                first = last if first is None else first
        latency = time.perf_counter() - t0
        if first is None and stats.ttft_s:
            first = stats.ttft_s  # the first token was end-of-turn: no text, but a TTFT
        return stats, first, last, latency

    def complete(self, messages: list[dict], tools: list[dict], ids: list[int]) -> dict[str, Any]:
        engine = self.model.engine
        if not self.prefix_cache:
            engine.reset()
        stats, first, last, latency = self._stream(ids, self.max_tokens)
        cold = None
        if self.cold_ttft:
            t0 = time.perf_counter()
            engine.reset()
            _, cold, _, _ = self._stream(ids, 1)
            self.untimed_s += time.perf_counter() - t0
        return {
            "input_tokens": stats.prompt_tokens,
            "output_tokens": stats.completion_tokens,
            "cached_tokens": stats.cached_tokens,
            "ttft_s": first,
            "tpot_s": _tpot(first, last, stats.completion_tokens),
            "latency_s": latency,
            "ttft_cold_s": cold,
            "finish_reason": stats.finish_reason,
        }

    def environment(self) -> dict[str, Any]:
        return sysinfo.environment(self.model.device)

    def model_facts(self) -> dict[str, Any]:
        return sysinfo.model_facts(self.model)

    def close(self) -> None:
        pass  # the model stays loaded: its owner decides


class UrlTarget:
    """Runs requests against an OpenAI-compatible endpoint."""

    def __init__(
        self, url: str, model_name: str, max_tokens: int, api_key: str | None, tools: str, seed: int
    ):
        from atlas_cli.bench.http_target import HttpTarget

        self.http = HttpTarget(url, model_name, api_key)
        self.seed = seed
        self.model_name = model_name
        self.max_tokens = max_tokens
        # auto: the server's chat template decides how tool calls render
        self.tool_format = "text" if tools == "text" else "native"
        self.untimed_s = 0.0

    def render(self, messages: list[dict], tools: list[dict]) -> None:
        return None  # the server tokenizes

    def count(self, tools: list[dict]) -> Callable[[list[dict]], int]:
        import json

        def estimate(messages: list[dict]) -> int:
            return len(json.dumps(messages, ensure_ascii=False)) // HTTP_CHARS_PER_TOKEN

        return estimate

    def complete(self, messages: list[dict], tools: list[dict], ids=None) -> dict[str, Any]:
        if self.tool_format == "text":
            messages, tools = traj.as_text_messages(messages, tools), []
        t = self.http.complete(messages, tools, self.max_tokens, seed=self.seed)
        return {
            "input_tokens": t.prompt_tokens,
            "output_tokens": t.completion_tokens,
            "cached_tokens": t.cached_tokens,
            "ttft_s": t.ttft_s,
            "tpot_s": _tpot(t.first_s, t.last_s, t.completion_tokens),
            "latency_s": t.latency_s,
            "ttft_cold_s": None,
            "finish_reason": t.finish_reason,
        }

    def environment(self) -> dict[str, Any]:
        return {
            "atlas_version": __version__,
            "git_commit": sysinfo.git_commit(),
            "device": "http",
            "backend": "HTTP",
        }

    def model_facts(self) -> dict[str, Any]:
        return {"model": self.model_name}

    def close(self) -> None:
        self.http.close()


def replay(
    conversations: Sequence[traj.Conversation],
    target: Target,
    settings: Settings,
    on_turn: Callable[[TurnResult, list[TurnResult]], None] | None = None,
) -> tuple[list[TurnResult], float]:
    """Replay every selected request, conversations in the dataloader seed's order, the whole
    selection again until the minimum duration has passed; returns the turns and the total wall
    time (without the extra --cold-ttft prefills)."""
    convs = selected(conversations, settings)
    results: list[TurnResult] = []
    t0 = time.perf_counter()
    while True:
        for conv in convs:
            _replay_conversation(conv, target, settings, results, on_turn)
        wall = time.perf_counter() - t0 - target.untimed_s
        if wall >= settings.min_duration or not convs:
            return results, wall


def selected(conversations: Sequence[traj.Conversation], settings: Settings) -> list:
    """The conversations to replay, in the order the dataloader seed gives them."""
    convs = list(conversations)
    ordered = [convs[i] for i in mlperf_rules.conversation_order(len(convs), settings.seed_set)]
    return ordered[: settings.limit_conversations]


def _replay_conversation(conv, target: Target, settings: Settings, results: list, on_turn):
    capper = None
    if settings.max_prompt_tokens:
        capper = capping.PromptCapper(settings.max_prompt_tokens, target.count(conv.tools))
    for req in traj.requests(conv, settings.limit_turns):
        messages, dropped, cut = req.messages, 0, None
        if capper is not None:
            fitted = capper.fit(messages)
            messages, dropped, cut = (
                fitted.messages,
                fitted.dropped_messages,
                fitted.truncated_to,
            )
        ids = target.render(messages, req.tools)
        out = target.complete(messages, req.tools, ids)
        result = TurnResult(
            conversation_id=req.conversation_id,
            turn=req.turn,
            index=req.index,
            dropped_messages=dropped,
            truncated_to=cut,
            **out,
        )
        results.append(result)
        if on_turn:
            on_turn(result, results)


def total_requests(conversations: Sequence[traj.Conversation], settings: Settings) -> int:
    """Requests in one pass over the selection (a run under its minimum duration repeats)."""
    convs = selected(conversations, settings)
    limit = settings.limit_turns
    return sum(c.n_requests if limit is None else min(limit, c.n_requests) for c in convs)


# -- a whole run -------------------------------------------------------------------------------


def engine_target(model, settings: Settings) -> tuple[EngineTarget, Settings]:
    """The in-process target for a loaded model, and the settings it runs with: the prompt cap
    defaults to the context minus --max-tokens, and `auto` becomes the tool format it picked."""
    context = model.context_length
    if settings.max_prompt_tokens is None:
        cap = context - settings.max_tokens
        if cap < 1:
            raise UsageError(
                f"--max-tokens {settings.max_tokens} leaves no room for a prompt in a "
                f"{context:,}-token context"
            )
        settings = replace(settings, max_prompt_tokens=cap)
    check_settings(settings, context)
    target = EngineTarget(
        model,
        settings.max_tokens,
        settings.prefix_cache,
        settings.cold_ttft,
        settings.tool_format,
        settings.seed_set.model,
    )
    return target, replace(settings, tool_format=target.tool_format)


def run(
    conversations: Sequence[traj.Conversation], target: Target, settings: Settings
) -> dict[str, Any]:
    """Replay with one progress line per request on stderr, close the target, and return the
    result document (what `-o json` prints and the gate compares)."""
    try:
        facts = target.model_facts()
        env = target.environment()
        with progress.steps("agentic", total_requests(conversations, settings)) as report:
            turns, wall = replay(conversations, target, settings, _progress_line(report))
    finally:
        target.close()
    return as_result(turns, wall, settings, env, facts)


def _progress_line(report: progress.Reporter) -> Callable[[TurnResult, list[TurnResult]], None]:
    def on_turn(turn: TurnResult, done: list[TurnResult]) -> None:
        ttft = stats.median([t.ttft_s for t in done])
        tpot = stats.median([t.tpot_s for t in done])
        report(
            f"{turn.conversation_id} turn {turn.turn}: in {turn.input_tokens} "
            f"(cached {turn.cached_tokens}) out {turn.output_tokens} | median "
            f"TTFT {_ms(ttft)} TPOT {_ms(tpot)}"
        )

    return on_turn


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# -- results -----------------------------------------------------------------------------------

METRICS = (  # (key in TurnResult, label, unit scale, unit)
    ("ttft_s", "TTFT", 1000, "ms"),
    ("ttft_cold_s", "TTFT, empty cache", 1000, "ms"),
    ("tpot_s", "TPOT", 1000, "ms"),
    ("latency_s", "latency", 1, "s"),
    ("input_tokens", "input tokens", 1, ""),
    ("output_tokens", "output tokens", 1, ""),
    ("cached_tokens", "prefix-cache hits", 1, "tokens"),
)


def summarize(turns: Sequence[TurnResult], wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, *_ in METRICS:
        summary = stats.summarize([getattr(t, key) for t in turns])
        if summary is not None:
            out[key] = summary
    output_tokens = sum(t.output_tokens for t in turns)
    inputs = sum(t.input_tokens or 0 for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    out["requests"] = len(turns)
    out["conversations"] = len({t.conversation_id for t in turns})
    out["wall_s"] = wall_s
    out["output_tokens_per_s"] = output_tokens / wall_s if wall_s > 0 else 0.0
    out["prefix_cache_hit_rate"] = cached / inputs if inputs else None
    return out


def as_result(
    turns: Sequence[TurnResult],
    wall_s: float,
    settings: Settings,
    env: dict[str, Any],
    model_facts: dict[str, Any],
) -> dict[str, Any]:
    capped = any(t.dropped_messages or t.truncated_to for t in turns)
    why_not = mlperf_rules.validity(settings.seeds, settings.limited, capped, wall_s)
    return {
        "kind": "agentic",
        **env,
        **model_facts,
        "settings": asdict(settings),
        "mlperf": {
            "round": mlperf_rules.ROUND,
            "seeds": asdict(settings.seed_set),
            "min_duration_s": settings.min_duration,
            "valid": not why_not,
            "not_valid_because": why_not,
        },
        "summary": summarize(turns, wall_s),
        "turns": [asdict(t) for t in turns],
    }


def _fmt(value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.2f}"


def summary_table(result: dict[str, Any]) -> str:
    """The short Markdown report: one row per metric, its distribution across turns."""
    s = result["summary"]
    cols = ("min", "mean", "p50", "p90", "p95", "p99", "max")
    lines = [
        "| metric | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for key, label, scale, unit in METRICS:
        if key not in s:
            continue
        name = f"{label} ({unit})" if unit else label
        lines.append(f"| {name} | " + " | ".join(_fmt(s[key][c], scale) for c in cols) + " |")
    hit = s.get("prefix_cache_hit_rate")
    model = result.get("model") or result.get("settings", {}).get("url")
    lines.append("")
    lines.append(
        f"{plural(s['requests'], 'request')} over {plural(s['conversations'], 'conversation')} "
        f"({model}) in "
        f"{s['wall_s']:.1f} s; {s['output_tokens_per_s']:.2f} output tokens/s"
        + (f"; prefix-cache hit rate {hit:.1%}" if hit is not None else "")
    )
    rules = result.get("mlperf")
    if rules:
        lines.append(
            f"A valid MLPerf {rules['round']} run."
            if rules["valid"]
            else f"Not a valid MLPerf {rules['round']} run: "
            + "; ".join(rules["not_valid_because"])
        )
    return "\n".join(lines)


def markdown_report(result: dict[str, Any], per_turn: bool = False) -> str:
    """The Markdown report: the summary, after one row per request when `per_turn`."""
    summary = summary_table(result)
    return f"{turns_table(result)}\n\n{summary}" if per_turn else summary


def turns_table(result: dict[str, Any]) -> str:
    head = "| conversation | turn | input | cached | output | TTFT ms | TPOT ms | latency s |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in result["turns"]:
        lines.append(
            f"| {t['conversation_id']} | {t['turn']} | {t['input_tokens'] or '-'} | "
            f"{t['cached_tokens'] if t['cached_tokens'] is not None else '-'} | "
            f"{t['output_tokens']} | {_fmt(t['ttft_s'], 1000)} | {_fmt(t['tpot_s'], 1000)} | "
            f"{_fmt(t['latency_s'], 1)} |"
        )
    return "\n".join(lines)


def check_settings(settings: Settings, context_length: int | None) -> None:
    if settings.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {settings.max_tokens}")
    for name in ("limit_conversations", "limit_turns", "max_prompt_tokens"):
        value = getattr(settings, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if settings.seeds not in mlperf_rules.SEED_SETS:
        raise UsageError(f"--seeds must be one of {', '.join(mlperf_rules.SEED_SETS)}")
    if settings.min_duration_s is not None and not 0 <= settings.min_duration_s <= 86_400:
        raise UsageError(f"--min-duration must be 0..86400 seconds, got {settings.min_duration_s}")
    if settings.tool_format not in TOOL_FORMATS:
        raise UsageError(f"--tool-format must be one of {', '.join(TOOL_FORMATS)}")
    if settings.url and (settings.cold_ttft or not settings.prefix_cache):
        raise UsageError("--cold-ttft and --no-prefix-cache control the in-process engine only")
    if (
        context_length
        and settings.max_prompt_tokens
        and settings.max_prompt_tokens >= context_length
    ):
        raise UsageError(
            f"--max-prompt-tokens {settings.max_prompt_tokens:,} leaves no room to generate in "
            f"a {context_length:,}-token context"
        )


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
