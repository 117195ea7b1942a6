"""The Hermes JSON parser (Qwen3 / Qwen2.5) on real-format outputs, whole and streamed."""

from __future__ import annotations

import json

import pytest

from atlas_cli.serve.toolcalls import (
    ContentDelta,
    HermesParser,
    ToolCallDelta,
    ToolCallEnd,
)
from tests.toolcall_helpers import (
    PARIS,
    TAGGY_CODE,
    TOOLS,
    Case,
    assert_sample,
    assert_stream_matches_whole,
    json_call,
    xml_call,
)


def fenced(body: str, language: str = "json") -> str:
    return f"```{language}\n{body}\n```"


HERMES_CASES = [
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
        # cut off by the token limit after the name: a call with what was written, not text
        content="Checking.",
        calls=[("get_weather", {})],
    ),
    Case(
        "hermes-bad-json",
        HermesParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris",}}\n</tool_call>',
        # the name and a member were streamed before the JSON broke: the call keeps them
        content="",
        calls=[("get_weather", {"location": "Paris"})],
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
    # --- Qwen2.5-Coder with tool_choice auto: the call as a fenced JSON block ---------------
    Case(
        "coder-fenced-call",  # as Qwen2.5-Coder-0.5B/1.5B-Instruct write it
        HermesParser,
        fenced(json.dumps({"name": "get_weather", "arguments": PARIS}, indent=2)),
        content="",
        calls=[("get_weather", PARIS)],
    ),
    Case(
        "coder-fenced-call-then-text",
        HermesParser,
        "\n" + fenced('{"name": "bash", "arguments": {"command": "echo ```"}}') + "\nDone.",
        content="Done.",
        calls=[("bash", {"command": "echo ```"})],
    ),
    Case(
        "coder-fenced-list",
        HermesParser,
        fenced(json.dumps([{"name": "bash", "arguments": {"command": "ls"}}, {"name": "search"}])),
        content="",
        calls=[("bash", {"command": "ls"}), ("search", {})],
    ),
    Case(
        "coder-fenced-undeclared-tool",  # JSON the user asked for, not a call
        HermesParser,
        fenced('{"name": "Ada", "arguments": {"age": 36}}'),
        content=fenced('{"name": "Ada", "arguments": {"age": 36}}'),
    ),
    Case(
        "coder-fenced-after-prose",  # only the content's first thing can be a fenced call
        HermesParser,
        "Call it like this:\n" + fenced('{"name": "bash", "arguments": {"command": "ls"}}'),
        content="Call it like this:\n" + fenced('{"name": "bash", "arguments": {"command": "ls"}}'),
    ),
    Case(
        "coder-bare-call-then-text",  # the other way Qwen2.5-Coder writes a call
        HermesParser,
        '{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}'
        "\nI asked for the weather.",
        content="I asked for the weather.",
        calls=[("get_weather", PARIS)],
    ),
    Case(
        "coder-bare-object-not-a-call",
        HermesParser,
        '{"name": "Ada"} is a JSON object.',
        content='{"name": "Ada"} is a JSON object.',
    ),
    Case(
        "coder-bare-broken",
        HermesParser,
        '{"name": "bash", "arguments": {"command": "ls"',
        content="",
        calls=[("bash", {"command": "ls"})],
    ),
    Case(
        "coder-python-fence",
        HermesParser,
        fenced('print({"name": "bash"})', "python"),
        content=fenced('print({"name": "bash"})', "python"),
    ),
]


@pytest.mark.parametrize("case", HERMES_CASES, ids=[c.id for c in HERMES_CASES])
def test_samples(case: Case):
    assert_sample(case)


@pytest.mark.parametrize("case", HERMES_CASES, ids=[c.id for c in HERMES_CASES])
def test_streaming_equals_whole_parse(case: Case):
    assert_stream_matches_whole(case)


def test_hermes_call_streams_as_it_is_written():
    """The name goes out once `"name": "..."` is followed by `,`; each argument member with the
    first character of its value; a string's characters as they arrive."""
    text = json_call("get_weather", PARIS)
    sp = HermesParser(TOOLS, seed=3).stream()
    upto = text.index('"get_weather"') + len('"get_weather"')
    assert not [e for e in sp.feed(text[:upto]) if isinstance(e, ToolCallDelta | ContentDelta)]
    (head,) = sp.feed(text[upto : upto + 1])  # the comma settles the name
    assert head.to_openai()["function"] == {"name": "get_weather", "arguments": ""}
    value = text.index('"Paris')
    (brace,) = sp.feed(text[upto + 1 : value])  # `"location": ` waits for its value
    assert brace == ToolCallDelta(0, None, None, "{")
    (first,) = sp.feed(text[value : value + 4])
    assert first == ToolCallDelta(0, None, None, '"location": "Par')
    rest = sp.feed(text[value + 4 : -len("</tool_call>")])
    assert [type(e) for e in rest] == [ToolCallDelta, ToolCallEnd]
    assert json.loads("{" + first.arguments + rest[0].arguments) == PARIS
    assert sp.feed("</tool_call>") == []
