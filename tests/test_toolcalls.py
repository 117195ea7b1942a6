"""Tool-call and reasoning parsing (atlas_cli.serve.toolcalls) beyond the per-parser samples
(test_toolcalls_hermes.py, test_toolcalls_qwen3_coder.py, test_toolcalls_reasoning.py): the
stream machine on tag soup, ids, schemas and parser selection, and round trips that render
real MLPerf agentic turns through Qwen-style templates and parse them back.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from atlas_cli.backend.tokenizer import render_template
from atlas_cli.errors import UsageError
from atlas_cli.serve.toolcalls import (
    HermesParser,
    NoToolParser,
    ParsedMessage,
    Qwen3CoderParser,
    ToolCall,
    select_parser,
    tools_from_openai,
)
from tests.toolcall_helpers import (
    CODE,
    FIXTURES,
    QWEN3_TEMPLATE,
    QWEN35_TEMPLATE,
    SEARCH_ARGS,
    TOOLS,
    accumulate,
    function_tool,
    json_call,
    observed,
    random_split,
    stream,
)

# ---------------------------------------------------------------------------------------------
# Streaming


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


# ---------------------------------------------------------------------------------------------
# Round trips through Qwen-style templates (tests/fixtures/*.jinja, written from the notes)


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


AGENTIC = [json.loads(line) for line in (FIXTURES / "agentic_tool_turns.jsonl").open()]
AGENTIC_TOOLS = [
    function_tool("bash", {"command": {"type": "string", "description": "The bash command"}})
]


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
