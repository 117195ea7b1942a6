"""Request bodies from bytes to checked Python values, run on a worker thread (a 10 MB body
takes a while to parse, and the event loop must keep answering `/health` meanwhile).

JSON here is strict JSON: no NaN or Infinity, no number that overflows a float, no lone UTF-16
surrogate in a string (the tokenizer cannot encode one), no nesting deeper than MAX_DEPTH.
Each problem is a 400 naming the place in the body (`param`), never a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from atlas_cli.serve.errors import APIError

MAX_DEPTH = 64  # a JSON schema in a tool definition nests a dozen levels; 64 is plenty


class _BadNumber(ValueError):
    pass


def _constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {text[:40]} is out of range")
    return value


def parse_json(raw: bytes | bytearray) -> Any:
    """`raw` as JSON, checked as above."""
    try:
        value = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except RecursionError:
        raise _too_deep("body") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        message = " ".join(str(exc).split())[:200]
        raise APIError(
            400, f"the request body is not valid JSON ({message})", code="invalid_json"
        ) from None
    check_tree(value)
    return value


def check_tree(value: Any) -> None:
    """Walk the parsed body (iteratively: a deep one must not blow the stack here)."""
    stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict | list):
            if depth >= MAX_DEPTH:
                raise _too_deep(param_of(path))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, (*path, key))
                stack.append((item, depth + 1, (*path, key)))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = param_of(path)
        raise APIError(
            400,
            f"{param}: the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
            "a character; send valid Unicode",
            code="invalid_value",
            param=param,
        ) from None


def _too_deep(param: str) -> APIError:
    return APIError(
        400,
        f"{param}: the JSON nests deeper than {MAX_DEPTH} levels",
        code="invalid_value",
        param=param,
    )


def param_of(path: tuple) -> str:
    """`messages[0].content`, as parse_body names fields."""
    out = ""
    for part in path:
        if isinstance(part, str):  # a key may hold the very surrogate being reported
            part = part.encode("utf-8", "backslashreplace").decode("utf-8")
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"
