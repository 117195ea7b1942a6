"""A client's JSON schemas (tool parameters, `response_format`), checked before they become a
grammar: what llguidance would get wrong or spend seconds on is the client's 400, naming the
field, before anything is generated.

- Integer bounds past 64 bits: llguidance clamps them, so `minimum: 1e300` made the model
  write 9223372036854775807, a number the schema refuses.
- Regexes (`pattern`, `patternProperties`) whose lexer is costly: each is tried on its own
  (`constraint.check_regex`), within `CHECK_S` for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from atlas_cli.backend.constraint import GrammarTokenizer, check_regex
from atlas_cli.errors import GrammarCostError
from atlas_cli.serve.errors import APIError

INT64 = (-(2**63), 2**63 - 1)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
CHECK_S = 2.0  # the regex trials of one request (a costly one takes ~50 ms, a usual one ~2 ms)


def check_schemas(gtok: GrammarTokenizer, schemas: Iterable[tuple[str, Any]]) -> None:
    """`schemas`: (param, schema) pairs; a 400 for the first problem found."""
    started = time.perf_counter()
    for param, schema in schemas:
        patterns: set[str] = set()
        for node in _nodes(schema):
            _check_integer_bounds(node, param)
            if isinstance(node.get("pattern"), str):
                patterns.add(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                patterns.update(node["patternProperties"])
        for pattern in sorted(patterns):
            if time.perf_counter() - started > CHECK_S:
                raise _too_complex(param, f"its patterns take over {CHECK_S:g} s to check")
            try:
                check_regex(gtok, pattern)
            except GrammarCostError as exc:
                raise _too_complex(param, str(exc)) from None


def _nodes(schema: Any) -> Iterator[dict]:
    """Every object in `schema`, at any depth (subschemas, and whatever else holds one)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_integer_bounds(node: dict, param: str) -> None:
    kind = node.get("type")
    if not (kind == "integer" or (isinstance(kind, list) and "integer" in kind)):
        return
    for key in BOUNDS:
        value = node.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and not INT64[0] <= value <= INT64[1]:
            raise APIError(
                400,
                f"{param}: an integer's {key} of {value:g} is past what constrained "
                "decoding can hold (-2^63 .. 2^63-1)",
                code="invalid_grammar",
                param=param,
            )


def _too_complex(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", code="grammar_too_complex", param=param)
