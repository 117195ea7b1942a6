"""Tool-call and reasoning parsing (atlas_cli.serve.toolcalls) on real-format Qwen outputs.

Samples are written in the exact shapes Qwen3 (Hermes JSON) and Qwen3.5/3.6 (XML) emit, as the
project notes (formats.md section 4) describe them; round trips render real MLPerf agentic
turns through Qwen-style templates and parse them back. Every sample is also streamed in
random splits, which must give the whole parse's result.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from atlas_cli.backend.tokenizer import render_template
from atlas_cli.errors import UsageError
from atlas_cli.serve.toolcalls import (
    ContentDelta,
    HermesParser,
    NoToolParser,
    ParsedMessage,
    Qwen3CoderParser,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolParser,
    convert_parameter,
    prompt_opens_thinking,
    select_parser,
    split_reasoning,
    tools_from_openai,
)

FIXTURES = Path(__file__).parent / "fixtures"


def _fn(name: str, properties: dict, required: list[str] | None = None) -> dict:
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
    _fn(
        "get_weather",
        {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    ),
    _fn(
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
    _fn("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _fn("bash", {"command": {"type": "string"}}),
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

CASES = [
    # --- Qwen3: Hermes JSON, the model writes its own <think> -------------------------------
    Case(
        "qwen3-reasoning-one-call",
        HermesParser,
        "<think>\nThe user wants the weather in Paris. I should call get_weather with "
        "celsius.\n</think>\n\n" + json_call("get_weather", PARIS),
        content="",
        reasoning="The user wants the weather in Paris. I should call get_weather with celsius.",
        calls=[("get_weather", PARIS)],
    ),
    Case(
        "qwen3-several-calls-thinking-off",
        HermesParser,
        json_call("get_weather", {"location": "Paris, France"})
        + "\n"
        + json_call("get_weather", {"location": "Tokyo, Japan"})
        + "\n"
        + json_call("search", {"query": "weather alerts", "limit": 3}),
        content="",
        calls=[
            ("get_weather", {"location": "Paris, France"}),
            ("get_weather", {"location": "Tokyo, Japan"}),
            ("search", {"query": "weather alerts", "limit": 3}),
        ],
    ),
    Case(
        "qwen3-content-before-calls",
        HermesParser,
        "<think>\nTwo cities, two calls.\n</think>\n\nI'll check the weather in both cities.\n"
        + json_call("get_weather", {"location": "Oslo"})
        + "\n"
        + json_call("get_weather", {"location": "Lima"}),
        content="I'll check the weather in both cities.",
        reasoning="Two cities, two calls.",
        calls=[("get_weather", {"location": "Oslo"}), ("get_weather", {"location": "Lima"})],
    ),
    Case(
        "qwen3-reasoning-then-answer",
        HermesParser,
        "<think>\nOkay, the capital of France... that's Paris.\n\nDouble-check: yes.\n</think>"
        "\n\nThe capital of France is **Paris**.",
        content="The capital of France is **Paris**.",
        reasoning="Okay, the capital of France... that's Paris.\n\nDouble-check: yes.",
    ),
    Case(
        "qwen3-truncated-reasoning",
        HermesParser,
        "<think>\nLet me compute 17 * 23. 17 * 20 = 340, and 17 * 3 = 51, so",
        content="",
        reasoning="Let me compute 17 * 23. 17 * 20 = 340, and 17 * 3 = 51, so",
    ),
    Case(
        "qwen3-thinking-off-answer",
        HermesParser,
        "Hello! How can I help you today?",
        content="Hello! How can I help you today?",
    ),
    Case(
        "qwen3-nested-arguments",
        HermesParser,
        json_call("search", {"query": "q", "filters": {"a": [1, {"b": None}]}, "exact": True}),
        content="",
        calls=[("search", {"query": "q", "filters": {"a": [1, {"b": None}]}, "exact": True})],
    ),
    Case(
        "qwen3-arguments-as-json-string",
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"location\\": \\"Oslo\\"}"}\n'
        "</tool_call>",
        content="",
        calls=[("get_weather", {"location": "Oslo"})],
    ),
    # --- Qwen3.5 / 3.6: XML, the prompt opened <think> ----------------------------------------
    Case(
        "qwen35-reasoning-one-call",
        Qwen3CoderParser,
        "The user is asking about the weather in Paris. I'll call get_weather.\n</think>\n\n"
        + xml_call("get_weather", [("location", "Paris, France"), ("unit", "celsius")]),
        content="",
        reasoning="The user is asking about the weather in Paris. I'll call get_weather.",
        calls=[("get_weather", PARIS)],
        opened=True,
    ),
    Case(
        "qwen35-every-json-type",
        Qwen3CoderParser,
        "Search with all filters.\n</think>\n\n" + xml_call("search", SEARCH_PARAMS),
        content="",
        reasoning="Search with all filters.",
        calls=[("search", SEARCH_ARGS)],
        opened=True,
    ),
    Case(
        "qwen35-multiline-code-value",
        Qwen3CoderParser,
        "Write the helper.\n</think>\n\n"
        # the value ends in "\n", so the model writes a blank line before </parameter>
        + xml_call("write_file", [("path", "src/clamp.py"), ("content", CODE)]),
        content="",
        reasoning="Write the helper.",
        calls=[("write_file", {"path": "src/clamp.py", "content": CODE})],
        opened=True,
    ),
    Case(
        "qwen35-calls-after-text",
        Qwen3CoderParser,
        "Plan: write, then test.\n</think>\n\nI'll create the file and then run the tests.\n\n"
        + xml_call("write_file", [("path", "a.txt"), ("content", "hi")])
        + "\n"
        + xml_call("bash", [("command", "python -m pytest -q tests/ 2>&1 | tail -5")]),
        content="I'll create the file and then run the tests.",
        reasoning="Plan: write, then test.",
        calls=[
            ("write_file", {"path": "a.txt", "content": "hi"}),
            ("bash", {"command": "python -m pytest -q tests/ 2>&1 | tail -5"}),
        ],
        opened=True,
    ),
    Case(
        "qwen35-call-without-closing-think",
        Qwen3CoderParser,
        "I need to list the files first.\n\n" + xml_call("bash", [("command", "ls -la")]),
        content="",
        reasoning="I need to list the files first.",
        calls=[("bash", {"command": "ls -la"})],
        opened=True,
    ),
    Case(
        "qwen35-thinking-off",
        Qwen3CoderParser,
        xml_call("bash", [("command", "git status")]),
        content="",
        calls=[("bash", {"command": "git status"})],
    ),
    Case(
        "qwen35-python-style-scalars",
        Qwen3CoderParser,
        # the Qwen3.5 template renders non-strings with |string: True, None
        "ok\n</think>\n\n"
        + xml_call(
            "search", [("query", "x"), ("exact", "True"), ("cursor", "None"), ("limit", " 5 ")]
        ),
        content="",
        reasoning="ok",
        calls=[("search", {"query": "x", "exact": True, "cursor": None, "limit": 5})],
        opened=True,
    ),
    Case(
        "qwen35-answer",
        Qwen3CoderParser,
        "Simple fact.\n</think>\n\nParis is the capital of France.",
        content="Paris is the capital of France.",
        reasoning="Simple fact.",
        opened=True,
    ),
    Case(
        "qwen35-truncated-reasoning",
        Qwen3CoderParser,
        "The user asks for a proof. Let me start with the base case",
        content="",
        reasoning="The user asks for a proof. Let me start with the base case",
        opened=True,
    ),
    Case(
        "qwen35-string-null-stays-string",
        Qwen3CoderParser,
        xml_call("search", [("query", "null"), ("cursor", "null")]),
        content="",
        calls=[("search", {"query": "null", "cursor": None})],
    ),
    Case(
        "qwen35-reasoning-mentions-tool-call-tag",
        Qwen3CoderParser,
        "The format is <tool_call> then a function tag.\n</think>\n\n"
        + xml_call("bash", [("command", "pwd")]),
        content="",
        reasoning="The format is <tool_call> then a function tag.",
        calls=[("bash", {"command": "pwd"})],
        opened=True,
    ),
    Case(
        "qwen35-value-contains-the-format-tags",  # an agent editing a tool-call parser
        Qwen3CoderParser,
        "Edit the parser.\n</think>\n\n"
        + xml_call("write_file", [("path", "parser.py"), ("content", TAGGY_CODE)]),
        content="",
        reasoning="Edit the parser.",
        calls=[("write_file", {"path": "parser.py", "content": TAGGY_CODE})],
        opened=True,
    ),
    # --- malformed -------------------------------------------------------------------------
    Case(
        "hermes-unterminated-complete-json",
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Rome"}}\n',
        content="",
        calls=[("get_weather", {"location": "Rome"})],
    ),
    Case(
        "hermes-unterminated-cut-json",
        HermesParser,
        'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
        content='Checking.\n<tool_call>\n{"name": "get_weather", "argu',
    ),
    Case(
        "hermes-bad-json",
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris",}}\n</tool_call>',
        content='<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris",}}\n'
        "</tool_call>",
    ),
    Case(
        "hermes-good-then-bad",
        HermesParser,
        json_call("get_weather", {"location": "Oslo"})
        + "\n<tool_call>\n{name: get_weather}\n</tool_call>",
        content="<tool_call>\n{name: get_weather}\n</tool_call>",
        calls=[("get_weather", {"location": "Oslo"})],
    ),
    Case(
        "hermes-extra-closing-brace",
        HermesParser,
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}}\n</tool_call>',
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "hermes-nested-duplicated-tags",
        HermesParser,
        "<tool_call>\n<tool_call>\n"
        + '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n</tool_call>',
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "hermes-closing-tag-inside-a-string",  # an agent writing a tool-call parser
        HermesParser,
        json_call("write_file", {"path": "p.py", "content": TAGGY_CODE}),
        content="",
        calls=[("write_file", {"path": "p.py", "content": TAGGY_CODE})],
    ),
    Case(
        "hermes-unbalanced-quote",  # the newline ends the broken string: the block still ends
        HermesParser,
        '<tool_call>\n{"name": "bash, "arguments": {}}\n</tool_call>\nok',
        content='<tool_call>\n{"name": "bash, "arguments": {}}\n</tool_call>\nok',
    ),
    Case(
        "hermes-empty-call",
        HermesParser,
        "<tool_call>\n</tool_call>",
        content="<tool_call>\n</tool_call>",
    ),
    Case(
        "hermes-given-xml",
        HermesParser,
        xml_call("bash", [("command", "ls")]),
        content=xml_call("bash", [("command", "ls")]),
    ),
    Case(
        "hermes-no-name",
        HermesParser,
        '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',
        content='<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',
    ),
    Case(
        "xml-unknown-parameter-and-tool",
        Qwen3CoderParser,
        xml_call("get_weather", [("city", "Paris"), ("days", "3")])
        + "\n"
        + xml_call("mystery", [("n", "3"), ("flag", "true")]),
        content="",
        calls=[
            ("get_weather", {"city": "Paris", "days": "3"}),
            ("mystery", {"n": "3", "flag": "true"}),
        ],
    ),
    Case(
        "xml-missing-function-close",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "xml-missing-parameter-close",
        Qwen3CoderParser,
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n"
        "<parameter=unit>\ncelsius\n</function>\n</tool_call>",
        content="",
        calls=[("get_weather", {"location": "Paris", "unit": "celsius"})],
    ),
    Case(
        "xml-unterminated-call",  # generation hit max tokens inside a call
        Qwen3CoderParser,
        "Running it.\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la /tmp",
        content="Running it.",
        calls=[("bash", {"command": "ls -la /tmp"})],
    ),
    Case(
        "xml-missing-tool-call-close-then-text",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\nDone.",
        content="Done.",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "xml-missing-parameter-and-function-close",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</tool_call>\n"
        + xml_call("bash", [("command", "pwd")]),
        content="",
        calls=[("bash", {"command": "ls"}), ("bash", {"command": "pwd"})],
    ),
    Case(
        "xml-two-functions-in-one-block",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n"
        "<function=bash>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>",
        content="",
        calls=[("bash", {"command": "ls"}), ("bash", {"command": "pwd"})],
    ),
    Case(
        "xml-unterminated-function-header",
        Qwen3CoderParser,
        "<tool_call>\n<function=ba",
        content="<tool_call>\n<function=ba",
    ),
    Case(
        "xml-empty-name",
        Qwen3CoderParser,
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        content="<tool_call>\n<function=>\n</function>\n</tool_call>",
    ),
    Case(
        "xml-no-parameters",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n</function>\n</tool_call>",
        content="",
        calls=[("bash", {})],
    ),
    Case(
        "xml-nested-tool-call",
        Qwen3CoderParser,
        "<tool_call>\n<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
        "</function>\n</tool_call>\n</tool_call>",
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "xml-duplicate-parameter-first-wins",
        Qwen3CoderParser,
        xml_call("bash", [("command", "ls"), ("command", "rm -rf /")]),
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "xml-parameter-header-cut",
        Qwen3CoderParser,
        "<tool_call>\n<function=bash>\n<parameter=command\nls\n</function>\n</tool_call>",
        content="",
        calls=[("bash", {})],
    ),
    Case(
        "xml-bad-typed-values",
        Qwen3CoderParser,
        xml_call(
            "search",
            [
                ("limit", "ten"),
                ("threshold", "NaN"),
                ("exact", "yes"),
                ("filters", "{'lang': 'en', 'strict': True}"),
                ("tags", '["a", "b"'),
            ],
        ),
        content="",
        calls=[
            (
                "search",
                {
                    "limit": "ten",
                    "threshold": "NaN",
                    "exact": "yes",
                    "filters": {"lang": "en", "strict": True},
                    "tags": '["a", "b"',
                },
            )
        ],
    ),
    Case(
        "xml-deeply-nested-array",
        Qwen3CoderParser,
        xml_call("search", [("tags", "[" * 1500 + "]" * 1500)]),
        content="",
        calls=[("search", {"tags": "[" * 1500 + "]" * 1500})],
    ),
    Case(
        "xml-given-json",  # Qwen3.5 answering in Qwen3's JSON format
        Qwen3CoderParser,
        json_call("bash", {"command": "ls"}),
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "xml-bare-function",  # no <tool_call> around it (vLLM takes these too)
        Qwen3CoderParser,
        "Let me check.\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>",
        content="Let me check.",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "stray-think-close-thinking-off",
        Qwen3CoderParser,
        "Sure.</think>\n\nThe answer is 4.",
        content="Sure.</think>\n\nThe answer is 4.",
    ),
    Case(
        "second-think-close-is-content",
        HermesParser,
        "<think>\na\n</think>\n\nb</think>c",
        content="b</think>c",
        reasoning="a",
    ),
    Case(
        "partial-tag-at-end",
        Qwen3CoderParser,
        "Answer: 4 <tool_ca",
        content="Answer: 4 <tool_ca",
    ),
    Case(
        "no-tool-parser-keeps-tags",
        NoToolParser,
        "x\n</think>\n\n" + xml_call("bash", [("command", "ls")]),
        content=xml_call("bash", [("command", "ls")]),
        reasoning="x",
        opened=True,
    ),
    Case("empty-output", Qwen3CoderParser, "", content=""),
    Case("empty-output-thinking", Qwen3CoderParser, "", content="", opened=True),
]


def expected(case: Case) -> tuple[str, str | None, list[tuple[str, dict]]]:
    return case.content, case.reasoning, case.calls


def observed(message: ParsedMessage) -> tuple[str, str | None, list[tuple[str, dict]]]:
    calls = [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
    return message.content, message.reasoning, calls


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_samples(case: Case):
    message = case.parser(TOOLS, seed=0).parse(case.text, prompt_opened_think=case.opened)
    assert observed(message) == expected(case)
    for call in message.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


# ---------------------------------------------------------------------------------------------
# Streaming


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


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_streaming_equals_whole_parse(case: Case):
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


SOUP = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>",
    "<parameter=", "</parameter>", "<", ">", "=", "\n", " ", "\n\n", "bash", "command", "search",
    "limit", "tags", "{", "}", "[", "]", '"name": ', '"arguments": ', '"bash"', ", ", "1", "true",
    "None", "'", '{"name": "bash", "arguments": {"command": "ls"}}', "<tool", "_call>", "</thi",
    "nk>", "<func", "tion=", "</para", "meter>", "<think", "</tool_", "call>", "text", "é🙂",
    '"', "\\", '\\"', '"x": "</tool_call>"', '"a\\n</tool_call>"',
]  # fmt: skip


def test_streaming_equals_whole_parse_on_tag_soup():
    """Random mixes of tags, tag pieces and text: never a crash, and any split of the text
    gives the whole parse."""
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 30)))
        for cls in (HermesParser, Qwen3CoderParser, NoToolParser):
            opened = rng.random() < 0.5
            whole = cls(TOOLS, seed=1).parse(text, prompt_opened_think=opened)
            message, events = stream(cls(TOOLS, seed=1), random_split(text, rng), opened)
            assert message == whole, text
            assert accumulate(events) == ParsedMessage(
                whole.content, whole.reasoning, whole.tool_calls
            ), text
            for call in whole.tool_calls:
                json.loads(call.arguments)  # always valid JSON


def test_no_partial_tag_leaks_into_content_or_reasoning():
    text = (
        "Checking the tag </thi</think>\n\nLet me look.\n\n"
        + xml_call("bash", [("command", "ls")])
        + "\n"
        + xml_call("bash", [("command", "pwd")])
    )
    message, events = stream(Qwen3CoderParser(TOOLS), list(text), opened=True)
    assert message.reasoning == "Checking the tag </thi"
    assert message.content == "Let me look."
    for e in events:
        if isinstance(e, ContentDelta):
            assert "<" not in e.text
    streamed = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert streamed == "Checking the tag </thi"


def test_xml_arguments_stream_per_parameter_in_openai_shape():
    text = "\n</think>\n\n" + xml_call("search", SEARCH_PARAMS)
    _, events = stream(Qwen3CoderParser(TOOLS, seed=3), list(text), opened=True)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    first = deltas[0].to_openai()
    assert first["type"] == "function" and first["function"] == {"name": "search", "arguments": ""}
    assert first["id"].startswith("call_") and first["index"] == 0
    # one delta per parameter; the last one is settled by `</function>`, with the closing brace
    assert len(deltas) == 1 + len(SEARCH_PARAMS)
    assert deltas[-1].arguments == ', "cursor": null}'
    assert deltas[1].to_openai() == {
        "index": 0,
        "function": {"arguments": '{"query": "rust async runtime"'},
    }
    assert json.loads("".join(d.arguments for d in deltas)) == SEARCH_ARGS
    assert isinstance(events[-1], ToolCallEnd)
    assert json.loads(events[-1].call.arguments) == SEARCH_ARGS


def test_hermes_call_arrives_whole_when_its_block_closes():
    text = json_call("get_weather", PARIS)
    sp = HermesParser(TOOLS, seed=3).stream()
    before = sp.feed(text[:-1])
    assert not [e for e in before if isinstance(e, ToolCallDelta | ContentDelta)]
    after = sp.feed(text[-1:])
    assert [type(e) for e in after] == [ToolCallDelta, ToolCallDelta, ToolCallEnd]
    assert json.loads(after[1].arguments) == PARIS


def test_feed_after_finish_is_an_error():
    sp = HermesParser().stream()
    sp.finish()
    assert sp.finish() == []
    with pytest.raises(RuntimeError):
        sp.feed("x")


# ---------------------------------------------------------------------------------------------
# Ids, schemas, values, selection


def test_tool_call_ids_are_seedable():
    text = json_call("bash", {"command": "a"}) + json_call("bash", {"command": "b"})
    a = HermesParser(seed=5).parse(text).tool_calls
    b = HermesParser(seed=5).parse(text).tool_calls
    c = HermesParser().parse(text).tool_calls
    assert [x.id for x in a] == [x.id for x in b]
    assert a[0].id != a[1].id and c[0].id != a[0].id
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", x.id) for x in a + c)


def test_tools_from_openai():
    schemas = tools_from_openai(
        [*TOOLS, {"name": "bare", "parameters": {"type": "object"}}, {"type": "function"}, 3]
    )
    assert list(schemas) == ["get_weather", "search", "write_file", "bash", "bare"]
    assert schemas["search"]["properties"]["limit"] == {"type": "integer"}
    assert tools_from_openai(None) == {}


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("\n  indented\n", {"type": "string"}, "\n  indented\n"),
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "integer"}, -7),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),
        ("9" * 5000, {"type": "integer"}, "9" * 5000),
        ("2.5e3", {"type": "number"}, 2500.0),
        ("12", {"type": "number"}, 12),
        ("inf", {"type": "number"}, "inf"),
        ("FALSE", {"type": "boolean"}, False),
        ("True", {"type": "boolean"}, True),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
        ("\"{'k': 'v'}\"", {"type": "object"}, {"k": "v"}),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON value
        ("[1, 2]", {"type": ["array", "null"]}, [1, 2]),
        ("null", {"type": ["array", "null"]}, None),
        ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
        ("None", {"type": "string"}, "None"),
        ("null", {"type": "null"}, None),
        ("__import__('os')", {"type": "object"}, "__import__('os')"),
        ("7", {}, "7"),  # no type: a string
        ("7", {"type": "weird"}, 7),  # unknown type: JSON if it is JSON
        ("7", None, "7"),  # unknown parameter
    ],
)
def test_convert_parameter(raw, schema, value):
    assert convert_parameter(raw, schema) == value
    assert type(convert_parameter(raw, schema)) is type(value)


QWEN3_SNIPPET = (
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
)
QWEN35_SNIPPET = (
    "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
    "\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
)
LLAMA3_SNIPPET = (
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
    "message['content'] | trim + '<|eot_id|>' }}"
)


def test_select_parser_from_template_text():
    assert select_parser(QWEN3_SNIPPET, None) is HermesParser
    assert select_parser(QWEN35_SNIPPET, None) is Qwen3CoderParser
    assert select_parser(LLAMA3_SNIPPET, None) is NoToolParser
    assert select_parser(None, None) is NoToolParser
    smollm2 = json.loads((FIXTURES / "smollm2_template.json").read_text())
    source = smollm2 if isinstance(smollm2, str) else json.dumps(smollm2)
    assert select_parser(source) is NoToolParser
    assert select_parser((FIXTURES / "qwen3_style_template.jinja").read_text()) is HermesParser
    assert select_parser((FIXTURES / "qwen35_style_template.jinja").read_text()) is Qwen3CoderParser


def test_select_parser_override_wins():
    assert select_parser(QWEN35_SNIPPET, "hermes") is HermesParser
    assert select_parser(QWEN3_SNIPPET, "qwen3_coder") is Qwen3CoderParser
    assert select_parser(QWEN3_SNIPPET, "none") is NoToolParser
    assert select_parser(QWEN3_SNIPPET, "auto") is HermesParser
    with pytest.raises(UsageError, match="qwen3_coder"):
        select_parser(QWEN3_SNIPPET, "qwen4")


def test_split_reasoning():
    assert split_reasoning("a\n</think>\n\nb", True) == ("a", "b")
    assert split_reasoning("<think>\na\n</think>\n\nb", False) == ("a", "b")
    assert split_reasoning("just text", False) == (None, "just text")
    assert split_reasoning("cut off", True) == ("cut off", "")
    assert split_reasoning("r\n<tool_call>\n<function=f>\n", True) == (
        "r",
        "<tool_call>\n<function=f>",
    )
    assert split_reasoning("r <tool_call> {json}", True) == ("r <tool_call> {json}", "")


# ---------------------------------------------------------------------------------------------
# Round trips through Qwen-style templates (tests/fixtures/*.jinja, written from the notes)

QWEN35_TEMPLATE = (FIXTURES / "qwen35_style_template.jinja").read_text()
QWEN3_TEMPLATE = (FIXTURES / "qwen3_style_template.jinja").read_text()


def last_assistant_text(rendered: str) -> str:
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start : rendered.index("<|im_end|>", start)]


def render_turn(template: str, message: dict, tools=TOOLS) -> str:
    messages = [{"role": "user", "content": "Go."}, message]
    return last_assistant_text(
        render_template(template, messages=messages, tools=tools, add_generation_prompt=False)
    )


ALL_TYPES_TURN = ParsedMessage(
    content="Searching and saving.",
    reasoning="Need a search, then a file.\n\nTwo calls.",
    tool_calls=[
        ToolCall("call_1", "search", json.dumps(SEARCH_ARGS)),
        ToolCall("call_2", "write_file", json.dumps({"path": "src/clamp.py", "content": CODE})),
        ToolCall("call_3", "search", json.dumps({"query": "q", "exact": True, "cursor": None})),
    ],
)


@pytest.mark.parametrize(
    ("template", "parser"), [(QWEN35_TEMPLATE, Qwen3CoderParser), (QWEN3_TEMPLATE, HermesParser)]
)
def test_template_round_trip(template, parser):
    text = render_turn(template, ALL_TYPES_TURN.to_openai(decode_arguments=True))
    assert text.startswith("<think>\n")  # history turns carry their think block
    if parser is Qwen3CoderParser:
        assert "<parameter=cursor>\nNone\n</parameter>" in text  # |string rendering
    for opened, generated in ((False, text), (True, text.removeprefix("<think>\n"))):
        message = parser(TOOLS).parse(generated, prompt_opened_think=opened)
        assert observed(message) == observed(ALL_TYPES_TURN)


def test_generation_prompt_opens_thinking():
    messages = [{"role": "user", "content": "hi"}]

    def prompt(template: str, **kw) -> str:
        return render_template(
            template, messages=messages, tools=TOOLS, add_generation_prompt=True, **kw
        )

    assert prompt_opens_thinking(prompt(QWEN35_TEMPLATE))
    assert prompt_opens_thinking(prompt(QWEN35_TEMPLATE, enable_thinking=True))
    assert not prompt_opens_thinking(prompt(QWEN35_TEMPLATE, enable_thinking=False))
    assert not prompt_opens_thinking(prompt(QWEN3_TEMPLATE))
    assert not prompt_opens_thinking(prompt(QWEN3_TEMPLATE, enable_thinking=False))


AGENTIC = [json.loads(line) for line in (FIXTURES / "agentic_tool_turns.jsonl").open()]
AGENTIC_TOOLS = [_fn("bash", {"command": {"type": "string", "description": "The bash command"}})]


@pytest.mark.parametrize(
    ("template", "parser"), [(QWEN35_TEMPLATE, Qwen3CoderParser), (QWEN3_TEMPLATE, HermesParser)]
)
def test_agentic_turns_round_trip(template, parser):
    """Real MLPerf agentic turns (multi-line shell commands with quotes, pipes, `<`, heredocs),
    as the model would generate them, parse back to the recorded calls, streamed or not."""
    rng = random.Random(parser.name)
    assert len(AGENTIC) == 40
    for turn in AGENTIC:
        message = {
            "role": "assistant",
            "content": "",
            "reasoning_content": turn["reasoning_content"],
            "tool_calls": [
                {
                    **tc,
                    "function": {
                        **tc["function"],
                        "arguments": json.loads(tc["function"]["arguments"]),
                    },
                }
                for tc in turn["tool_calls"]
            ],
        }
        generated = render_turn(template, message, AGENTIC_TOOLS).removeprefix("<think>\n")
        whole = parser(AGENTIC_TOOLS, seed=0).parse(generated, prompt_opened_think=True)
        assert whole.reasoning == turn["reasoning_content"].strip()
        assert whole.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in turn["tool_calls"]
        ]
        streamed, _ = stream(parser(AGENTIC_TOOLS, seed=0), random_split(generated, rng), True)
        assert streamed == whole


@pytest.mark.parametrize(
    ("template", "parser"), [(QWEN35_TEMPLATE, Qwen3CoderParser), (QWEN3_TEMPLATE, HermesParser)]
)
def test_render_call_writes_what_the_template_writes_and_parses_back(template, parser):
    """`render_call` (the server's history text when a template cannot render `tool_calls`)
    is the template's own rendering of a call, and the parser reads it back."""
    args = {**SEARCH_ARGS, "cursor": None}
    text = parser.render_call("search", json.dumps(args))
    assert parser.render_call("search", args) == text  # dict or JSON text alike
    message = {"role": "assistant", "content": "", "tool_calls": [_call_dict("search", args)]}
    assert render_turn(template, message).endswith(text)
    (call,) = parser(TOOLS).parse(text).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("search", args)


def _call_dict(name: str, args: dict) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
