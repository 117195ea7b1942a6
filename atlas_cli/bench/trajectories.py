"""MLPerf Edge Agentic trajectories: parse the JSONL, build one chat request per user/tool row.

Row schema (the dataset's README): `conversation_id`, `turn` (1, 2, ...) and `role`;
- user: `content`, and on turn 1 `system` and `tools` (OpenAI function specs);
- assistant: `tool_calls` (OpenAI-shaped, `arguments` a JSON string), `reasoning_content`,
  optionally `content`;
- tool: `tool_results: [{tool_call_id, content}]`.

Each user or tool row becomes one request whose messages are the system prompt plus the
*recorded* history up to and including that row: the model's own answers are never fed back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_cli.errors import AtlasError

ROLES = ("user", "assistant", "tool")


class TrajectoryError(AtlasError):
    """A trajectory file that is missing or does not follow the schema."""


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str | None
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # OpenAI chat messages after the system prompt
    # (messages index just past a user/tool row, that row's turn number): one per request
    request_points: list[tuple[int, int]] = field(default_factory=list)

    @property
    def n_requests(self) -> int:
        return len(self.request_points)


@dataclass(frozen=True)
class Request:
    conversation_id: str
    turn: int  # the turn number of the user/tool row that triggers it
    index: int  # 0-based position among the conversation's requests
    messages: list[dict[str, Any]]  # system + recorded history, OpenAI format
    tools: list[dict[str, Any]]


def load(path: str | Path) -> list[Conversation]:
    """Parse and validate a trajectory file; conversations keep their first-seen order."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TrajectoryError(f"{path}: no such trajectory file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrajectoryError(f"{path}: cannot read ({exc})") from None
    rows: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrajectoryError(f"{where}: not valid JSON ({exc.msg})") from None
        _check_row(row, where)
        rows.setdefault(row["conversation_id"], []).append((lineno, row))
    if not rows:
        raise TrajectoryError(f"{path}: no rows")
    return [_conversation(cid, conv_rows, path) for cid, conv_rows in rows.items()]


def _require(row: dict, key: str, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if key not in row:
        raise TrajectoryError(f"{where}: {what} row has no {key!r}")
    value = row[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TrajectoryError(
            f"{where}: {what} {key!r} must be {names}, got {type(value).__name__}"
        )
    return value


def _check_row(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise TrajectoryError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    role = _require(row, "role", str, where, "the")
    if role not in ROLES:
        raise TrajectoryError(f"{where}: unknown role {role!r} (expected one of {ROLES})")
    cid = _require(row, "conversation_id", str, where, role)
    if not cid:
        raise TrajectoryError(f"{where}: empty conversation_id")
    turn = _require(row, "turn", int, where, role)
    if turn < 1:
        raise TrajectoryError(f"{where}: turn must be >= 1, got {turn}")
    if role == "user":
        _require(row, "content", str, where, "user")
        if row.get("system") is not None:
            _require(row, "system", str, where, "user")
        if row.get("tools") is not None:
            tools = _require(row, "tools", list, where, "user")
            for tool in tools:
                if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
                    raise TrajectoryError(f"{where}: each tool must be {{type, function: {{...}}}}")
    elif role == "assistant":
        calls = row.get("tool_calls") or []
        if not isinstance(calls, list):
            raise TrajectoryError(f"{where}: assistant 'tool_calls' must be a list")
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not (
                isinstance(fn, dict)
                and isinstance(call.get("id"), str)
                and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)
            ):
                raise TrajectoryError(
                    f"{where}: each tool call must be {{id, function: {{name, arguments: "
                    "<JSON string>}}}}"
                )
        for key in ("content", "reasoning_content"):
            if row.get(key) is not None and not isinstance(row[key], str):
                raise TrajectoryError(f"{where}: assistant {key!r} must be a string")
        if not calls and not row.get("content"):
            raise TrajectoryError(f"{where}: assistant row has neither 'content' nor 'tool_calls'")
    else:
        results = _require(row, "tool_results", list, where, "tool")
        if not results:
            raise TrajectoryError(f"{where}: tool row has an empty 'tool_results'")
        for result in results:
            if not (
                isinstance(result, dict)
                and isinstance(result.get("tool_call_id"), str)
                and isinstance(result.get("content"), str)
            ):
                raise TrajectoryError(
                    f"{where}: each tool result must be {{tool_call_id: str, content: str}}"
                )


def _conversation(cid: str, rows: list[tuple[int, dict]], path: Path) -> Conversation:
    rows = sorted(rows, key=lambda r: r[1]["turn"])
    first_line, first = rows[0]
    if first["role"] != "user" or first["turn"] != 1:
        raise TrajectoryError(
            f"{path}:{first_line}: conversation {cid!r} must start with a user row at turn 1 "
            f"(found {first['role']} at turn {first['turn']})"
        )
    messages: list[dict[str, Any]] = []
    points: list[tuple[int, int]] = []
    open_calls: set[str] = set()  # ids of the last assistant row's tool calls
    expected = 1
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        if row["turn"] != expected:
            problem = "repeats" if row["turn"] < expected else "skips to"
            raise TrajectoryError(
                f"{where}: conversation {cid!r} {problem} turn {row['turn']} "
                f"(expected turn {expected})"
            )
        expected += 1
        role = row["role"]
        if role == "user":
            messages.append({"role": "user", "content": row["content"]})
            open_calls = set()
            points.append((len(messages), row["turn"]))
        elif role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": row.get("content") or ""}
            if row.get("reasoning_content"):
                msg["reasoning_content"] = row["reasoning_content"]
            if row.get("tool_calls"):
                msg["tool_calls"] = row["tool_calls"]
            messages.append(msg)
            open_calls = {c["id"] for c in row.get("tool_calls") or []}
        else:
            for result in row["tool_results"]:
                if result["tool_call_id"] not in open_calls:
                    raise TrajectoryError(
                        f"{where}: tool result for {result['tool_call_id']!r} answers no tool "
                        "call of the preceding assistant row"
                    )
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": result["tool_call_id"],
                        "content": result["content"],
                    }
                )
            points.append((len(messages), row["turn"]))
    return Conversation(
        id=cid,
        system=first.get("system"),
        tools=list(first.get("tools") or []),
        messages=messages,
        request_points=points,
    )


def requests(conv: Conversation, limit: int | None = None) -> Iterator[Request]:
    """The conversation's requests in order (at most `limit`)."""
    head = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    for index, (end, turn) in enumerate(conv.request_points):
        if limit is not None and index >= limit:
            return
        yield Request(conv.id, turn, index, head + conv.messages[:end], conv.tools)


# -- rendering for chat templates without tool support ----------------------------------------

# Hermes / Qwen2.5 convention: the tool specs in the system prompt, calls as <tool_call> JSON,
# results as <tool_response>, reasoning as <think>.
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders `tool_calls` itself (SmolLM2's renders role/content only)."""
    return bool(template) and "tool_calls" in template


def as_text_messages(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """Role/content-only messages for templates without tools: tool specs appended to the system
    prompt, reasoning as <think>, calls as <tool_call> JSON, results as <tool_response>."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "system":
            specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            text = m["content"] + (TOOLS_PREAMBLE + specs + TOOLS_POSTAMBLE if tools else "")
            out.append({"role": "system", "content": text})
        elif role == "assistant":
            parts = []
            if m.get("reasoning_content"):
                parts.append(f"<think>\n{m['reasoning_content']}\n</think>\n")
            if m.get("content"):
                parts.append(m["content"])
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                try:
                    args = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    args = fn["arguments"]  # recorded as is: the model's own malformed call
                body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
                parts.append(f"<tool_call>\n{body}\n</tool_call>")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            out.append(
                {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append({"role": role, "content": m["content"]})
    return out
