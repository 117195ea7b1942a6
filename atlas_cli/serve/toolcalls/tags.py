"""The tags of the Qwen-family output formats (stated in hermes.py and qwen3_coder.py)."""

from __future__ import annotations

from collections.abc import Iterable

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
JSON_FENCE_OPEN = "```json"
FENCE_CLOSE = "```"


def partial_tag(text: str, start: int, tags: Iterable[str]) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a tag."""
    best = 0
    room = len(text) - start
    for tag in tags:
        for k in range(min(len(tag) - 1, room), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best
