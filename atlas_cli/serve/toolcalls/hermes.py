"""Qwen3 / Qwen2.5 ("hermes"): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
as vLLM's Hermes2ProToolParser reads it. A block ends at the first `</tool_call>` outside a
JSON string (code in an argument may hold the tag). Its calls stream as they are written
(`json_stream.py`): the name as soon as it is known, then the arguments in pieces; a call cut
off (bad JSON after the name, or the token limit) keeps what was written. A block that yields
no call (no function name, empty, broken before the name) is kept as content text; where vLLM
decides on the whole output we decide per block, which a stream can.

Qwen2.5-Coder writes its calls as a fenced JSON block instead (a "```json" line, the call
object or a list of them, a "```" line), or bare. As llama.cpp does, either is a call when it
is the first thing the content says, and only for the request's own tools (a model asked for
JSON writes JSON).
"""

from __future__ import annotations

import re
from typing import Any

from atlas_cli.serve.toolcalls.base import ToolParser
from atlas_cli.serve.toolcalls.events import CallScan
from atlas_cli.serve.toolcalls.json_stream import JsonCallReader
from atlas_cli.serve.toolcalls.tags import (
    FENCE_CLOSE,
    JSON_FENCE_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    partial_tag,
)

_JSON_OUTSIDE = {
    closer: re.compile('"|' + re.escape(closer)) for closer in (TOOL_CALL_CLOSE, FENCE_CLOSE)
}
_JSON_IN_STRING = re.compile(r'[\\"\n]')


def _json_block_close(
    text: str, start: int, closer: str, final: bool, memo: dict[str, Any]
) -> int | None:
    """Index of the `closer` that ends a JSON block whose body starts at `start`: the
    first one outside a JSON string (code in an argument may hold the tag). A raw newline
    cannot be inside a JSON string, so one ends a broken string and the scan resyncs. None
    while unknown (or, when `final`, if there is none). `memo` keeps the lexer's place:
    `memo["pos"]`, before which no closing tag can start."""
    pos, in_string = memo.get("pos", start), bool(memo.get("in_string", 0))
    while True:
        if not in_string:
            match = _JSON_OUTSIDE[closer].search(text, pos)
            if match is None:
                held = partial_tag(text, pos, (closer,))  # `</tool_c` may go on
                memo["pos"], memo["in_string"] = len(text) - held, 0
                return None
            if match.group() == closer:
                return match.start()
            pos, in_string = match.end(), True
            continue
        match = _JSON_IN_STRING.search(text, pos)
        if match is None or (match.group() == "\\" and match.end() == len(text) and not final):
            memo["pos"], memo["in_string"] = (match.start() if match else len(text)), 1
            return None
        if match.group() == "\\":
            pos = match.end() + 1  # an escaped character
        else:  # `"` closes the string; a newline means it was broken
            pos, in_string = match.end(), False


class HermesParser(ToolParser):
    """Qwen3 / Qwen2.5: JSON inside `<tool_call>...</tool_call>` (vLLM `hermes`)."""

    name = "hermes"
    blocks = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE}
    # a fenced call, or a bare call object or list of them (its own body, ended by its close)
    leading_blocks = {JSON_FENCE_OPEN: FENCE_CLOSE, "{": "}", "[": "]"}
    keep_opener = frozenset({"{", "["})

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, Any]
    ) -> tuple[list[CallScan], int | None]:
        if opener in self.keep_opener:  # bare JSON: the block ends with its closing bracket
            reader = memo.setdefault("reader", JsonCallReader(start, one_value=True))
            reader.read(text, len(text), settled=final)
            end = reader.pos if reader.done else (len(text) if final else None)
        else:
            # The calls are read up to where no closing tag can start yet, so a piece written
            # is never text that turns out to lie past the block's end.
            closer = self.blocks.get(opener) or self.leading_blocks[opener]
            close = _json_block_close(text, start, closer, final, memo)
            reader = memo.setdefault("reader", JsonCallReader(start))
            if close is not None:
                reader.read(text, close, settled=True)
                end = close + len(closer)
            else:
                reader.read(text, len(text) if final else memo["pos"], settled=final)
                end = len(text) if final else None
        if opener in self.leading_blocks:
            return self._declared(reader.calls), end
        return reader.calls, end

    def _declared(self, calls: list[CallScan]) -> list[CallScan]:
        """A leading block's calls up to the first that names no declared tool: a model asked
        for JSON writes JSON too, and only a call of the request's tools is one."""
        for k, call in enumerate(calls):
            if call.name not in self.schemas:
                return calls[:k]
        return calls
