"""Unit tests of the server's pieces that need no model: the Hermes tool-call and reasoning
parser (whole and streamed in every split), JSON mode's cutter, request validation, and the
llama-server command line."""

from __future__ import annotations

import json

import pytest

from atlas_cli.serve import tools_adapter
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.llama_server import parse as parse_llama_args
from atlas_cli.serve.prompt import JsonCutter, template_renders
from atlas_cli.serve.protocol import ChatCompletionRequest, parse_body

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def stream_all(text: str, pieces: list[int], tools=TOOLS, opened=False):
    """Feed `text` cut at the given lengths; gather content, reasoning and calls."""
    parser = tools_adapter.select_parser(None).stream(tools, opened)
    deltas, pos = [], 0
    for n in pieces:
        deltas += parser.feed(text[pos : pos + n])
        pos += n
    deltas += parser.feed(text[pos:]) + parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls = [d.call for d in deltas if d.kind == "tool_call"]
    return content, reasoning, calls


def test_parse_whole_message():
    parsed = tools_adapter.select_parser(None).parse("I will look.\n" + CALL, TOOLS)
    assert parsed.content == "I will look."
    (call,) = parsed.tool_calls
    assert call.name == "bash" and json.loads(call.arguments) == {"command": "ls -la"}
    assert call.id.startswith("call_")


def test_parse_two_calls_and_reasoning():
    text = "<think>\nplan it\n</think>\n\n" + CALL + "\n" + CALL.replace("ls -la", "pwd")
    parsed = tools_adapter.select_parser(None).parse(text, TOOLS)
    assert parsed.reasoning == "plan it" and parsed.content == ""
    assert [json.loads(c.arguments)["command"] for c in parsed.tool_calls] == ["ls -la", "pwd"]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_invalid_call_stays_text():
    text = "<tool_call>not json</tool_call> done"
    parsed = tools_adapter.select_parser(None).parse(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text
    assert stream_all(text, [3, 5, 9])[0] == text


def test_no_tools_means_no_parsing():
    parsed = tools_adapter.select_parser(None).parse(CALL, None)
    assert parsed.tool_calls == [] and parsed.content == CALL


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_matches_whole_parse_in_any_split(step):
    text = "<think>why</think>\n\nHere goes: " + CALL + " and after"
    pieces = [step] * (len(text) // step + 1)
    content, reasoning, calls = stream_all(text, pieces)
    whole = tools_adapter.select_parser(None).parse(text, TOOLS)
    assert reasoning == whole.reasoning == "why"
    assert content == "Here goes:  and after"
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]


def test_stream_with_prompt_opened_think():
    content, reasoning, _ = stream_all("\nhmm\n</think>\n\nok", [1, 1, 3, 4], opened=True)
    assert reasoning.strip() == "hmm" and content == "ok"
    assert tools_adapter.split_reasoning("hmm</think>ok", True) == ("hmm", "ok")


def test_json_cutter():
    cutter = JsonCutter("{")
    assert cutter.feed('"a": "}{", "b": [1, 2') is None  # braces inside strings do not count
    assert cutter.feed("]} trailing") == 2 and cutter.done
    assert JsonCutter().feed('x {"k": "\\"}"} y') == len('x {"k": "\\"}"}')


def test_template_feature_detection():
    assert not template_renders("{{ message['content'] }}", "tools")
    assert template_renders("{% if tools %}{{ tools | tojson }}{% endif %}", "tools")
    assert template_renders("{% if message.role == 'tool' %}", "tool_role")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "top_k": -2}, "top_k"),
        ({"messages": [{"role": "user"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
    ],
)
def test_validation_names_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_body_must_be_an_object():
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, [1, 2])
    assert err.value.code == "invalid_json"


def test_llama_server_command_line():
    # what Lemonade's llama.cpp backend passes to the executable it starts
    argv = "-m /m/q.gguf --ctx-size 4096 --port 8123 --jinja --keep 16"
    argv += " --reasoning-format auto -ngl 99 --context-shift"
    args, ignored = parse_llama_args(argv.split())
    assert (args.model, args.port, args.ctx_size, args.host) == (
        "/m/q.gguf",
        8123,
        4096,
        "127.0.0.1",
    )
    assert "--jinja" in ignored and "-ngl" in ignored
