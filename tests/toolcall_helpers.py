"""Shared by the tool-call parser tests (tests/test_toolcalls*.py): the tools offered, sample
pieces in the exact shapes Qwen3 (Hermes JSON) and Qwen3.5/3.6 (XML) emit (as the parsers'
docstrings, serve/toolcalls/hermes.py and qwen3_coder.py, describe them), and the checks
every sample case passes: the whole parse gives the expected message, and every random split
of the text into deltas gives the whole parse."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_cli.serve.toolcalls import (
    ContentDelta,
    ParsedMessage,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolParser,
)

FIXTURES = Path(__file__).parent / "fixtures"
# Qwen-style templates (tests/fixtures/*.jinja, written from the notes)
QWEN35_TEMPLATE = (FIXTURES / "qwen35_style_template.jinja").read_text()
QWEN3_TEMPLATE = (FIXTURES / "qwen3_style_template.jinja").read_text()


def function_tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required or list(properties)[:1],
            },
        },
    }


TOOLS = [
    function_tool(
        "get_weather",
        {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    ),
    function_tool(
        "search",
        {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "threshold": {"type": "number"},
            "exact": {"type": "boolean"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "cursor": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    ),
    function_tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    function_tool("bash", {"command": {"type": "string"}}),
]

CODE = (
    "import sys\n"
    "\n"
    "\n"
    "def clamp(x: int, lo: int = 0, hi: int = 10) -> int:\n"
    '    """Keep x in [lo, hi] & say so."""\n'
    "    if x < lo or x > hi:\n"
    '        print(f"<clamped {x}>", file=sys.stderr)\n'
    "    return max(lo, min(x, hi))\n"
)


# Code whose text holds the XML format's own closing tags, each followed by text that does
# not fit the format, so none of them may end the value.
TAGGY_CODE = (
    'END = "</parameter>"\n'
    'FUNC_END = "</function>"  # and "</tool_call>"\n'
    "html = '<p>a</p></parameter> x'\n"
    "</function> is not the end here\n"
    "</tool_call> nor here\n"
)


@dataclass(frozen=True)
class Case:
    id: str
    parser: type[ToolParser]
    text: str
    content: str
    reasoning: str | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    opened: bool = False  # the prompt ended in `<think>\n`


def xml_call(name: str, params: list[tuple[str, str]]) -> str:
    """A call exactly as Qwen3.5/3.6 writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: dict) -> str:
    """A call exactly as Qwen3 writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


PARIS = {"location": "Paris, France", "unit": "celsius"}
SEARCH_PARAMS = [
    ("query", "rust async runtime"),
    ("limit", "10"),
    ("threshold", "0.75"),
    ("exact", "false"),
    ("filters", '{"lang": "en", "year": {"gte": 2020}}'),
    ("tags", '["tokio", "async-std"]'),
    ("cursor", "null"),
]
SEARCH_ARGS = {
    "query": "rust async runtime",
    "limit": 10,
    "threshold": 0.75,
    "exact": False,
    "filters": {"lang": "en", "year": {"gte": 2020}},
    "tags": ["tokio", "async-std"],
    "cursor": None,
}


def expected(case: Case) -> tuple[str, str | None, list[tuple[str, dict]]]:
    return case.content, case.reasoning, case.calls


def observed(message: ParsedMessage) -> tuple[str, str | None, list[tuple[str, dict]]]:
    calls = [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
    return message.content, message.reasoning, calls


def assert_sample(case: Case) -> None:
    message = case.parser(TOOLS, seed=0).parse(case.text, prompt_opened_think=case.opened)
    assert observed(message) == expected(case)
    for call in message.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


def random_split(text: str, rng: random.Random) -> list[str]:
    mode = rng.random()
    if mode < 0.25:
        return list(text)  # one character at a time
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1))))
    if mode < 0.6:  # a few cuts: token-sized pieces
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 40))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stream(parser: ToolParser, pieces: list[str], opened: bool):
    sp = parser.stream(prompt_opened_think=opened)
    events = []
    for piece in pieces:
        events += sp.feed(piece)
    events += sp.finish()
    return sp.message, events


def accumulate(events) -> ParsedMessage:
    """What an OpenAI streaming client assembles from the deltas."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index not in calls and e.name and e.arguments == ""
                calls[e.index] = [e.id, e.name, ""]
            else:
                assert e.name is None
                calls[e.index][2] += e.arguments
    return ParsedMessage(content, reasoning or None, [ToolCall(*calls[i]) for i in sorted(calls)])


def assert_stream_matches_whole(case: Case) -> None:
    whole = case.parser(TOOLS, seed=7).parse(case.text, prompt_opened_think=case.opened)
    rng = random.Random(case.id)
    for _ in range(12):
        pieces = random_split(case.text, rng) if case.text else [""]
        message, events = stream(case.parser(TOOLS, seed=7), pieces, case.opened)
        assert message == whole
        got = accumulate(events)
        assert got.content == whole.content
        assert got.reasoning == whole.reasoning
        assert got.tool_calls == whole.tool_calls
        ends = [e for e in events if isinstance(e, ToolCallEnd)]
        assert [e.call for e in ends] == whole.tool_calls
        assert [e.index for e in ends] == list(range(len(whole.tool_calls)))
