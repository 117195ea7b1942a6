"""Unit tests of the server's pieces that need no model: how it chooses and uses the tool-call
and reasoning parser (serve.toolcalls; whole and streamed in every split), history calls in
the parser's format, special tokens reaching the parser, JSON mode's cutter, and request
validation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from atlas_cli.backend.engine import IncrementalDecoder
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.errors import UsageError
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.prompt import (
    ChatOptions,
    JsonCutter,
    Prompt,
    build_chat_prompt,
    chat_messages,
    choose_parser,
    template_renders,
)
from atlas_cli.serve.protocol import ChatCompletionRequest, Message, parse_body
from atlas_cli.serve.server import recipe_tool_parser
from atlas_cli.serve.toolcalls import (
    ContentDelta,
    HermesParser,
    NoToolParser,
    Qwen3CoderParser,
    ReasoningDelta,
    ToolCallEnd,
    split_reasoning,
)
from atlas_cli.serve.turn import Turn

FIXTURES = Path(__file__).parent / "fixtures"
QWEN35_TEMPLATE = (FIXTURES / "qwen35_style_template.jinja").read_text()
QWEN3_TEMPLATE = (FIXTURES / "qwen3_style_template.jinja").read_text()
SMOLLM2_TEMPLATE = json.loads((FIXTURES / "smollm2_template.json").read_text())

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def server_parser(template: str | None = None, override: str | None = None, tools=TOOLS):
    """The parser the server uses for a request with `tools` to a model with `template`."""
    runner = SimpleNamespace(engine=SimpleNamespace(context_length=64))
    prompt = Prompt([1], "", tools=tools)
    parser = choose_parser(template, override)
    return Turn(runner, prompt, max_tokens=1, sampling=SamplingParams(), stop=[], parser=parser)


def stream_all(text: str, pieces: list[int], tools=TOOLS, opened=False):
    """Feed `text` cut at the given lengths; gather content, reasoning and calls."""
    stream = server_parser(tools=tools).parser.stream(prompt_opened_think=opened)
    events, pos = [], 0
    for n in pieces:
        events += stream.feed(text[pos : pos + n])
        pos += n
    events += stream.feed(text[pos:]) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [e.call for e in events if isinstance(e, ToolCallEnd)]
    return content, reasoning, calls


def test_parse_whole_message():
    parsed = server_parser().parser.parse("I will look.\n" + CALL)
    assert parsed.content == "I will look."
    (call,) = parsed.tool_calls
    assert call.name == "bash" and json.loads(call.arguments) == {"command": "ls -la"}
    assert call.id.startswith("call_")


def test_parse_two_calls_and_reasoning():
    text = "<think>\nplan it\n</think>\n\n" + CALL + "\n" + CALL.replace("ls -la", "pwd")
    parsed = server_parser().parser.parse(text)
    assert parsed.reasoning == "plan it" and parsed.content == ""
    assert [json.loads(c.arguments)["command"] for c in parsed.tool_calls] == ["ls -la", "pwd"]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_invalid_call_stays_text():
    text = "<tool_call>not json</tool_call> done"
    parsed = server_parser().parser.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    assert stream_all(text, [3, 5, 9])[0] == text


def test_no_tools_means_no_parsing():
    parser = server_parser(tools=None).parser
    assert isinstance(parser, NoToolParser)
    parsed = parser.parse(CALL)
    assert parsed.tool_calls == [] and parsed.content == CALL


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_matches_whole_parse_in_any_split(step):
    text = "<think>why</think>\n\nHere goes: " + CALL + " and after"
    pieces = [step] * (len(text) // step + 1)
    content, reasoning, calls = stream_all(text, pieces)
    whole = server_parser().parser.parse(text)
    assert reasoning == whole.reasoning == "why"
    assert content == whole.content == "Here goes:  and after"
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]


def test_stream_with_prompt_opened_think():
    content, reasoning, _ = stream_all("\nhmm\n</think>\n\nok", [1, 1, 3, 4], opened=True)
    assert reasoning == "hmm" and content == "ok"
    assert split_reasoning("hmm</think>ok", True) == ("hmm", "ok")


@pytest.mark.parametrize(
    ("template", "override", "parser"),
    [
        (QWEN35_TEMPLATE, None, Qwen3CoderParser),  # `<function=`/`<parameter=` in the template
        (QWEN3_TEMPLATE, None, HermesParser),  # `<tool_call>` only
        (SMOLLM2_TEMPLATE, None, HermesParser),  # no tools: the server writes the Hermes prompt
        ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}", None, NoToolParser),
        (QWEN3_TEMPLATE, "qwen3_coder", Qwen3CoderParser),
        (QWEN35_TEMPLATE, "none", NoToolParser),
        (SMOLLM2_TEMPLATE, "auto", HermesParser),
    ],
)
def test_parser_choice(template, override, parser):
    assert choose_parser(template, override) is parser


def test_unknown_parser_is_a_usage_error():
    with pytest.raises(UsageError, match="qwen3_coder"):
        choose_parser(QWEN3_TEMPLATE, "mistral")


def test_recipe_tool_parser_defaults():
    assert recipe_tool_parser("qwen3.6-27b", "cpu") == "qwen3_coder"
    assert recipe_tool_parser("qwen3-0.6b", "cpu") == "hermes"
    assert recipe_tool_parser("llama3.2-1b", "cpu") is None  # llama3_json: not parsed (yet)
    assert recipe_tool_parser(str(FIXTURES / "qwen" / "qwen35-f32"), "cpu") is None
    assert recipe_tool_parser("no-such-model", "cpu") is None


HISTORY = [
    Message(role="user", content="Run it."),
    Message(
        role="assistant",
        content=None,
        tool_calls=[
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls", "timeout": 5}'},
            }
        ],
    ),
    Message(role="tool", tool_call_id="call_1", content="a.txt"),
]


@pytest.mark.parametrize("parser", [HermesParser, Qwen3CoderParser])
def test_history_calls_in_the_parsers_format(parser):
    """A template that cannot render `tool_calls` gets them as text the model's own parser
    reads back."""
    rendered = chat_messages(HISTORY, SMOLLM2_TEMPLATE, parser)
    text = rendered[1]["content"]
    assert text == parser.render_call("bash", {"command": "ls", "timeout": 5})
    properties = {"command": {"type": "string"}, "timeout": {"type": "integer"}}
    schema = {"type": "object", "properties": properties}
    tools = [{"type": "function", "function": {"name": "bash", "parameters": schema}}]
    (call,) = parser(tools).parse(text).tool_calls
    assert json.loads(call.arguments) == {"command": "ls", "timeout": 5}
    assert rendered[2] == {"role": "user", "content": "<tool_response>\na.txt\n</tool_response>"}
    if parser is Qwen3CoderParser:
        assert "<function=bash>\n<parameter=command>\nls\n</parameter>" in text


def _qwen_tokenizer(name: str, template: str | None = None):
    from atlas_cli.backend import tokenizer as tok
    from atlas_cli.backend.loaders import gguf

    path = FIXTURES / "qwen" / name
    if (path / "model.gguf").is_file():
        tokenizer = tok.from_gguf_metadata(gguf.open_gguf(path / "model.gguf").metadata)
    else:
        tokenizer = tok.from_hf_directory(path, {})
    return dataclasses.replace(tokenizer, chat_template=template or tokenizer.chat_template)


@pytest.mark.parametrize("name", ["qwen3-mha-f32", "qwen35-f32", "qwen3-gguf", "qwen35-gguf"])
def test_special_tags_reach_the_parser(name):
    """`<think>` and `<tool_call>` are special (added) tokens in Qwen vocabularies: the
    engine's decoder must keep their text, or the parser never sees a call."""
    tokenizer = _qwen_tokenizer(name)
    text = "<think>\nplan\n</think>\n\n" + Qwen3CoderParser.render_call("bash", {"command": "ls"})
    ids = tokenizer.encode(text)
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tokenizer.backend.token_to_id(tag) in ids  # one token each, not spelt out
    decoder = IncrementalDecoder(tokenizer)
    decoded = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert decoded == text
    parsed = Qwen3CoderParser(TOOLS).parse(decoded)
    assert parsed.reasoning == "plan" and parsed.tool_calls[0].name == "bash"


def test_qwen35_prompt_opens_thinking_and_lists_tools():
    tokenizer = _qwen_tokenizer("qwen35-f32", QWEN35_TEMPLATE)
    opts = ChatOptions(parser=choose_parser(QWEN35_TEMPLATE), tools=None)
    prompt = build_chat_prompt(tokenizer, HISTORY[:1], opts)
    assert prompt.opened_think and prompt.text.endswith("<|im_start|>assistant\n<think>\n")
    opts.template_kwargs = {"enable_thinking": False}
    assert not build_chat_prompt(tokenizer, HISTORY[:1], opts).opened_think


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


def test_serve_takes_the_parser_from_the_flag_or_the_recipe(monkeypatch, tmp_path):
    """`atlas serve --tool-parser` wins; a recipe's tool_call_parser is the default."""
    from typer.testing import CliRunner

    from atlas_cli.cli import app
    from atlas_cli.serve import server
    from atlas_cli.store import locate

    configs = []

    class Stop(Exception):
        pass

    def capture(config):
        configs.append(config)
        raise Stop

    monkeypatch.setattr(locate, "resolve", lambda name, *a, **k: tmp_path)
    monkeypatch.setattr(server, "create_app", capture)
    for name, flag, want in [
        ("qwen3.6-27b", None, "qwen3_coder"),
        ("qwen3-0.6b", None, "hermes"),
        ("qwen3.6-27b", "none", "none"),
        (str(tmp_path), None, None),
    ]:
        with pytest.raises(Stop):
            server.serve(name, port=0, tool_parser=flag)
        assert configs[-1].tool_parser == want
    bad = CliRunner().invoke(app, ["serve", "qwen3-0.6b", "--tool-parser", "mistral"])
    assert bad.exit_code == 2 and "unknown tool-call parser 'mistral'" in bad.output


def test_sampling_takes_recipe_defaults_then_request():
    from atlas_cli.backend.sample import SamplingOverrides

    recipe = SamplingOverrides(temperature=0.6, top_k=20)
    params = SamplingOverrides().over(recipe).params()
    assert params.temperature == 0.6 and params.top_k == 20 and params.top_p == 0.95
    params = SamplingOverrides(temperature=0.0, top_k=5, seed=42).over(recipe).params()
    assert params.temperature == 0.0 and params.top_k == 5 and params.seed == 42
