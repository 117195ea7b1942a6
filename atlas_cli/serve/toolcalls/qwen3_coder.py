"""Qwen3.5 / Qwen3.6 / Qwen3-Coder ("qwen3_coder"), as vLLM's Qwen3CoderToolParser reads it:
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n
</tool_call>`, values raw text converted with the tool's JSON schema (`values.py`).

Blocks are scanned by their structure, as newer vLLM does: a `</parameter>`, `</function>` or
`</tool_call>` inside a value (code that contains these tags) counts as a closing tag only
when what follows it fits the format. Unterminated blocks, missing closing tags, nested or
duplicated tags and unknown parameter names give best-effort calls. A call cut off by the
token limit is still returned (as vLLM does): check the finish reason.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

from atlas_cli.serve.toolcalls.base import ToolParser
from atlas_cli.serve.toolcalls.events import CallScan, valid_name
from atlas_cli.serve.toolcalls.json_stream import json_calls
from atlas_cli.serve.toolcalls.tags import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    partial_tag,
)
from atlas_cli.serve.toolcalls.values import arguments_value, convert_parameter, dumps


class _Wait(Exception):
    """The text so far cannot settle this yet: wait for the next delta."""


_WHITESPACE = re.compile(r"\s*")
_BLOCK_START = re.compile(re.escape(FUNCTION_OPEN) + "|" + re.escape(TOOL_CALL_CLOSE))
_BODY_TAG = re.compile("|".join(map(re.escape, (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE))))
_VALUE_ENDS = (PARAMETER_CLOSE, "\n" + PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
_VALUE_END = re.compile("|".join(map(re.escape, _VALUE_ENDS)))
_LONGEST_VALUE_END = max(map(len, _VALUE_ENDS))
# What may follow a closing tag for it to be structure rather than text inside a value.
_AFTER_PARAMETER = (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
_AFTER_FUNCTION = (TOOL_CALL_CLOSE, FUNCTION_OPEN, TOOL_CALL_OPEN)
_AFTER_TOOL_CALL = (TOOL_CALL_OPEN,)


class _XmlBlock:
    """One Qwen3.5 XML call block, scanned by its structure (vLLM Qwen3CoderToolParser's
    formats and repairs, as a cursor scan): `<function=NAME>`, then `<parameter=NAME>` values,
    `</function>`, `</tool_call>`.

    A closing tag inside a value counts as structure only if what follows it fits (`</parameter>`
    then `<parameter=`, `</function>` or `</tool_call>`), so code that contains these tags
    survives. Repairs: a missing `</parameter>` ends at the next `\\n<parameter=` or at a
    structural `</function>`/`</tool_call>`; a missing `</function>` at `</tool_call>`; a
    missing `</tool_call>` after `</function>`. Each decision waits (`_Wait`) until the text
    that settles it has arrived, so a scan of a prefix is a prefix of the scan of the whole.
    """

    def __init__(
        self,
        text: str,
        start: int,
        final: bool,
        schemas: Mapping[str, dict],
        bare: bool,
        memo: dict[Any, Any],
    ):
        self.text, self.final, self.schemas, self.bare = text, final, schemas, bare
        # value start -> where its end search may resume: every tag before it was already
        # found to be text (decisions a longer text cannot change); saves rescanning long
        # values on every delta
        self.memo = memo
        self.start = start
        self.calls: list[CallScan] = []
        self.end: int | None = None  # just after the block
        self.body_end = len(text)  # where its closing tag starts (the JSON fallback's body)
        with contextlib.suppress(_Wait):  # the calls so far stand; `end` stays None
            self._scan()

    def _peek(self, pos: int, options: tuple[str, ...]) -> tuple[int, str | None]:
        """Skip whitespace; the option that starts there, or None for anything else (or the
        end of a final text, also where it ends inside an option). Waits while the rest could
        still become an option."""
        text = self.text
        i = _WHITESPACE.match(text, pos).end()
        for option in options:
            if text.startswith(option, i):
                return i, option
        rest = len(text) - i
        if any(rest < len(o) and o.startswith(text[i:]) for o in options):
            if not self.final:
                raise _Wait
            return len(text), None  # the text ends inside a tag: cut off by the token limit
        return i, None

    def _search(self, pattern: re.Pattern[str], pos: int) -> re.Match[str] | None:
        match = pattern.search(self.text, pos)
        if match is None and not self.final:
            raise _Wait
        return match

    def _scan(self) -> None:
        text, pos = self.text, self.start
        if self.bare:  # `<function=...>...</function>` with no <tool_call>: one function
            self.end = self.body_end = self._function(pos)[0]
            return
        while True:
            match = self._search(_BLOCK_START, pos)
            if match is None:  # final text, unterminated block
                self.end = len(text)
                return
            if match.group() == TOOL_CALL_CLOSE:
                self.body_end, self.end = match.start(), match.end()
                return
            pos, valid = self._function(match.start())
            while valid:  # after a function: another one, the block's end, or text
                i, tag = self._peek(pos, _AFTER_FUNCTION)
                if tag == FUNCTION_OPEN:
                    pos, valid = self._function(i)
                    continue
                if tag == TOOL_CALL_CLOSE:
                    self.body_end, self.end = i, i + len(tag)
                elif i == len(text):  # the text ends (inside `</tool_call>` maybe)
                    self.body_end = self.end = i
                else:  # missing </tool_call>: what follows is not part of the block
                    self.body_end = self.end = pos
                return

    def _function(self, start: int) -> tuple[int, bool]:
        """Scan `<function=NAME>...` at `start`: the index just after it, and whether it was a
        function (a bad name makes the tag text)."""
        text = self.text
        name_end = text.find(">", start + len(FUNCTION_OPEN))
        if name_end == -1:
            if not self.final:
                raise _Wait
            return len(text), False
        name = text[start + len(FUNCTION_OPEN) : name_end].strip()
        if not valid_name(name):
            return start + len(FUNCTION_OPEN), False
        properties = self.schemas.get(name, {}).get("properties")
        call = CallScan(name, [], False)
        self.calls.append(call)
        seen: set[str] = set()
        pos = name_end + 1
        while True:
            i, tag = self._peek(pos, _AFTER_PARAMETER)
            if tag == FUNCTION_CLOSE:
                pos = i + len(tag)
                break
            if tag == TOOL_CALL_CLOSE or i == len(text):  # missing </function>
                pos = i
                break
            if tag is None:  # stray text between parameters: skip to the next tag
                match = self._search(_BODY_TAG, i)
                if match is None:
                    pos = len(text)
                    break
                pos = match.start()
                continue
            pos = self._parameter(i, call, seen, properties)
        call.fragments.append("}" if call.fragments else "{}")
        call.complete = True
        return pos, True

    def _parameter(self, start: int, call: CallScan, seen: set[str], properties: Any) -> int:
        text = self.text
        name_end = text.find(">", start + len(PARAMETER_OPEN))
        if name_end == -1:
            if not self.final:
                raise _Wait
            return len(text)
        value_start = name_end + 1
        search = self.memo.get(value_start, value_start)
        while True:
            match = _VALUE_END.search(text, search)
            if match is None and not self.final:
                # a tag may still complete in the last few characters
                self.memo[value_start] = max(search, len(text) - _LONGEST_VALUE_END)
                raise _Wait
            if match is None:  # final text: the value runs to its end, less a cut-off tag
                pos = len(text)
                value_end = pos - partial_tag(text, search, _VALUE_ENDS)
                break
            tag = match.group()
            if tag[0] == "\n":  # missing </parameter>: the next parameter starts
                value_end = pos = match.start() + 1
                break
            follow = {
                PARAMETER_CLOSE: _AFTER_PARAMETER,
                FUNCTION_CLOSE: _AFTER_FUNCTION,
                TOOL_CALL_CLOSE: _AFTER_TOOL_CALL,
            }[tag]
            self.memo[value_start] = match.start()
            i, after = self._peek(match.end(), follow)
            if after is not None or i == len(text):  # structure, not text in the value
                value_end = match.start()
                pos = match.end() if tag == PARAMETER_CLOSE else match.start()
                break
            search = match.start() + 1
        name = text[start + len(PARAMETER_OPEN) : name_end].strip()
        if valid_name(name) and name not in seen:  # first wins: a stream cannot take back
            seen.add(name)
            raw = text[value_start:value_end]
            raw = raw[1:] if raw.startswith("\n") else raw  # the template wraps values in \n
            raw = raw[:-1] if raw.endswith("\n") else raw
            schema = properties.get(name) if isinstance(properties, Mapping) else None
            value = convert_parameter(raw, schema)
            lead = "{" if not call.fragments else ", "
            call.fragments.append(f"{lead}{dumps(name)}: {dumps(value)}")
        return pos


class Qwen3CoderParser(ToolParser):
    """Qwen3.5 / Qwen3.6 / Qwen3-Coder: `<function=...><parameter=...>` XML (vLLM
    `qwen3_coder`), streaming one parameter at a time. Like vLLM it also takes a bare
    `<function=...>...</function>` without `<tool_call>`, and a JSON body as a fallback."""

    name = "qwen3_coder"
    blocks = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE, FUNCTION_OPEN: FUNCTION_CLOSE}
    keep_opener = frozenset({FUNCTION_OPEN})

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, Any]
    ) -> tuple[list[CallScan], int | None]:
        bare = opener == FUNCTION_OPEN
        block = _XmlBlock(text, start, final, self.schemas, bare, memo)
        if block.calls or block.end is None:
            return block.calls, block.end
        # no XML call: maybe the model answered in Qwen3's JSON format
        return json_calls(text[start : block.body_end]), block.end

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """The XML form, rendered as the Qwen3.5 template renders history calls: strings
        raw, objects and arrays as JSON, other values with Jinja's `|string`."""
        args = arguments_value(arguments)
        lines = [TOOL_CALL_OPEN, f"{FUNCTION_OPEN}{name}>"]
        for key, value in args.items() if isinstance(args, Mapping) else ():
            if not isinstance(value, str):
                value = dumps(value) if isinstance(value, dict | list) else str(value)
            lines += [f"{PARAMETER_OPEN}{key}>", value, PARAMETER_CLOSE]
        return "\n".join([*lines, FUNCTION_CLOSE, TOOL_CALL_CLOSE])
