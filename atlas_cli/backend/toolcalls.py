"""Tool calls and reasoning in Qwen-family outputs, parsed whole or while streaming.

Two tool-call formats (facts: shared notes, formats.md section 4):
- Qwen3 / Qwen2.5 ("hermes"): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  as vLLM's Hermes2ProToolParser reads it.
- Qwen3.5 / Qwen3.6 ("qwen3_coder"): `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`, values raw text converted with the tool's JSON schema,
  as vLLM's Qwen3CoderToolParser reads it.

Reasoning follows vLLM's Qwen3ReasoningParser: a generated `<think>` is stripped, `</think>`
ends reasoning, a missing `</think>` means everything was reasoning (truncated) when the prompt
opened the think block and everything was content otherwise, and `<tool_call>` followed by
`<function=` ends reasoning implicitly (Qwen3.5 sometimes calls a tool without closing it).

There is one implementation: `StreamParser`, a state machine over the growing text that only
commits what no continuation can change and holds back any suffix that may be the start of a
tag. `ToolParser.parse` feeds it the whole text at once, so a stream and a whole parse of the
same text give the same message for every split into deltas (tested on random splits).

XML blocks are scanned by their structure, as newer vLLM does: a `</parameter>`,
`</function>` or `</tool_call>` inside a value (code that contains these tags) counts as a
closing tag only when what follows it fits the format. JSON blocks end at the first
`</tool_call>` outside a JSON string.

Malformed output never raises: a tool-call block that yields no call (bad JSON, no function
name, empty) is kept as content text; unterminated blocks, missing `</parameter>`,
`</function>` or `</tool_call>`, nested or duplicated tags and unknown parameter names give
best-effort calls; stray closing tags are dropped. Where vLLM decides on the whole output (it
turns *all* output into content when one call is bad) we decide per block, which a stream can.
A call cut off by the token limit is still returned (as vLLM does): check the finish reason.

Content and reasoning are whitespace-trimmed at both ends (as llama.cpp does and as the Qwen
templates `|trim` them when rendering history); content is the text outside tool-call blocks.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import random
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# ---------------------------------------------------------------------------------------------
# Results and stream events


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as in OpenAI's `function.arguments`

    def to_openai(self, *, decode_arguments: bool = False) -> dict[str, Any]:
        """OpenAI `tool_calls` entry. `decode_arguments` gives arguments as a dict, which is
        what chat templates iterate (`tool_call.arguments|items`)."""
        arguments: Any = self.arguments
        if decode_arguments:
            decoded = _json_value(self.arguments)
            arguments = self.arguments if decoded is _FAIL else decoded
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]

    def to_openai(self, *, decode_arguments: bool = False) -> dict[str, Any]:
        """An assistant message dict (`reasoning_content` as vLLM names it)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                c.to_openai(decode_arguments=decode_arguments) for c in self.tool_calls
            ]
        return message


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI streaming shape: the first delta of a call has `id` and `name` (and empty
    `arguments`), later ones only a chunk of the arguments JSON string."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(frozen=True)
class ToolCallEnd:
    """A call whose arguments are complete (sent after its last ToolCallDelta)."""

    index: int
    call: ToolCall


Event = ReasoningDelta | ContentDelta | ToolCallDelta | ToolCallEnd


# ---------------------------------------------------------------------------------------------
# Ids and schemas

_ID_ALPHABET = string.ascii_letters + string.digits


class ToolCallIds:
    """`call_` + 24 random alphanumerics (vLLM's shape); a seed makes them reproducible."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()

    def __call__(self) -> str:
        return "call_" + "".join(self._rng.choice(_ID_ALPHABET) for _ in range(24))


def tools_from_openai(tools: Iterable[Any] | None) -> dict[str, dict]:
    """{name: parameters JSON schema} from OpenAI `tools` (`{"type": "function", "function":
    {...}}`) or bare function dicts; entries without a name are skipped."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function")
        fn = fn if isinstance(fn, Mapping) else tool
        name = fn.get("name")
        if isinstance(name, str) and name:
            params = fn.get("parameters")
            schemas[name] = dict(params) if isinstance(params, Mapping) else {}
    return schemas


# ---------------------------------------------------------------------------------------------
# Parameter values (Qwen3.5 XML format): raw text -> JSON value by the parameter's schema

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_FAIL = object()


def _schema_types(schema: Mapping) -> tuple[str, bool]:
    """(first non-null type, whether null is allowed), looking through anyOf/oneOf."""
    types: list[str] = []

    def collect(node: Any) -> None:
        if not isinstance(node, Mapping):
            return
        t = node.get("type")
        if isinstance(t, str):
            types.append(t.strip().lower())
        elif isinstance(t, list):
            types.extend(str(x).strip().lower() for x in t)
        for key in ("anyOf", "oneOf"):
            for option in node.get(key) or ():
                collect(option)

    collect(schema)
    nullable = "null" in types
    primary = next((t for t in types if t != "null"), "null" if nullable else "string")
    return primary, nullable


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _FAIL


def _python_literal(text: str) -> Any:
    # The model may echo Python reprs ({'a': True}); literal_eval evaluates literals only.
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _FAIL


def _as_json(value: Any) -> Any:
    """`value` as JSON would give it back (tuples become lists), or _FAIL for sets, bytes,
    NaN and other things JSON cannot hold."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return _FAIL


def convert_parameter(raw: str, schema: Any) -> Any:
    """One XML parameter value as the tool's JSON schema types it (vLLM Qwen3CoderToolParser
    `_convert_param_value`): strings raw, numbers and booleans parsed, objects and arrays via
    json.loads then ast.literal_eval, `null`/`None` when the schema allows null. Anything that
    does not convert stays the raw string; no schema (unknown tool or parameter) means raw."""
    if not isinstance(schema, Mapping):
        return raw
    kind, nullable = _schema_types(schema)
    text = raw.strip()
    # The Qwen3.5 template renders non-string scalars with `|string`: None, True, False.
    if text.lower() in ("null", "none") and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return raw
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        integer = _integer(text)
        if integer is not None:
            return integer
        number = _finite_float(text)
        return int(number) if number is not None and number.is_integer() else raw
    if kind.startswith(("num", "float", "double", "decimal")):
        integer = _integer(text)
        if integer is not None:
            return integer
        number = _finite_float(text)
        return raw if number is None else number
    if kind in ("boolean", "bool", "binary"):
        lowered = text.lower()
        return lowered == "true" if lowered in ("true", "false") else raw
    if kind == "null":
        return raw
    # object, array and unknown types: JSON first, Python literal second.
    value = _json_value(text)
    if isinstance(value, str) and kind in ("object", "array", "dict", "list"):
        inner = _as_json(_python_literal(value))  # a JSON-encoded repr: "{'k': 'v'}"
        value = value if inner is _FAIL else inner
    if value is _FAIL:
        value = _as_json(_python_literal(text))
    return raw if value is _FAIL else value


def _integer(text: str) -> int | None:
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        return None
    try:
        return int(text)
    except ValueError:  # beyond Python's int-from-string digit limit
        return None


def _finite_float(text: str) -> float | None:
    try:
        number = float(text)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


# ---------------------------------------------------------------------------------------------
# Block scanners: what one tool-call block holds so far


@dataclass
class _CallScan:
    name: str
    fragments: list[str]  # the arguments JSON string, in pieces that only ever get appended
    complete: bool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments_value(arguments: Any) -> Any:
    """Call arguments as a value: JSON text is decoded (kept as text if it does not)."""
    if isinstance(arguments, str):
        decoded = _json_value(arguments) if arguments.strip() else {}
        return arguments if decoded is _FAIL else decoded
    return {} if arguments is None else arguments


def _valid_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "<>\n\r")


_JSON_START = re.compile(r"[\[{]")


def _json_calls(body: str) -> list[_CallScan]:
    """Hermes JSON calls in a block body: `{"name": ..., "arguments": ...}` objects (several,
    or a list, tolerated), stopping at the first thing that does not decode."""
    decoder = json.JSONDecoder()
    calls: list[_CallScan] = []
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


def _json_call(obj: Any) -> _CallScan | None:
    if not isinstance(obj, dict):
        return None
    if not isinstance(obj.get("name"), str) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"function": {"name": ..., "arguments": ...}}
    name = obj.get("name")
    if not isinstance(name, str) or not _valid_name(name.strip()):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        text = "{}"
    elif isinstance(args, str):  # arguments already a JSON string: normalise it
        decoded = _json_value(args)
        text = _dumps(args if decoded is _FAIL else decoded)
    else:
        text = _dumps(args)
    return _CallScan(name.strip(), [text], True)


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
        memo: dict[Any, int],
    ):
        self.text, self.final, self.schemas, self.bare = text, final, schemas, bare
        # value start -> where its end search may resume: every tag before it was already
        # found to be text (decisions a longer text cannot change); saves rescanning long
        # values on every delta
        self.memo = memo
        self.start = start
        self.calls: list[_CallScan] = []
        self.end: int | None = None  # just after the block
        self.body_end = len(text)  # where its closing tag starts (the JSON fallback's body)
        with contextlib.suppress(_Wait):  # the calls so far stand; `end` stays None
            self._scan()

    def _peek(self, pos: int, options: tuple[str, ...]) -> tuple[int, str | None]:
        """Skip whitespace; the option that starts there, or None for anything else (or the
        end of a final text). Waits while the rest could still become an option."""
        text = self.text
        i = _WHITESPACE.match(text, pos).end()
        for option in options:
            if text.startswith(option, i):
                return i, option
        rest = len(text) - i
        if not self.final and any(rest < len(o) and o.startswith(text[i:]) for o in options):
            raise _Wait
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
        if not _valid_name(name):
            return start + len(FUNCTION_OPEN), False
        properties = self.schemas.get(name, {}).get("properties")
        call = _CallScan(name, [], False)
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

    def _parameter(self, start: int, call: _CallScan, seen: set[str], properties: Any) -> int:
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
            if match is None:  # final text: the value runs to its end
                value_end = pos = len(text)
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
        if _valid_name(name) and name not in seen:  # first wins: a stream cannot take back
            seen.add(name)
            raw = text[value_start:value_end]
            raw = raw[1:] if raw.startswith("\n") else raw  # the template wraps values in \n
            raw = raw[:-1] if raw.endswith("\n") else raw
            schema = properties.get(name) if isinstance(properties, Mapping) else None
            value = convert_parameter(raw, schema)
            lead = "{" if not call.fragments else ", "
            call.fragments.append(f"{lead}{_dumps(name)}: {_dumps(value)}")
        return pos


# ---------------------------------------------------------------------------------------------
# Parsers


class ToolParser:
    """Base: no tool calls. Subclasses name the tags that open a call block and scan blocks."""

    name: ClassVar[str] = "none"
    # opening tag of a call block -> its closing tag (a stray closer is dropped from content)
    blocks: ClassVar[dict[str, str]] = {}
    # opening tags that belong to the block body (a bare `<function=...>` is its own body)
    keep_opener: ClassVar[frozenset[str]] = frozenset()
    tags: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        tools: Iterable[Any] | Mapping[str, dict] | None = None,
        *,
        seed: int | None = None,
    ):
        if isinstance(tools, Mapping):
            self.schemas: dict[str, dict] = {k: dict(v) for k, v in tools.items()}
        else:
            self.schemas = tools_from_openai(tools)
        self.new_id = ToolCallIds(seed)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Tags the content scan looks for: block openers, then stray closers (`</tool_call>`
        # left over from a nested or duplicated block), which are dropped from content.
        closers = [c for c in dict.fromkeys(cls.blocks.values()) if c not in cls.blocks]
        cls.tags = (*cls.blocks, *closers)

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, int]
    ) -> tuple[list[_CallScan], int | None]:
        """The calls in a block whose body starts at `text[start]` (after `opener`), as far
        as `text` settles them, and the index just after the block (None while unknown;
        always known when `final`). No calls in an ended block: it was text after all.
        `memo` is the block's scratch space between deltas."""
        return [], len(text)

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """An assistant call as the text this format's model writes (the server puts it in
        history when a chat template cannot render `tool_calls`); Hermes JSON by default.
        `arguments` is a dict or its JSON text."""
        args = _arguments_value(arguments)
        body = _dumps({"name": name, "arguments": args})
        return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"

    def stream(self, *, prompt_opened_think: bool = False) -> StreamParser:
        return StreamParser(self, prompt_opened_think=prompt_opened_think)

    def parse(self, text: str, *, prompt_opened_think: bool = False) -> ParsedMessage:
        stream = self.stream(prompt_opened_think=prompt_opened_think)
        stream.feed(text)
        stream.finish()
        return stream.message


class NoToolParser(ToolParser):
    """Reasoning split only; tool-call tags stay content text."""

    name = "none"


class HermesParser(ToolParser):
    """Qwen3 / Qwen2.5: JSON inside `<tool_call>...</tool_call>` (vLLM `hermes`)."""

    name = "hermes"
    blocks = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE}

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, int]
    ) -> tuple[list[_CallScan], int | None]:
        # A JSON call is known only once whole, so it comes out when its block closes.
        close = _json_block_close(text, start, final, memo)
        if close is not None:
            return _json_calls(text[start:close]), close + len(TOOL_CALL_CLOSE)
        return (_json_calls(text[start:]), len(text)) if final else ([], None)


class Qwen3CoderParser(ToolParser):
    """Qwen3.5 / Qwen3.6 / Qwen3-Coder: `<function=...><parameter=...>` XML (vLLM
    `qwen3_coder`), streaming one parameter at a time. Like vLLM it also takes a bare
    `<function=...>...</function>` without `<tool_call>`, and a JSON body as a fallback."""

    name = "qwen3_coder"
    blocks = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE, FUNCTION_OPEN: FUNCTION_CLOSE}
    keep_opener = frozenset({FUNCTION_OPEN})

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, int]
    ) -> tuple[list[_CallScan], int | None]:
        bare = opener == FUNCTION_OPEN
        block = _XmlBlock(text, start, final, self.schemas, bare, memo)
        if block.calls or block.end is None:
            return block.calls, block.end
        # no XML call: maybe the model answered in Qwen3's JSON format
        return _json_calls(text[start : block.body_end]), block.end

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """The XML form, rendered as the Qwen3.5 template renders history calls: strings
        raw, objects and arrays as JSON, other values with Jinja's `|string`."""
        args = _arguments_value(arguments)
        lines = [TOOL_CALL_OPEN, f"{FUNCTION_OPEN}{name}>"]
        for key, value in args.items() if isinstance(args, Mapping) else ():
            if not isinstance(value, str):
                value = _dumps(value) if isinstance(value, dict | list) else str(value)
            lines += [f"{PARAMETER_OPEN}{key}>", value, PARAMETER_CLOSE]
        return "\n".join([*lines, FUNCTION_CLOSE, TOOL_CALL_CLOSE])


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "none": NoToolParser,
}


def select_parser(chat_template: str | None, override: str | None = None) -> type[ToolParser]:
    """The parser for a model, chosen from its chat template's text as llama.cpp does
    (common/chat.cpp): `<function=` and `<parameter=` -> qwen3_coder, `<tool_call>` -> hermes,
    else none. A recipe or flag `override` ("hermes" | "qwen3_coder" | "none") wins."""
    if override not in (None, "", "auto"):
        if override not in PARSERS:
            from atlas_cli.errors import UsageError

            raise UsageError(
                f"unknown tool-call parser {override!r}; use one of: {', '.join(PARSERS)}"
            )
        return PARSERS[override]
    template = chat_template or ""
    if FUNCTION_OPEN in template and PARAMETER_OPEN in template:
        return Qwen3CoderParser
    if TOOL_CALL_OPEN in template:
        return HermesParser
    return NoToolParser


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (Qwen3.5/3.6 with thinking
    on end the generation prompt with `<think>\\n`), so the output starts as reasoning."""
    return prompt.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, prompt_opened_think: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output; tool-call text stays in content."""
    message = NoToolParser().parse(text, prompt_opened_think=prompt_opened_think)
    return message.reasoning, message.content


# ---------------------------------------------------------------------------------------------
# The streaming state machine


def _partial_tag(text: str, start: int, tags: Iterable[str]) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a tag."""
    best = 0
    room = len(text) - start
    for tag in tags:
        for k in range(min(len(tag) - 1, room), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


_FUNCTION_AFTER = re.compile(r"\s*<function=")
_FUNCTION_PENDING = re.compile(r"\s*(?:<(?:f(?:u(?:n(?:c(?:t(?:i(?:o(?:n)?)?)?)?)?)?)?)?)?\Z")


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
    memo: dict[Any, int] = field(default_factory=dict)


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

    def __init__(self, parser: ToolParser, *, prompt_opened_think: bool = False):
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
        buf, search = self._buf, self._pos
        while True:
            close = buf.find(THINK_CLOSE, search)
            call = buf.find(TOOL_CALL_OPEN, search)
            if call != -1 and (close == -1 or call < close):
                after = call + len(TOOL_CALL_OPEN)
                if _FUNCTION_AFTER.match(buf, after):  # implicit end of reasoning
                    self._emit_reasoning(buf[self._pos : call], events)
                    self._pos, self._state = call, _CONTENT
                    return True
                if not final and _FUNCTION_PENDING.match(buf, after):
                    self._emit_reasoning(buf[self._pos : call], events)  # wait and see
                    self._pos = call
                    return False
                search = call + 1  # a `<tool_call>` mentioned in reasoning text
                continue
            if close != -1:
                self._emit_reasoning(buf[self._pos : close], events)
                self._pos, self._state = close + len(THINK_CLOSE), _CONTENT
                return True
            end = len(buf)
            if not final:
                end -= _partial_tag(buf, self._pos, (THINK_CLOSE, TOOL_CALL_OPEN))
            self._emit_reasoning(buf[self._pos : end], events)
            self._pos = end
            return False

    def _step_content(self, final: bool, events: list[Event]) -> bool:
        buf, parser = self._buf, self._parser
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
            body_start = found if tag in parser.keep_opener else found + len(tag)
            self._block = _Block(found, body_start, tag)
            self._pos, self._state = found + len(tag), _BLOCK
            return True
        end = len(buf)
        if not final:
            end -= _partial_tag(buf, self._pos, tags)
        self._emit_content(buf[self._pos : end], events)
        self._pos = end
        return False

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

    def _emit_calls(self, block: _Block, scans: list[_CallScan], events: list[Event]) -> None:
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
