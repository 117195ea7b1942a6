"""The streaming state machine, the one implementation of parsing: it runs over the growing
text, commits only what no continuation can change, and holds back any suffix that may be the
start of a tag. A whole parse feeds it the whole text at once, so a stream and a whole parse
of the same text give the same message for every split into deltas (tested on random splits).

States: the start (a generated `<think>`?), reasoning (see `reasoning.py`), content, and a
tool-call block, which the format's `scan_block` reads (`hermes.py`, `qwen3_coder.py`).
Content and reasoning are whitespace-trimmed at both ends (as llama.cpp does and as the Qwen
templates `|trim` them when rendering history); content is the text outside tool-call blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from atlas_cli.serve.toolcalls.events import (
    CallScan,
    ContentDelta,
    Event,
    ParsedMessage,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
)
from atlas_cli.serve.toolcalls.reasoning import reasoning_end
from atlas_cli.serve.toolcalls.tags import THINK_OPEN, partial_tag


class CallFormat(Protocol):
    """What the machine asks of a tool-call format (`base.ToolParser` and its subclasses)."""

    blocks: dict[str, str]  # opening tag of a call block -> its closing tag
    keep_opener: frozenset[str]  # opening tags that belong to the block body
    leading_blocks: dict[str, str]  # openers honoured only where the content starts
    tags: tuple[str, ...]  # what the content scan looks for: openers, then stray closers
    new_id: Callable[[], str]

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, Any]
    ) -> tuple[list[CallScan], int | None]: ...


class _Channel:
    """Reasoning or content text, trimmed at both ends as it streams: leading whitespace is
    dropped, trailing whitespace held until more text follows it."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.pending = ""
        self.started = False

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        out = text.rstrip()
        self.pending = text[len(out) :]
        if out:
            self.parts.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class _Block:
    start: int  # index of the opening tag in the buffer
    body_start: int
    opener: str
    call_indices: list[int] = field(default_factory=list)
    memo: dict[Any, Any] = field(default_factory=dict)


@dataclass
class _OpenCall:
    id: str
    name: str
    fragments: list[str] = field(default_factory=list)
    done: bool = False


_START, _REASONING, _CONTENT, _BLOCK = range(4)


class StreamParser:
    """Feed generated text deltas; get reasoning, content and tool-call events. `finish()`
    flushes what was held back; `message` is then the whole parse."""

    def __init__(self, parser: CallFormat, *, prompt_opened_think: bool = False):
        self._parser = parser
        self._buf = ""
        self._pos = 0  # everything before this index has been committed
        self._state = _START
        self._reasoning_mode = prompt_opened_think
        self._reasoning = _Channel()
        self._content = _Channel()
        self._calls: list[_OpenCall] = []
        self._block: _Block | None = None
        self._message: ParsedMessage | None = None

    def feed(self, delta: str) -> list[Event]:
        if self._message is not None:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        if self._message is not None:
            return []
        events = self._advance(final=True)
        self._message = ParsedMessage(
            content=self._content.text,
            reasoning=(self._reasoning.text or None) if self._reasoning_mode else None,
            tool_calls=[ToolCall(c.id, c.name, "".join(c.fragments)) for c in self._calls],
        )
        return events

    @property
    def message(self) -> ParsedMessage:
        if self._message is None:
            raise RuntimeError("message is known after finish()")
        return self._message

    # -- states --------------------------------------------------------------------------

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            state = self._state
            if state == _START:
                moved = self._step_start(final)
            elif state == _REASONING:
                moved = self._step_reasoning(final, events)
            elif state == _CONTENT:
                moved = self._step_content(final, events)
            else:
                moved = self._step_block(final, events)
            if not moved:
                return events

    def _step_start(self, final: bool) -> bool:
        # A generated `<think>` (Qwen3 writes its own) opens reasoning and is dropped.
        rest = self._buf[self._pos :].lstrip()
        if rest.startswith(THINK_OPEN):
            self._pos = len(self._buf) - len(rest) + len(THINK_OPEN)
            self._reasoning_mode = True
        elif not final and THINK_OPEN.startswith(rest):
            return False  # whitespace or a partial `<think>` so far
        self._state = _REASONING if self._reasoning_mode else _CONTENT
        return True

    def _step_reasoning(self, final: bool, events: list[Event]) -> bool:
        end, resume, ended = reasoning_end(self._buf, self._pos, final)
        self._emit_reasoning(self._buf[self._pos : end], events)
        self._pos = resume
        if ended:
            self._state = _CONTENT
        return ended

    def _step_leading(self, final: bool) -> bool | None:
        """Before any content or call: a leading block's opener as the first non-blank text
        opens that block (True); None when there is none, False while the text so far may
        still become one."""
        rest = self._buf[self._pos :].lstrip()
        for opener in self._parser.leading_blocks:
            if rest.startswith(opener):
                self._open_block(len(self._buf) - len(rest), opener)
                return True
            if not final and opener.startswith(rest):
                return False
        return None

    def _step_content(self, final: bool, events: list[Event]) -> bool:
        buf, parser = self._buf, self._parser
        if parser.leading_blocks and not self._content.started and not self._calls:
            leading = self._step_leading(final)
            if leading is not None:
                return leading
        tags = parser.tags
        found, tag = -1, ""
        for candidate in tags:
            i = buf.find(candidate, self._pos)
            if i != -1 and (found == -1 or i < found):
                found, tag = i, candidate
        if found != -1:
            self._emit_content(buf[self._pos : found], events)
            if tag not in parser.blocks:  # a closing tag with no block open: dropped
                self._pos = found + len(tag)
                return True
            self._open_block(found, tag)
            return True
        end = len(buf)
        if not final:
            end -= partial_tag(buf, self._pos, tags)
        self._emit_content(buf[self._pos : end], events)
        self._pos = end
        return False

    def _open_block(self, found: int, opener: str) -> None:
        """A call block opened by `opener` at `found` (its body starts after it, or at it for
        an opener that belongs to the body)."""
        body = found if opener in self._parser.keep_opener else found + len(opener)
        self._block = _Block(found, body, opener)
        self._pos, self._state = found + len(opener), _BLOCK

    def _step_block(self, final: bool, events: list[Event]) -> bool:
        block, buf = self._block, self._buf
        assert block is not None
        scans, end = self._parser.scan_block(buf, block.body_start, block.opener, final, block.memo)
        self._emit_calls(block, scans, events)
        if end is None:
            return False
        if not block.call_indices:  # nothing callable in it: it was text after all
            self._emit_content(buf[block.start : end], events)
        self._block = None
        self._pos, self._state = end, _CONTENT
        return True

    # -- events --------------------------------------------------------------------------

    def _emit_reasoning(self, text: str, events: list[Event]) -> None:
        if text and (out := self._reasoning.push(text)):
            events.append(ReasoningDelta(out))

    def _emit_content(self, text: str, events: list[Event]) -> None:
        if text and (out := self._content.push(text)):
            events.append(ContentDelta(out))

    def _emit_calls(self, block: _Block, scans: list[CallScan], events: list[Event]) -> None:
        for k, scan in enumerate(scans):
            if k == len(block.call_indices):
                index = len(self._calls)
                call_id = self._parser.new_id()
                self._calls.append(_OpenCall(call_id, scan.name))
                block.call_indices.append(index)
                events.append(ToolCallDelta(index, call_id, scan.name, ""))
            index = block.call_indices[k]
            call = self._calls[index]
            new = scan.fragments[len(call.fragments) :]
            if new:
                call.fragments.extend(new)
                events.append(ToolCallDelta(index, None, None, "".join(new)))
            if scan.complete and not call.done:
                call.done = True
                events.append(
                    ToolCallEnd(index, ToolCall(call.id, call.name, "".join(call.fragments)))
                )
