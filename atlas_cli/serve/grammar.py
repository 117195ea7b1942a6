"""What a request constrains, as a grammar in the model's own output syntax: OpenAI/Anthropic
`tools` + `tool_choice` + `parallel_tool_calls`, and `response_format` -> a Lark grammar in
llguidance's dialect (backend/constraint.py runs it).

- `tool_choice` "required" or a named tool: the answer is one or more calls (exactly one
  with `parallel_tool_calls: false`) to the tools offered, arguments valid by each tool's
  JSON schema, in Hermes JSON (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`) or Qwen3-Coder XML (toolcalls/qwen3_coder.py), as the parsers in toolcalls/ read.
- "auto": free text until the call's opening tag, then the same calls (a lazy grammar, as
  llama.cpp's tool-call grammars are lazy), so a model can still answer in prose.
- `response_format` json_object / json_schema: one JSON value of that schema (with "auto"
  tools: that JSON, or calls).
- Reasoning (`<think>...</think>`, or the rest of a think block the prompt opened) is free
  text ahead of all of this: never constrained.

XML values follow how the qwen3_coder parser converts them (toolcalls/values.py): a
string-typed parameter is raw text (its enum, const, minLength and maxLength are enforced; a
pattern or format is not), every other type is its JSON text under the parameter's schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from atlas_cli.backend.constraint import json_schema_grammar
from atlas_cli.serve.toolcalls import tags
from atlas_cli.serve.toolcalls.values import _STRING_TYPES, _schema_types

Think = Literal["none", "optional", "open"]
# at most a few blank characters between reasoning and the answer: unbounded whitespace is
# where a small model loops
GAP = r"/[ \t\r\n]{0,4}/"
# How a reply in Qwen2.5-Coder's call drift starts: a ```json fence, or JSON itself. Prose may
# not start so: llguidance's lexer commits to no shorter lexeme once a longer one (prose) is
# still possible, so such a start must belong to the drift alone.
DRIFT_START = r"(```json|[\[{])(?s:.*)"
HERMES_CALL = "hermes_call"  # the rule of one Hermes call object (`_Writer.hermes`)
_CALL_HEAD = json.dumps('{"name": ')  # how a Hermes call object starts, as json.dumps writes it


@dataclass(frozen=True)
class GrammarRequest:
    tools: Mapping[str, dict] = field(default_factory=dict)  # name -> parameters schema
    tool_mode: Literal["none", "auto", "required"] = "none"
    parallel: bool = True
    json_schema: dict | None = None  # response_format's ({"type": "object"} for json_object)
    syntax: Literal["hermes", "qwen3_coder"] = "hermes"
    think: Think = "none"  # "optional": the model may open a think block; "open": the prompt did


def build_grammar(req: GrammarRequest, special: Callable[[str], bool]) -> str | None:
    """The grammar for `req`, or None when nothing is constrained. `special(tag)`: whether
    the tokenizer has `tag` as one special token (the grammar must then name the token)."""
    tools = req.tool_mode != "none" and bool(req.tools)
    if not tools and req.json_schema is None:
        return None
    g = _Writer(special)
    if tools:
        calls = g.calls(req)
        if req.tool_mode == "required":
            body = calls
        elif req.json_schema is not None:
            body = f"{g.json(req.json_schema)} | {calls}"
        else:
            body = g.prose_or_calls(req)
    else:
        body = g.json(req.json_schema)
    g.rule("body", body)
    g.rule("start", g.think(req.think) + "body")
    return g.text()


class _Writer:
    """Collects Lark rules; names are generated, literals and tags escaped here."""

    def __init__(self, special: Callable[[str], bool]):
        self.special = special
        self.rules: list[str] = []
        self.count = 0

    def rule(self, name: str, body: str, options: str = "") -> str:
        self.rules.append(f"{name}{f'[{options}]' if options else ''}: {body}")
        return name

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def text(self) -> str:
        return "\n".join(reversed(self.rules)) + "\n"

    def lit(self, text: str) -> str:
        """A literal: the special token itself where the tokenizer has one."""
        return text if self.special(text) else json.dumps(text)

    def until(self, tag: str, stem: str, text: str = "(?s:.*)", avoid: str | None = None) -> str:
        """Free `text` (a regex) up to and including the first `tag` (lazy: ends there); with
        `avoid`, text that does not match that regex."""
        unless = f" & ~/{avoid}/" if avoid else ""
        if self.special(tag):
            if not unless:
                return f"/{text}/ {tag}"
            return f"{self.rule(self.fresh(stem).upper(), f'/{text}/{unless}')} {tag}"
        return self.rule(self.fresh(stem), f"/{text}{_regex_escape(tag)}/{unless}", "lazy")

    def json(self, schema: Mapping, lenient: bool = False, name: str | None = None) -> str:
        return self.rule(
            name or self.fresh("json"),
            "%json " + json_schema_grammar(dict(schema), lenient=lenient),
        )

    # -- reasoning ------------------------------------------------------------------------------

    def think(self, think: Think) -> str:
        if think == "none":
            return ""
        rest = self.until(tags.THINK_CLOSE, "think_rest")
        if think == "open":
            return self.rule("think", f"{rest} {GAP}") + " "
        return self.rule("think", f"{self.lit(tags.THINK_OPEN)} {rest} {GAP}") + "? "

    # -- tool calls -----------------------------------------------------------------------------

    def calls(self, req: GrammarRequest) -> str:
        """`calls`: one call, or several one per line; `call_rest` is one call after its
        opening tag (the lazy prose rule consumes the tag itself)."""
        inner = self.hermes(req.tools) if req.syntax == "hermes" else self.xml(req.tools)
        close = self.lit(tags.TOOL_CALL_CLOSE)
        self.rule("call_rest", f'"\\n" {inner} "\\n" {close}')
        self.rule("call", f"{self.lit(tags.TOOL_CALL_OPEN)} call_rest")
        return self.rule("calls", "call" + self.more(req))

    @staticmethod
    def more(req: GrammarRequest) -> str:
        """What may follow a call: further calls, one per line, unless only one is allowed."""
        return ' ("\\n" call)*' if req.parallel else ""

    def prose_or_calls(self, req: GrammarRequest) -> str:
        """Prose (no opening tag in it), or prose, the opening tag and then calls only. In the
        Hermes syntax also the calls a model writes in its own drift (Qwen2.5-Coder): a call
        object, or a list of them, bare or in a ```json fence, as the whole reply; prose may
        then not start like one (`DRIFT_START`), so such a start is held to the schemas."""
        open_tag = tags.TOOL_CALL_OPEN
        drift = req.syntax == "hermes"
        refused = [] if self.special(open_tag) else [f"(?s:.*){_regex_escape(open_tag)}(?s:.*)"]
        if drift:
            refused.append(DRIFT_START)
        prose = self.rule("PROSE", "/(?s:.*)/" + "".join(f" & ~/{r}/" for r in refused))
        lead = self.until(open_tag, "lead", avoid=DRIFT_START if drift else None)
        options = [prose, f"{lead} call_rest{self.more(req)}"]
        if drift:
            options.append(self.drift_calls(req))
        return " | ".join(options)

    def drift_calls(self, req: GrammarRequest) -> str:
        """A call object (or with parallel calls a list of them), bare or fenced, of `calls`'
        own named tools (`HERMES_CALL`'s alternatives, compiled once). An object whose name is
        none of the tools is the model's prose, free from there on: a model that names a
        function it was not given (BFCL's irrelevance cases) means no call to one it was."""
        fence, close = "/```json[ \\t]*\\n/", "/\\n```/"
        other = self.rule("OTHER_NAME", f"/{other_name_regex(req.tools)}(?s:.*)/")
        options = [
            f"{fence} {_CALL_HEAD} (tool_call_named {close} {GAP} | {other})",
            f"{_CALL_HEAD} (tool_call_named {GAP} | {other})",
        ]
        if req.parallel:
            many = self.rule("drift_many", f'"[" {HERMES_CALL} (", " {HERMES_CALL})* "]"')
            options += [f"{fence} {many} {close} {GAP}", f"{many} {GAP}"]
        return self.rule("drift", " | ".join(options))

    def hermes(self, tools: Mapping[str, dict]) -> str:
        """One Hermes call object, `{"name": NAME, "arguments": {...}}` as json.dumps writes
        it, NAME one of `tools` and the arguments valid by its schema."""
        named = []
        for name, params in tools.items():
            head = json.dumps(f'{json.dumps(name, ensure_ascii=False)}, "arguments": ')
            args = self.json(_object_schema(params), lenient=True)
            named.append(self.rule(self.fresh("named"), f'{head} {args} "}}"'))
        self.rule("tool_call_named", " | ".join(named))
        return self.rule(HERMES_CALL, f"{_CALL_HEAD} tool_call_named")

    def xml(self, tools: Mapping[str, dict]) -> str:
        functions = [self.xml_function(name, params) for name, params in tools.items()]
        return self.rule("function", " | ".join(functions))

    def xml_function(self, name: str, params: dict) -> str:
        schema = _object_schema(params)
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for pname, pschema in props.items() if isinstance(props, Mapping) else ():
            param = self.xml_parameter(pname, pschema)
            parts.append(param if pname in required else f"{param}?")
        head = json.dumps(f"{tags.FUNCTION_OPEN}{name}>\n")
        body = " ".join([head, *parts, self.lit(tags.FUNCTION_CLOSE)])
        return self.rule(self.fresh("fn"), body)

    def xml_parameter(self, name: str, schema: Any) -> str:
        head = json.dumps(f"{tags.PARAMETER_OPEN}{name}>\n")
        close = "\n" + tags.PARAMETER_CLOSE + "\n"
        schema = schema if isinstance(schema, Mapping) else {}
        kind, _ = _schema_types(schema)
        choices = _string_choices(schema)
        if choices is not None:
            value = " | ".join(json.dumps(c + close) for c in choices)
        elif kind in _STRING_TYPES:
            value = self.until(close, "raw", _length_regex(schema))
        else:
            value = f"{self.json(schema, lenient=True)} {json.dumps(close)}"
        return self.rule(self.fresh("param"), f"{head} ({value})")


# Python-style type names some tool lists use (BFCL's among them) -> JSON Schema's
_TYPE_NAMES = {
    "dict": "object",
    "float": "number",
    "int": "integer",
    "str": "string",
    "bool": "boolean",
    "list": "array",
    "tuple": "array",
}


def _object_schema(params: Any) -> dict:
    """A tool's parameters as an object schema (OpenAI allows them missing or untyped).

    Arguments the function does not name are closed off unless the schema allows them
    (JSON Schema's default would let a call carry keys the callee rejects; OpenAI's strict
    mode and llama.cpp's grammars close them too): on the default model, 9 of the first 20 of
    BFCL's live_simple calls had invented keys such as "description"."""
    schema = _standard_types(params) if isinstance(params, Mapping) else {}
    schema.setdefault("type", "object")
    if isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        schema.setdefault("additionalProperties", False)
    return schema


def _standard_types(node: Any) -> Any:
    """`node` with Python-style type names replaced and `"type": "any"` dropped."""
    if isinstance(node, list):
        return [_standard_types(v) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: _standard_types(v) for k, v in node.items() if not (k == "type" and v == "any")}
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = _TYPE_NAMES.get(kind, kind)
    elif isinstance(kind, list):
        out["type"] = [_TYPE_NAMES.get(k, k) if isinstance(k, str) else k for k in kind]
    return out


def _string_choices(schema: Mapping) -> list[str] | None:
    """The fixed strings a string parameter may take (enum / const), or None."""
    if isinstance(schema.get("const"), str):
        return [schema["const"]]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return enum
    return None


def _length_regex(schema: Mapping) -> str:
    """Any text, within the schema's minLength/maxLength (in characters, as JSON Schema)."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    lo = lo if isinstance(lo, int) and lo > 0 else 0
    if isinstance(hi, int) and hi >= lo:
        return f"(?s:.){{{lo},{hi}}}"
    return f"(?s:.){{{lo},}}" if lo else "(?s:.*)"


def _regex_escape(text: str) -> str:
    """`text` inside a Lark /regex/: regex metacharacters and the slash escaped."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append(r"\n")
        elif ch in r"\/.^$*+?()[]{}|-":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def other_name_regex(names: Iterable[str]) -> str:
    """A regex of a JSON string (quotes included) holding any name but `names` (as json.dumps
    writes them): at each node of the names' trie, stop where no name ends, or go on with a
    character no name has next, or with one a name has."""
    trie: dict = {}
    for name in names:
        node = trie
        for ch in json.dumps(name, ensure_ascii=False)[1:-1]:
            node = node.setdefault(ch, {})
        node[None] = {}  # a name ends here

    def rest(node: dict) -> str:
        chars = sorted(ch for ch in node if ch is not None)
        parts = [f"[^\\x{{22}}{''.join(_regex_char(ch) for ch in chars)}][^\\x{{22}}]*"]
        parts += [_regex_char(ch) + rest(node[ch]) for ch in chars]
        body = "(?:" + "|".join(parts) + ")"
        return body if None in node else body + "?"

    return f"\\x{{22}}{rest(trie)}\\x{{22}}"


def _regex_char(ch: str) -> str:
    """One character as a regex atom, in a class or outside one."""
    return ch if ch.isascii() and (ch.isalnum() or ch == "_") else f"\\x{{{ord(ch):x}}}"
