"""Tool calls stream over HTTP as they are written, through the official openai and anthropic
clients: Hermes JSON (a Qwen3-style template) and Qwen3.5 XML, whole and cut off by the token
limit. The engine is scripted (tests/serve_helpers.py); the prompt side is the Qwen fixture
tokenizer with each style's chat template, from which the server picks the parser itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from atlas_cli.backend import tokenizer as tok
from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from tests.serve_helpers import ServerThread, scripted_model
from tests.toolcall_helpers import QWEN3_TEMPLATE, QWEN35_TEMPLATE, json_call, xml_call

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

FIXTURES = Path(__file__).parent / "fixtures"
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path"],
}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "Write the file."}]
ARGS = {"path": "src/a.py", "content": "def f(x):\n    return {'x': x}  # </tool_call>\n"}
CALLS = {
    "hermes": "I'll write it.\n" + json_call("write_file", ARGS),
    "xml": "I'll write it.\n" + xml_call("write_file", list(ARGS.items())),
}


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module", params=["hermes", "xml"])
def served(request):
    base = tok.from_hf_directory(FIXTURES / "qwen" / "qwen35-f32", {})
    template = QWEN3_TEMPLATE if request.param == "hermes" else QWEN35_TEMPLATE
    fake = scripted_model(dataclasses.replace(base, chat_template=template))
    with ServerThread(create_app(ServeConfig(model="scripted"), fake)) as srv:
        yield request.param, srv, fake.engine


def openai_client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def thinking_off() -> dict:
    return {"chat_template_kwargs": {"enable_thinking": False}}


def stream_calls(oc, **kw):
    chunks = list(
        oc.chat.completions.create(
            model="scripted",
            messages=ASK,
            tools=[WRITE],
            stream=True,
            extra_body=thinking_off(),
            **kw,
        )
    )
    deltas = [(i, c.choices[0].delta) for i, c in enumerate(chunks) if c.choices]
    return chunks, [(i, tc) for i, d in deltas for tc in d.tool_calls or []], deltas


def test_openai_stream_sends_the_name_first_then_the_arguments_in_pieces(served):
    syntax, srv, engine = served
    oc = openai_client(srv)
    engine.script = pieces(CALLS[syntax])
    chunks, calls, deltas = stream_calls(oc)
    (name_chunk, head), *rest = calls
    assert head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "write_file" and head.function.arguments == ""
    assert all(tc.id is None and tc.function.name is None and tc.index == 0 for _, tc in rest)
    fragments = [tc.function.arguments for _, tc in rest]
    # Hermes: every few characters of the value; XML: a parameter at a time
    assert len(fragments) >= (10 if syntax == "hermes" else len(ARGS))
    assert all(i > name_chunk for i, _ in rest)
    assert "".join(d.content or "" for _, d in deltas) == "I'll write it."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    engine.script = pieces(CALLS[syntax])
    whole = oc.chat.completions.create(
        model="scripted", messages=ASK, tools=[WRITE], extra_body=thinking_off()
    )
    (call,) = whole.choices[0].message.tool_calls
    assert "".join(fragments) == call.function.arguments  # the very same text
    assert json.loads(call.function.arguments) == ARGS


def test_openai_sdk_accumulator_assembles_the_streamed_call(served):
    syntax, srv, engine = served
    engine.script = pieces(CALLS[syntax], 2)
    with openai_client(srv).chat.completions.stream(
        model="scripted", messages=ASK, tools=[WRITE], extra_body=thinking_off()
    ) as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "write_file" and json.loads(call.function.arguments) == ARGS


def cut_script(syntax: str) -> tuple[list[str], int]:
    """The call as pieces, and a token limit that ends it inside the `content` value."""
    script = pieces(CALLS[syntax])
    at = CALLS[syntax].index("return") + len("return")
    return script, -(-at // 3)  # the pieces that hold `return`


def test_openai_cut_off_call_ends_with_length_and_what_was_written(served):
    syntax, srv, engine = served
    oc = openai_client(srv)
    script, limit = cut_script(syntax)
    engine.script = script
    chunks, calls, deltas = stream_calls(oc, max_tokens=limit)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(d.content or "" for _, d in deltas) == "I'll write it."  # never the call
    assert calls[0][1].function.name == "write_file"
    streamed = "".join(tc.function.arguments or "" for _, tc in calls)
    args = json.loads(streamed)
    assert args["path"] == ARGS["path"] and ARGS["content"].startswith(args["content"])
    assert "return" in args["content"]
    engine.script = script
    whole = oc.chat.completions.create(
        model="scripted", messages=ASK, tools=[WRITE], max_tokens=limit, extra_body=thinking_off()
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == "I'll write it."
    assert choice.message.tool_calls[0].function.arguments == streamed


def anthropic_stream(srv, **kw):
    ac = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    tool = {"name": "write_file", "description": "Write a file.", "input_schema": SCHEMA}
    with ac.messages.stream(model="scripted", messages=ASK, tools=[tool], **kw) as s:
        events = list(s)
        final = s.get_final_message()
    return events, final


def test_anthropic_tool_use_block_opens_with_the_name_then_input_json_deltas(served):
    syntax, srv, engine = served
    engine.script = pieces(CALLS[syntax])
    events, final = anthropic_stream(srv, max_tokens=512)
    kinds = [(e.type, getattr(getattr(e, "content_block", None), "type", None)) for e in events]
    start = kinds.index(("content_block_start", "tool_use"))
    assert events[start].content_block.name == "write_file"
    partial = [
        (i, e.delta.partial_json)
        for i, e in enumerate(events)
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert all(i > start for i, _ in partial)
    assert len(partial) >= (10 if syntax == "hermes" else len(ARGS))
    assert json.loads("".join(p for _, p in partial)) == ARGS
    assert final.stop_reason == "tool_use" and final.content[-1].input == ARGS


def test_anthropic_cut_off_call_stops_at_max_tokens_with_the_partial_input(served):
    syntax, srv, engine = served
    script, limit = cut_script(syntax)
    engine.script = script
    events, final = anthropic_stream(srv, max_tokens=limit)
    assert final.stop_reason == "max_tokens"
    # (the Qwen3.5 template opens `<think>`: there the words before the call are thinking)
    lead, block = final.content
    assert (lead.text if lead.type == "text" else lead.thinking) == "I'll write it."
    assert block.type == "tool_use"
    assert block.name == "write_file" and block.input["path"] == ARGS["path"]
    assert ARGS["content"].startswith(block.input["content"])
