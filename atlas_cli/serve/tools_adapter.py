"""The server's one door to tool-call and reasoning parsing.

The real parsers live in `atlas_cli.backend.toolcalls` (another branch). The server uses only
the names below, so wiring the real module in means editing this file alone:

- `select_parser(chat_template, override)` -> a parser for the model's tool-call format
- `parser.parse(text, tools)` -> `ParsedMessage(content, reasoning, tool_calls)` (non-streaming;
  `tools` None means: do not look for calls, only split off reasoning)
- `parser.stream(tools, prompt_opened_think)` -> a stream parser whose `feed(text)` and
  `finish()` return lists of `Delta` (reasoning text, content text, or one whole tool call)
- `split_reasoning(text, prompt_opened_think)` -> (reasoning, content)
- `call_text(name, arguments)` -> an assistant call as the text the parser reads back (used
  when a chat template cannot render `tool_calls`)
- `ToolCall(id, name, arguments: JSON text)`, `ParsedMessage`, `Delta`, `new_call_id()`,
  `THINK_OPEN`

Until then this module carries a minimal Hermes parser (`<tool_call>{json}</tool_call>`, with
`<think>...</think>` reasoning), the format SmolLM2-style ChatML and Qwen models use.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """One streamed piece. kind "tool_call" carries a whole call at `index` (OpenAI allows the
    name and the full arguments in the first delta of a call)."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    index: int = 0
    call: ToolCall | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_reasoning(text: str, prompt_opened_think: bool = False) -> tuple[str | None, str]:
    """(reasoning, content): the text inside a leading <think>...</think> (or up to </think>
    when the prompt already opened the block)."""
    body = text
    if not prompt_opened_think:
        stripped = body.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        body = stripped[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip(), ""  # cut off while thinking
    return body[:end].strip(), body[end + len(THINK_CLOSE) :].lstrip()


def _parse_call(payload: str) -> ToolCall | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text."""

    name = "hermes"

    def parse(self, text: str, tools: list[dict] | None) -> ParsedMessage:
        reasoning, rest = split_reasoning(text)
        if not tools:
            return ParsedMessage(rest, reasoning)
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = rest.find(CALL_OPEN, pos)
            if start < 0:
                content.append(rest[pos:])
                break
            end = rest.find(CALL_CLOSE, start)
            payload = rest[start + len(CALL_OPEN) : end if end >= 0 else len(rest)]
            call = _parse_call(payload.strip())
            if call is None:  # not a valid call: keep it as text
                stop = end + len(CALL_CLOSE) if end >= 0 else len(rest)
                content.append(rest[pos:stop])
                pos = stop
                if end < 0:
                    break
                continue
            content.append(rest[pos:start])
            calls.append(call)
            if end < 0:
                break
            pos = end + len(CALL_CLOSE)
        return ParsedMessage(
            "".join(content).strip() if calls else "".join(content), reasoning, calls
        )

    def stream(self, tools: list[dict] | None, prompt_opened_think: bool = False) -> HermesStream:
        return HermesStream(bool(tools), prompt_opened_think)


class HermesStream:
    """Incremental HermesParser: holds back text that may be the start of a tag."""

    def __init__(self, parse_tools: bool, prompt_opened_think: bool):
        self.parse_tools = parse_tools
        self.mode = "reasoning" if prompt_opened_think else "start"
        self.buf = ""
        self.calls = 0
        self.skip_ws = prompt_opened_think

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while True:
            before = (self.mode, len(self.buf))
            out += self._step(final=False)
            if (self.mode, len(self.buf)) == before:
                return out

    def finish(self) -> list[Delta]:
        out = self._step(final=True)
        if self.buf:
            kind = "reasoning" if self.mode == "reasoning" else "content"
            out.append(Delta(kind, self.buf))
            self.buf = ""
        return out

    def _step(self, final: bool) -> list[Delta]:
        if self.skip_ws:  # whitespace right after <think> or </think> is layout, not text
            stripped = self.buf.lstrip()
            self.buf, self.skip_ws = stripped, not stripped
            if not stripped:
                return []
        if self.mode == "start":  # a leading <think> opens reasoning
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buf, self.mode = stripped[len(THINK_OPEN) :], "reasoning"
                self.skip_ws = True
            elif final or not THINK_OPEN.startswith(stripped):
                self.mode = "content"
            return []
        if self.mode == "reasoning":
            return self._until(THINK_CLOSE, "reasoning", "content", final)
        if self.mode == "call":
            end = self.buf.find(CALL_CLOSE)
            if end < 0 and not final:
                return []
            payload = self.buf[: end if end >= 0 else len(self.buf)]
            self.buf = self.buf[end + len(CALL_CLOSE) :] if end >= 0 else ""
            self.mode = "content"
            call = _parse_call(payload.strip())
            if call is None:
                return [Delta("content", CALL_OPEN + payload + (CALL_CLOSE if end >= 0 else ""))]
            self.calls += 1
            return [Delta("tool_call", index=self.calls - 1, call=call)]
        if not self.parse_tools:
            out, self.buf = self.buf, ""
            return [Delta("content", out)] if out else []
        return self._until(CALL_OPEN, "content", "call", final)

    def _until(self, tag: str, kind: str, next_mode: str, final: bool) -> list[Delta]:
        """Emit text of `kind` up to `tag`, then switch to `next_mode`; hold a partial tag."""
        at = self.buf.find(tag)
        if at >= 0:
            text, self.buf, self.mode = self.buf[:at], self.buf[at + len(tag) :], next_mode
            self.skip_ws = kind == "reasoning"
            return [Delta(kind, text)] if text else []
        hold = 0 if final else _partial_suffix(self.buf, tag)
        text, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
        return [Delta(kind, text)] if text else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


def select_parser(chat_template: str | None, override: str | None = None) -> HermesParser:
    """The parser for a model's tool-call format (only Hermes until toolcalls.py is wired)."""
    return HermesParser()


def call_text(name: str, arguments: Any) -> str:
    """An assistant tool call as text the parser reads back; the server puts it in the content
    of history messages when the chat template cannot render `tool_calls` itself."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"
