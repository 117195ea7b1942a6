"""`atlas serve` with a Qwen3.5-style model: XML tool calls and reasoning in a prompt that opened
`<think>`, through the official openai and anthropic clients.

The engine is scripted (tests/serve_helpers.py): it replays Qwen3.5-format output in small
pieces, as a real model would stream it, while the prompt side is real: the Qwen3.5 fixture
tokenizer with a Qwen3.5-style chat template (tests/fixtures/qwen35_style_template.jinja), from
which the server picks the qwen3_coder parser itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from atlas_cli.backend import tokenizer as tok
from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from tests.serve_helpers import ServerThread, scripted_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

FIXTURES = Path(__file__).parent / "fixtures"

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "timeout": {"type": "integer"},
        "verbose": {"type": "boolean"},
        "ratio": {"type": "number"},
        "env": {"type": "object"},
        "only": {"type": ["array", "null"]},
    },
    "required": ["path"],
}
RUN_TESTS = {
    "type": "function",
    "function": {"name": "run_tests", "description": "Run a test folder.", "parameters": SCHEMA},
}
ASK = [{"role": "user", "content": "Run the unit tests."}]

REASONING = "The user wants the unit tests.\nI will run them with a timeout."
# the prompt ended in "<think>\n": the model goes on from there
OUTPUT = (
    f"{REASONING}\n</think>\n\n"
    "<tool_call>\n<function=run_tests>\n"
    "<parameter=path>\ntests/unit\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n"
    "<parameter=verbose>\ntrue\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n"
    '<parameter=env>\n{"CI": "1", "LANG": "C"}\n</parameter>\n'
    "<parameter=only>\nNone\n</parameter>\n"
    "</function>\n</tool_call>"
)
# converted by the schema: no value stays a string unless the schema says string
ARGS = {
    "path": "tests/unit",
    "timeout": 30,
    "verbose": True,
    "ratio": 0.5,
    "env": {"CI": "1", "LANG": "C"},
    "only": None,
}


def pieces(text: str, size: int = 7) -> list[str]:
    """Token-sized pieces that cut through tags (`<tool_` / `call>`, `</param` / `eter>`)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def qwen35():
    base = tok.from_hf_directory(FIXTURES / "qwen" / "qwen35-f32", {})
    template = (FIXTURES / "qwen35_style_template.jinja").read_text()
    fake = scripted_model(dataclasses.replace(base, chat_template=template))
    with ServerThread(create_app(ServeConfig(model="scripted"), fake)) as srv:
        yield srv, fake.engine


@pytest.fixture
def oc(qwen35):
    srv, _ = qwen35
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def prompt_text(engine) -> str:
    return engine.tokenizer.decode(engine.prompts[-1])


def test_xml_tool_call_whole(qwen35, oc):
    _, engine = qwen35
    engine.script = pieces(OUTPUT)
    resp = oc.chat.completions.create(model="scripted", messages=ASK, tools=[RUN_TESTS])
    assert prompt_text(engine).endswith("<|im_start|>assistant\n<think>\n")
    assert "<function=example_function_name>" in prompt_text(engine)  # the template's tools
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.reasoning_content == REASONING
    assert not msg.content
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "run_tests"
    assert json.loads(call.function.arguments) == ARGS


def test_xml_tool_call_streamed_as_argument_deltas(qwen35, oc):
    _, engine = qwen35
    engine.script = pieces(OUTPUT, 3)
    chunks = list(
        oc.chat.completions.create(model="scripted", messages=ASK, tools=[RUN_TESTS], stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == REASONING
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "run_tests"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    # the arguments arrive while the call is generated, a parameter at a time
    chunks_of_args = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(chunks_of_args) == len(ARGS)
    assert all(tc.index == 0 for tc in calls)
    assert json.loads("".join(chunks_of_args)) == ARGS
    # the reasoning is all out before the call starts
    order = [
        "r" if getattr(d, "reasoning_content", None) else "t"
        for d in deltas
        if d.tool_calls or getattr(d, "reasoning_content", None)
    ]
    assert order == sorted(order)  # "r"... then "t"...
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stream_helper_of_the_openai_client_assembles_the_call(qwen35, oc):
    """The SDK's own accumulator (what agent harnesses use) gets valid JSON arguments."""
    _, engine = qwen35
    engine.script = pieces(OUTPUT, 5)
    with oc.chat.completions.stream(model="scripted", messages=ASK, tools=[RUN_TESTS]) as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "run_tests" and json.loads(call.function.arguments) == ARGS
    assert final.choices[0].finish_reason == "tool_calls"


def test_two_calls_in_one_turn(qwen35, oc):
    _, engine = qwen35
    second = "<tool_call>\n<function=run_tests>\n<parameter=path>\ntests/gpu\n</parameter>\n"
    second += "</function>\n</tool_call>"
    engine.script = pieces(OUTPUT + "\n" + second, 4)
    chunks = list(
        oc.chat.completions.create(model="scripted", messages=ASK, tools=[RUN_TESTS], stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    ids = [tc.id for tc in calls if tc.id]
    assert len(ids) == 2 and ids[0] != ids[1]
    args = {0: "", 1: ""}
    for tc in calls:
        args[tc.index] += tc.function.arguments or ""
    assert json.loads(args[0]) == ARGS and json.loads(args[1]) == {"path": "tests/gpu"}
    engine.script = pieces(OUTPUT + "\n" + second, 4)
    whole = oc.chat.completions.create(model="scripted", messages=ASK, tools=[RUN_TESTS])
    assert [json.loads(c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        ARGS,
        {"path": "tests/gpu"},
    ]


def test_reasoning_in_a_prompt_that_opened_think(qwen35, oc):
    _, engine = qwen35
    engine.script = pieces("Just a greeting.\n</think>\n\nHello! How can I help?", 4)
    resp = oc.chat.completions.create(model="scripted", messages=ASK)
    msg = resp.choices[0].message
    assert msg.reasoning_content == "Just a greeting." and msg.content == "Hello! How can I help?"
    assert prompt_text(engine).endswith("<think>\n")
    chunks = list(oc.chat.completions.create(model="scripted", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        "Just a greeting."
    )
    assert "".join(d.content or "" for d in deltas) == "Hello! How can I help?"
    # cut off by max_tokens while thinking: all of it is reasoning
    engine.script = ["Still ", "thinking ", "about ", "it"]
    cut = oc.chat.completions.create(model="scripted", messages=ASK, max_tokens=2)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.reasoning_content == "Still thinking"
    assert not cut.choices[0].message.content


def test_thinking_off_is_all_content(qwen35, oc):
    _, engine = qwen35
    engine.script = ["Hello", "!"]
    resp = oc.chat.completions.create(
        model="scripted",
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert prompt_text(engine).endswith("<think>\n\n</think>\n\n")
    msg = resp.choices[0].message
    assert msg.content == "Hello!" and getattr(msg, "reasoning_content", None) is None


def test_tool_result_round_trip_renders_the_xml_call(qwen35, oc):
    """The call goes back in history: the template renders it as the model wrote it."""
    _, engine = qwen35
    engine.script = pieces(OUTPUT)
    first = oc.chat.completions.create(model="scripted", messages=ASK, tools=[RUN_TESTS])
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": msg.content,
            "reasoning_content": msg.reasoning_content,
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "12 passed"},
    ]
    engine.script = ["All ", "12 passed.", "\n</think>\n\nThe tests pass."]
    reply = oc.chat.completions.create(model="scripted", messages=history, tools=[RUN_TESTS])
    assert reply.choices[0].message.content == "The tests pass."
    assert reply.choices[0].finish_reason == "stop"
    prompt = prompt_text(engine)  # the fixture's small vocabulary lacks a few characters
    assert "<parameter=timeout>\n30\n</parameter>\n<parameter=verbose>\n" in prompt
    assert "</parameter>\n</function>\n</tool_call>" in prompt
    assert "<tool_response>\n12 passed\n</tool_response>" in prompt
    # exactly the template's rendering of the call with its arguments as an object
    tokenizer = engine.tokenizer
    history[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0]}]}
    history[1]["tool_calls"][0]["function"] = {"name": "run_tests", "arguments": ARGS}
    want = tokenizer.render_chat(history, tools=[RUN_TESTS], add_generation_prompt=True)
    assert f"<think>\n{REASONING}\n</think>" in want
    assert '<parameter=env>\n{"CI": "1", "LANG": "C"}\n</parameter>' in want
    assert engine.prompts[-1] == tokenizer.encode(want, add_special_tokens=True)


def test_anthropic_tool_use_and_thinking(qwen35):
    srv, engine = qwen35
    ac = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    tool = {"name": "run_tests", "description": "Run a test folder.", "input_schema": SCHEMA}
    engine.script = pieces(OUTPUT)
    msg = ac.messages.create(model="scripted", max_tokens=512, messages=ASK, tools=[tool])
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == REASONING
    assert msg.content[1].name == "run_tests" and msg.content[1].input == ARGS
    engine.script = pieces(OUTPUT, 3)
    with ac.messages.stream(model="scripted", max_tokens=512, messages=ASK, tools=[tool]) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == REASONING
    assert final.content[1].input == ARGS and final.stop_reason == "tool_use"
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(partial) == len(ARGS) and json.loads("".join(partial)) == ARGS
