"""`atlas bench bfcl`: the Berkeley Function Calling Leaderboard (v4), single-turn categories.

Each case goes to an OpenAI-compatible `/v1/chat/completions` as BFCL's own OpenAI handler
sends it, one request at a time, temperature 0, no streaming: in function-calling mode
(`fc`) the functions as `tools` with `tool_choice` ("auto", as a client leaves it, or
"required"); in prompt mode BFCL's system prompt and no `tools`. The answer is decoded and
judged by BFCL's checker (bfcl_cases.py). Without `--url` the target is `atlas serve` itself,
on a loopback port in this process, so the in-process score is the one its clients get.

A request the server refuses or answers malformed is a protocol error: the case counts as
wrong and the run goes on; a server that cannot be reached stops the run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from atlas_cli.bench import bfcl_cases as cases
from atlas_cli.bench import bfcl_mlperf, gate
from atlas_cli.bench.http_target import EndpointError, chat_url
from atlas_cli.bench.options import BFCL_MAX_TOKENS, BFCL_TIMEOUT_S
from atlas_cli.errors import UsageError

OUTPUT_FORMATS = ("md", "json")
TOOL_CHOICES = ("auto", "required")


@dataclass(frozen=True)
class Settings:
    model: str
    categories: tuple[str, ...] = cases.CATEGORIES
    limit: int | None = None
    mode: str = "fc"
    tool_choice: str = "auto"
    max_tokens: int = BFCL_MAX_TOKENS
    url: str | None = None
    timeout_s: float = BFCL_TIMEOUT_S
    mlperf: bool = False  # the MLPerf Edge Agentic set and scores (bfcl_mlperf.py)


def parse_categories(text: str | None) -> tuple[str, ...]:
    """`simple_python,irrelevance` -> the names; None or "all" -> every category."""
    if not text or text == "all":
        return cases.CATEGORIES
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in cases.CATEGORIES]
    if unknown or not names:
        raise UsageError(
            f"--categories: unknown {', '.join(unknown) or '(none given)'}; "
            f"pick from {', '.join(cases.CATEGORIES)}"
        )
    return names


def check_settings(settings: Settings) -> None:
    if settings.mode not in cases.MODES:
        raise UsageError(f"--mode takes one of {', '.join(cases.MODES)}")
    if settings.tool_choice not in TOOL_CHOICES:
        raise UsageError(f"--tool-choice takes one of {', '.join(TOOL_CHOICES)}")
    if settings.mode == "prompt" and settings.tool_choice != "auto":
        raise UsageError("--tool-choice applies to --mode fc (prompt mode sends no tools)")
    if settings.limit is not None and settings.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {settings.limit}")
    if settings.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {settings.max_tokens}")
    if settings.timeout_s <= 0:
        raise UsageError(f"--timeout must be above 0, got {settings.timeout_s}")
    if settings.mlperf and (settings.mode != "fc" or settings.tool_choice != "auto"):
        raise UsageError("--mlperf asks as MLPerf's harness does: --mode fc, --tool-choice auto")
    if settings.mlperf and settings.categories != cases.CATEGORIES:
        raise UsageError("--mlperf draws its own categories; leave out --categories")


def todo(settings: Settings) -> list[cases.Case]:
    """The cases a run asks: the first `limit` of each chosen category, or of each subset of
    MLPerf's set."""
    if settings.mlperf:
        return bfcl_mlperf.draw(settings.limit)
    return [c for name in settings.categories for c in cases.load(name, settings.limit)]


class ChatClient:
    """Plain (non-streamed) chat completions, as BFCL's OpenAI handler asks for them."""

    def __init__(
        self, url: str, model: str, api_key: str | None = None, timeout_s: float = BFCL_TIMEOUT_S
    ):
        import httpx2

        self.url = chat_url(url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx2.Timeout(timeout_s, connect=10)
        self.client = httpx2.Client(headers=headers, timeout=timeout)
        self._httpx = httpx2

    def close(self) -> None:
        self.client.close()

    def body(self, case: cases.Case, settings: Settings) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": settings.max_tokens,  # older servers read only this one
            "max_completion_tokens": settings.max_tokens,
        }
        if settings.mode == "prompt":
            body["messages"] = cases.prompt_messages(case)
        elif settings.mlperf:  # as its harness builds the request
            body["messages"] = [{**m, "content": m.get("content") or ""} for m in case.messages]
            body["tools"] = cases.openai_tools(case.functions, hint=False)
            body["tool_choice"] = "auto"
        else:
            body["messages"] = case.messages
            body["tools"] = cases.openai_tools(case.functions)
            body["tool_choice"] = settings.tool_choice
        return body

    def ask(self, body: dict[str, Any]) -> cases.Reply:
        """The answer, or EndpointError (a refusal or a malformed answer: a protocol error);
        a server that cannot be reached raises UnreachableError."""
        try:
            resp = self.client.post(self.url, json=body)
        except self._httpx.ConnectError as exc:
            raise UnreachableError(f"cannot reach {self.url}: {exc}") from None
        except self._httpx.HTTPError as exc:  # a timeout or a dropped answer: this case only
            raise EndpointError(f"no answer: {exc!r}") from None
        if resp.status_code != 200:
            raise EndpointError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            message = resp.json()["choices"][0]["message"]
            raw_calls = message.get("tool_calls")
            calls = None
            if raw_calls is not None:
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in raw_calls]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"malformed answer ({exc!r}): {resp.text[:300]}") from None
        return cases.Reply(message.get("content"), calls)


class UnreachableError(EndpointError):
    """The server is down or the URL is wrong: no point asking it the other cases."""


def run_case(client: ChatClient, case: cases.Case, settings: Settings) -> dict[str, Any]:
    """One case asked and judged: the row the result keeps."""
    row: dict[str, Any] = {"id": case.id, "category": case.category}
    try:
        reply = client.ask(client.body(case, settings))
    except UnreachableError:
        raise
    except EndpointError as exc:
        return {**row, "valid": False, "error_type": "protocol_error", "error": str(exc)}
    verdict = cases.score(case, reply, settings.mode)
    output = reply.content if reply.calls is None else [list(c) for c in reply.calls]
    return {**row, **asdict(verdict), "output": output}


def run(
    settings: Settings, url: str, api_key: str | None = None, resume: Path | None = None
) -> dict[str, Any]:
    """Every case of the chosen categories against `url`, one progress line per case on
    stderr; the result document (what `-o json` prints and the gate compares). With `resume`,
    the answers that file already holds (`kept`) are not asked again, and the document so far
    is written back to it after every case, so a run cut off anywhere goes on from there."""
    from atlas_cli.bench import progress

    check_settings(settings)
    asked = todo(settings)
    done = kept(resume, settings) if resume is not None and resume.exists() else {}
    client = ChatClient(url, settings.model, api_key, settings.timeout_s)
    rows = []
    try:
        with progress.steps("bfcl", len(asked)) as report:
            for case in asked:
                row = done.get(case.id) or run_case(client, case, settings)
                rows.append(row)
                if resume is not None and case.id not in done:
                    gate.save(resume, result_document(settings, rows))
                state = "kept" if case.id in done else "ok" if row["valid"] else row["error_type"]
                report(f"{case.id} {state}")
    finally:
        client.close()
    return result_document(settings, rows)


def kept(path: Path, settings: Settings) -> dict[str, dict[str, Any]]:
    """The answered cases of an earlier run's result document, by case id, when it was asked
    as `settings` ask (protocol errors are asked again); a file of another run is an error."""
    try:
        doc = json.loads(path.read_text())
        rows = doc["cases"]
        same = (
            doc["kind"] == "bfcl"
            and doc["mode"] == settings.mode
            and doc["max_tokens"] == settings.max_tokens
            and ("mlperf" in doc) == settings.mlperf
            and (settings.mode != "fc" or doc["tool_choice"] == settings.tool_choice)
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--resume: {path} is no BFCL result ({exc})") from None
    if not same:
        raise UsageError(f"--resume: {path} was asked with other settings (mode, --mlperf, ...)")
    return {r["id"]: r for r in rows if r.get("error_type") != "protocol_error"}


def in_process(
    settings: Settings, device: str, ctx_size: int | None, resume: Path | None = None
) -> dict[str, Any]:
    """The run against `atlas serve MODEL` started in this process."""
    from atlas_cli.serve.server import running

    check_settings(settings)
    cases.version()  # a missing bfcl-eval fails before the model loads
    with running(settings.model, device=device, ctx_size=ctx_size) as url:
        return run(settings, url, resume=resume)


def _tally(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    correct = sum(r["valid"] for r in rows)
    return {
        "correct": correct,
        "total": len(rows),
        "accuracy": correct / len(rows) if rows else 0.0,
        "protocol_errors": sum(r["error_type"] == "protocol_error" for r in rows),
    }


def result_document(settings: Settings, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """{"kind": "bfcl", settings, "summary" (all cases pooled), "categories", "cases"}, and
    with --mlperf "mlperf": its scores (bfcl_mlperf.scores)."""
    names = dict.fromkeys(r["category"] for r in rows) if settings.mlperf else settings.categories
    by_category = {name: _tally([r for r in rows if r["category"] == name]) for name in names}
    extra = {"mlperf": bfcl_mlperf.scores(rows)} if settings.mlperf else {}
    return {
        "kind": "bfcl",
        "model": settings.model,
        "url": settings.url,
        "mode": settings.mode,
        "tool_choice": settings.tool_choice if settings.mode == "fc" else None,
        "limit": settings.limit,
        "max_tokens": settings.max_tokens,
        "bfcl_eval": cases.version(),
        "summary": _tally(rows),
        "categories": by_category,
        **extra,
        "cases": rows,
    }


def markdown_report(result: dict[str, Any]) -> str:
    mode = result["mode"] + (
        f", tool_choice {result['tool_choice']}" if result["mode"] == "fc" else ""
    )
    lines = [
        f"BFCL v4 ({result['bfcl_eval']}), {result['model']}, {mode}",
        "",
        "| category | correct | total | accuracy | protocol errors |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rows = [*result["categories"].items(), ("overall", result["summary"])]
    for name, t in rows:
        name = f"**{name}**" if name == "overall" else name
        lines.append(
            f"| {name} | {t['correct']} | {t['total']} | {t['accuracy']:.1%} | "
            f"{t['protocol_errors']} |"
        )
    if "mlperf" in result:
        m = result["mlperf"]
        parts = ", ".join(f"{k} {v:.2%}" for k, v in m["categories"].items())
        lines += [
            "",
            f"MLPerf Edge Agentic set: overall {m['overall']:.2%}, "
            f"category-balanced {m['category_balanced']:.2%} ({parts})",
        ]
    return "\n".join(lines)
