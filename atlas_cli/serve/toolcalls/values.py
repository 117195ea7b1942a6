"""Parameter values and tool schemas: raw text -> the JSON value a tool's schema types it as
(Qwen3.5's XML calls carry values as text), and the small JSON helpers the parsers share."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any


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


_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
FAIL = object()  # what a failed decoding returns (None is a JSON value)


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


def json_value(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return FAIL


def _python_literal(text: str) -> Any:
    # The model may echo Python reprs ({'a': True}); literal_eval evaluates literals only.
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return FAIL


def _as_json(value: Any) -> Any:
    """`value` as JSON would give it back (tuples become lists), or FAIL for sets, bytes,
    NaN and other things JSON cannot hold."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return FAIL


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
    value = json_value(text)
    if isinstance(value, str) and kind in ("object", "array", "dict", "list"):
        inner = _as_json(_python_literal(value))  # a JSON-encoded repr: "{'k': 'v'}"
        value = value if inner is FAIL else inner
    if value is FAIL:
        value = _as_json(_python_literal(text))
    return raw if value is FAIL else value


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


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def arguments_value(arguments: Any) -> Any:
    """Call arguments as a value: JSON text is decoded (kept as text if it does not)."""
    if isinstance(arguments, str):
        decoded = json_value(arguments) if arguments.strip() else {}
        return arguments if decoded is FAIL else decoded
    return {} if arguments is None else arguments
