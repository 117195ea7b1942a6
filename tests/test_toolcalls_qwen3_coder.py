"""The Qwen3.5 / Qwen3.6 XML parser (qwen3_coder) on real-format outputs, whole and streamed,
and the schema conversion of its parameter values."""

from __future__ import annotations

import json

import pytest

from atlas_cli.serve.toolcalls import (
    Qwen3CoderParser,
    ToolCallDelta,
    ToolCallEnd,
    convert_parameter,
)
from tests.toolcall_helpers import (
    CODE,
    PARIS,
    SEARCH_ARGS,
    SEARCH_PARAMS,
    TAGGY_CODE,
    TOOLS,
    Case,
    assert_sample,
    assert_stream_matches_whole,
    json_call,
    stream,
    xml_call,
)

XML_CASES = [
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
]


@pytest.mark.parametrize("case", XML_CASES, ids=[c.id for c in XML_CASES])
def test_samples(case: Case):
    assert_sample(case)


@pytest.mark.parametrize("case", XML_CASES, ids=[c.id for c in XML_CASES])
def test_streaming_equals_whole_parse(case: Case):
    assert_stream_matches_whole(case)


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
