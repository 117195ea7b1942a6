"""Qwen3 / Qwen2.5 ("hermes"): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
as vLLM's Hermes2ProToolParser reads it. A block ends at the first `</tool_call>` outside a
JSON string (code in an argument may hold the tag). A block that yields no call (bad JSON, no
function name, empty) is kept as content text; where vLLM decides on the whole output (it
turns *all* output into content when one call is bad) we decide per block, which a stream can.
"""

from __future__ import annotations

import json
import re
from typing import Any

from atlas_cli.serve.toolcalls.base import ToolParser
from atlas_cli.serve.toolcalls.events import CallScan, valid_name
from atlas_cli.serve.toolcalls.tags import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from atlas_cli.serve.toolcalls.values import FAIL, dumps, json_value

_JSON_START = re.compile(r"[\[{]")


def json_calls(body: str) -> list[CallScan]:
    """Hermes JSON calls in a block body: `{"name": ..., "arguments": ...}` objects (several,
    or a list, tolerated), stopping at the first thing that does not decode."""
    decoder = json.JSONDecoder()
    calls: list[CallScan] = []
    pos = 0
    while (match := _JSON_START.search(body, pos)) is not None:
        try:
            value, pos = decoder.raw_decode(body, match.start())
        except (ValueError, RecursionError):
            break
        for obj in value if isinstance(value, list) else [value]:
            call = _json_call(obj)
            if call is not None:
                calls.append(call)
    return calls


def _json_call(obj: Any) -> CallScan | None:
    if not isinstance(obj, dict):
        return None
    if not isinstance(obj.get("name"), str) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"function": {"name": ..., "arguments": ...}}
    name = obj.get("name")
    if not isinstance(name, str) or not valid_name(name.strip()):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        text = "{}"
    elif isinstance(args, str):  # arguments already a JSON string: normalise it
        decoded = json_value(args)
        text = dumps(args if decoded is FAIL else decoded)
    else:
        text = dumps(args)
    return CallScan(name.strip(), [text], True)


_JSON_OUTSIDE = re.compile('"|' + re.escape(TOOL_CALL_CLOSE))
_JSON_IN_STRING = re.compile(r'[\\"\n]')


def _json_block_close(text: str, start: int, final: bool, memo: dict[str, int]) -> int | None:
    """Index of the `</tool_call>` that ends a JSON block whose body starts at `start`: the
    first one outside a JSON string (code in an argument may hold the tag). A raw newline
    cannot be inside a JSON string, so one ends a broken string and the scan resyncs. None
    while unknown (or, when `final`, if there is none). `memo` keeps the lexer's place."""
    pos, in_string = memo.get("pos", start), bool(memo.get("in_string", 0))
    while True:
        if not in_string:
            match = _JSON_OUTSIDE.search(text, pos)
            if match is None:
                memo["pos"], memo["in_string"] = max(pos, len(text) - len(TOOL_CALL_CLOSE)), 0
                return None
            if match.group() == TOOL_CALL_CLOSE:
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

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, int]
    ) -> tuple[list[CallScan], int | None]:
        # A JSON call is known only once whole, so it comes out when its block closes.
        close = _json_block_close(text, start, final, memo)
        if close is not None:
            return json_calls(text[start:close]), close + len(TOOL_CALL_CLOSE)
        return (json_calls(text[start:]), len(text)) if final else ([], None)
