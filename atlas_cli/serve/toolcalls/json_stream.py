"""Tool calls written as JSON (Qwen3's Hermes format), read as the text grows: a call is
announced as soon as its name is known, then its arguments come out as canonical JSON text
(what `json.loads` then `dumps` of the whole gives: `", "` and `": "` spacing, no ASCII
escaping) in pieces that only ever get appended, while the model writes them.

Only what no continuation can change is written: a member's key goes out with the first
character of its value, a number or literal once a delimiter ends it, a string's characters
as they arrive (an escape once whole). A call is announced when its `"name"` string is
followed by `,` or `}`. When the JSON breaks or the text ends (a call cut off by the token
limit), an announced call ends with the arguments written so far, closed: an open string and
open containers get their closers, a member without a value (or with a number or literal
that may have gone on) is left out. A body that
announced no call gives none. Where whole-text JSON would take the last of duplicated keys, a
stream can only take the first (as the XML format does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from atlas_cli.serve.toolcalls.events import CallScan, valid_name
from atlas_cli.serve.toolcalls.values import FAIL, dumps, json_value

_WS = re.compile(r"[ \t\n\r]*")
_TOP_START = re.compile(r"[\[{]")
_BARE = re.compile(r"[0-9A-Za-z+.\-]*")  # a number or a literal
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # as Python's json reads
# a run of string text and the escapes `json.loads` decodes alone (`\\u` ones pair up)
_PLAIN = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])+')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ARGUMENT_KEYS = ("arguments", "parameters")

# What the reader expects next.
_TOP, _VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER, _STRING, _BARE_TOKEN = range(9)


class _Broken(Exception):
    """The text is not JSON here: stop reading the block."""


@dataclass
class _Call:
    """One call object being read."""

    scan: CallScan | None = None  # set once the name is settled
    pending: list[str] = field(default_factory=list)  # arguments read before the name
    name: str | None = None  # read, waiting for `,` or `}` to settle it
    args_started: bool = False
    delegated: bool = False  # {"function": {...}}: the inner object is the call

    def write(self, piece: str) -> None:
        (self.scan.fragments if self.scan is not None else self.pending).append(piece)


@dataclass
class _Frame:
    closer: str  # "}" or "]"
    role: str  # "list" (of calls) | "call" | "args" (written out) | "skip"
    call: _Call | None
    members: int = 0
    key: str | None = None  # an object's member being read


def canonical_token(token: str) -> str | None:
    """A number or literal as `dumps(json.loads(token))` writes it; None if it is neither."""
    if token not in _LITERALS and not _NUMBER.fullmatch(token):
        return None
    try:
        return dumps(json.loads(token))
    except (ValueError, RecursionError):  # beyond Python's int-from-string digit limit
        return None


class JsonCallReader:
    """Reads the JSON calls of one block body from `start`; `read` is called with the text
    as it grows (`limit`: how far it is settled), `calls` grows and its fragments append."""

    def __init__(self, start: int, *, one_value: bool = False):
        self.pos = start
        self.calls: list[CallScan] = []
        self.done = False
        self._one_value = one_value  # stop after the first top-level value (pos: just past it)
        self._state = _TOP
        self._stack: list[_Frame] = []
        self._held = ""  # what goes before the next written value: `, "key": `
        self._str_role = ""  # "key" | "name" | "args" | "args_text" | "skip"
        self._str_parts: list[str] = []
        self._str_call: _Call | None = None
        self._surrogate = ""  # a `\\uD8xx` escape waiting for its low half
        self._bare_start = 0
        self._bare_role = ""
        self._bare_call: _Call | None = None

    def read(self, text: str, limit: int, settled: bool) -> None:
        """Read `text[self.pos:limit]`; `settled`: nothing follows (the block ended)."""
        try:
            while not self.done and self._step(text, limit):
                pass
        except _Broken:
            self._stop(at_end=False)
        if settled and not self.done:
            self._stop(at_end=True)

    # -- the lexer -------------------------------------------------------------------------

    def _step(self, text: str, limit: int) -> bool:
        """Take one token (or a run of string text); False when more text is needed."""
        state = self._state
        if state == _STRING:
            return self._string(text, limit)
        if state == _BARE_TOKEN:
            end = _BARE.match(text, self.pos, limit).end()
            self.pos = end
            if end >= limit:
                return False  # the token may go on
            self._bare_done(text[self._bare_start : end])
            return True
        if state == _TOP:
            match = _TOP_START.search(text, self.pos, limit)
            if match is None:  # text between calls is skipped
                self.pos = limit
                return False
            self.pos = match.start()
        else:
            self.pos = _WS.match(text, self.pos, limit).end()
        if self.pos >= limit:
            return False
        self._structure(text[self.pos])
        return True

    def _structure(self, c: str) -> None:
        state, frame = self._state, self._stack[-1] if self._stack else None
        if state in (_TOP, _VALUE) or (state == _FIRST_ITEM and c != "]"):
            self._begin_value(c)
        elif state in (_FIRST_KEY, _KEY) and c == '"':
            self.pos += 1
            self._begin_string("key", None)
        elif state == _COLON and c == ":":
            self.pos += 1
            self._state = _VALUE
        elif frame is not None and c == frame.closer and state in (_AFTER, _FIRST_KEY, _FIRST_ITEM):
            self.pos += 1
            self._close_frame()
        elif frame is not None and c == "," and state == _AFTER:
            self.pos += 1
            if frame.role == "call":
                self._settle_name(frame.call)
            self._state = _KEY if frame.closer == "}" else _VALUE
        else:
            raise _Broken

    def _begin_value(self, c: str) -> None:
        role, call = self._role(c)
        parent = self._stack[-1] if self._stack else None
        held = self._take_held(parent) if role == "args" else ""
        if c in "{[":
            self.pos += 1
            frame_role = "args" if role in ("args", "args_root") else role
            if frame_role == "call":
                call = _Call()
            if frame_role == "args":
                call.write(held + c)
            self._stack.append(_Frame("}" if c == "{" else "]", frame_role, call))
            self._state = _FIRST_KEY if c == "{" else _FIRST_ITEM
        elif c == '"':
            self.pos += 1
            if role == "args":
                call.write(held + '"')
            str_role = {"args_root": "args_text", "call": "skip", "list": "skip"}.get(role, role)
            self._begin_string(str_role, call)
        elif _BARE.match(c).end():
            self._held, self._bare_start = held, self.pos
            self._bare_role, self._bare_call = role, call
            self._state = _BARE_TOKEN
        else:
            raise _Broken

    def _role(self, c: str) -> tuple[str, _Call | None]:
        """What a value that starts with `c` is, by where it stands, and its call."""
        parent = self._stack[-1] if self._stack else None
        if parent is None:
            return ("call" if c == "{" else "list"), None
        if parent.role == "list":
            return ("call" if c == "{" else "skip"), None
        if parent.role in ("args", "skip"):
            return parent.role, parent.call
        call, key = parent.call, parent.key  # a member of a call object
        free = call.scan is None and call.name is None and not call.delegated
        if key == "name" and c == '"' and free:
            return "name", call
        if key in _ARGUMENT_KEYS and not call.args_started and not call.delegated:
            call.args_started = True
            return "args_root", call
        if key == "function" and c == "{" and free:
            call.delegated = True
            return "call", None
        return "skip", None

    def _take_held(self, parent: _Frame | None) -> str:
        """The separator and key that go before a value inside written arguments."""
        if parent is None or parent.role != "args":
            return ""
        lead = ", " if parent.members else ""
        parent.members += 1
        return lead + (f"{dumps(parent.key)}: " if parent.closer == "}" else "")

    def _end_value(self) -> None:
        self._state = _AFTER if self._stack else _TOP
        self.done = self._one_value and not self._stack

    def _close_frame(self) -> None:
        frame = self._stack.pop()
        if frame.role == "args":
            frame.call.write(frame.closer)
        elif frame.role == "call":
            self._settle_name(frame.call)
            self._complete(frame.call)
        self._end_value()

    # -- strings and bare tokens -------------------------------------------------------------

    def _begin_string(self, role: str, call: _Call | None) -> None:
        self._str_role, self._str_call, self._str_parts = role, call, []
        self._state = _STRING

    def _string(self, text: str, limit: int) -> bool:
        pos = self.pos
        while True:
            match = _PLAIN.match(text, pos, limit)
            if match is not None:
                self._flush_surrogate()
                run = match.group()
                self._string_text(json.loads(f'"{run}"') if "\\" in run else run)
                pos = match.end()
            self.pos = pos
            if pos >= limit:
                return False
            c = text[pos]
            if c == '"':
                self.pos = pos + 1
                self._string_done()
                return True
            if c != "\\":
                raise _Broken  # a raw control character
            if pos + 1 >= limit or (text[pos + 1] == "u" and pos + 6 > limit):
                return False  # the escape is not whole yet
            escape = text[pos + 1]
            if escape == "u":
                if not _HEX4.fullmatch(text, pos + 2, pos + 6):
                    raise _Broken
                self._escaped(chr(int(text[pos + 2 : pos + 6], 16)))
                pos += 6
            elif escape in _ESCAPES:
                self._flush_surrogate()
                self._string_text(_ESCAPES[escape])
                pos += 2
            else:
                raise _Broken

    def _escaped(self, ch: str) -> None:
        """A `\\uXXXX` character: a surrogate pair is one character, as json.loads reads it."""
        high = self._surrogate
        if high and "\udc00" <= ch <= "\udfff":
            self._surrogate = ""
            ch = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
        else:
            self._flush_surrogate()
            if "\ud800" <= ch <= "\udbff":
                self._surrogate = ch
                return
        self._string_text(ch)

    def _flush_surrogate(self) -> None:
        if self._surrogate:
            high, self._surrogate = self._surrogate, ""
            self._string_text(high)

    def _string_text(self, piece: str) -> None:
        if self._str_role == "args":
            self._str_call.write(dumps(piece)[1:-1])
        elif self._str_role != "skip":
            self._str_parts.append(piece)

    def _string_done(self) -> None:
        self._flush_surrogate()
        role, call, value = self._str_role, self._str_call, "".join(self._str_parts)
        if role == "key":
            self._stack[-1].key = value
            self._state = _COLON
            return
        if role == "args":
            call.write('"')
        elif role == "name" and valid_name(value.strip()):
            call.name = value.strip()
        elif role == "args_text":  # arguments given as a JSON string: its value, normalised
            decoded = json_value(value)
            call.write(dumps(value if decoded is FAIL else decoded))
        self._end_value()

    def _bare_done(self, token: str) -> None:
        canonical = canonical_token(token)
        if canonical is None:
            raise _Broken
        if self._bare_role == "args":
            self._bare_call.write(self._held + canonical)
        elif self._bare_role == "args_root":  # `"arguments": null` means none
            self._bare_call.write("{}" if token == "null" else canonical)
        self._end_value()

    # -- calls ---------------------------------------------------------------------------------

    def _settle_name(self, call: _Call) -> None:
        if call.name is not None and call.scan is None and not call.delegated:
            call.scan = CallScan(call.name, call.pending, False)
            self.calls.append(call.scan)

    def _complete(self, call: _Call) -> None:
        if call.scan is not None:
            if not call.scan.fragments:
                call.scan.fragments.append("{}")
            call.scan.complete = True

    def _stop(self, at_end: bool) -> None:
        """End of reading: close what is open. `at_end`: the text ended (a cut-off call keeps
        its name and what was written); otherwise the JSON broke where it stands."""
        # a number or literal at the very end is left out: `1` may have been going to be `10`
        if self._state == _STRING and self._str_role == "args":
            self._flush_surrogate()
            self._str_call.write('"')
        for frame in reversed(self._stack):
            if frame.role == "args":
                frame.call.write(frame.closer)
            elif frame.role == "call":
                if at_end:
                    self._settle_name(frame.call)
                self._complete(frame.call)
        self._stack.clear()
        self.done = True


def json_calls(body: str) -> list[CallScan]:
    """The JSON calls in a whole block body."""
    reader = JsonCallReader(0)
    reader.read(body, len(body), settled=True)
    return reader.calls
