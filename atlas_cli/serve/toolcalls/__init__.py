"""Tool calls and reasoning in Qwen-family outputs, parsed whole or while streaming: the
registry of parsers and the names callers use.

Two tool-call formats, one file each, whose docstring states the format: `hermes.py` (Qwen3 /
Qwen2.5 JSON) and `qwen3_coder.py` (Qwen3.5 / Qwen3.6 XML). The reasoning split
(`reasoning.py`) follows vLLM's Qwen3ReasoningParser. There is one implementation of parsing,
`stream.StreamParser`; `ToolParser.parse` feeds it the whole text at once (`base.py`).

Malformed output never raises: a tool-call block that yields no call is kept as content text,
broken blocks give best-effort calls, stray closing tags are dropped.
"""

from __future__ import annotations

from atlas_cli.errors import UsageError
from atlas_cli.serve.toolcalls.base import NoToolParser, ToolParser, split_reasoning
from atlas_cli.serve.toolcalls.events import (
    ContentDelta,
    Event,
    ParsedMessage,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallIds,
)
from atlas_cli.serve.toolcalls.hermes import HermesParser
from atlas_cli.serve.toolcalls.qwen3_coder import Qwen3CoderParser
from atlas_cli.serve.toolcalls.reasoning import prompt_opens_thinking
from atlas_cli.serve.toolcalls.stream import StreamParser
from atlas_cli.serve.toolcalls.tags import FUNCTION_OPEN, PARAMETER_OPEN, TOOL_CALL_OPEN
from atlas_cli.serve.toolcalls.values import convert_parameter, tools_from_openai

__all__ = [
    "PARSERS",
    "ContentDelta",
    "Event",
    "HermesParser",
    "NoToolParser",
    "ParsedMessage",
    "Qwen3CoderParser",
    "ReasoningDelta",
    "StreamParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallIds",
    "ToolParser",
    "convert_parameter",
    "prompt_opens_thinking",
    "select_parser",
    "split_reasoning",
    "tools_from_openai",
]


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
