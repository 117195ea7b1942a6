"""`tool_choice: auto` for a model with no tool syntax of its own (backend/choice.py): the call
or reply is decided before the answer by the model's calibrated likelihood of the call's
opening tag. On the real default model: a question the tool answers gets a call, one it does
not gets prose, through the chat prompt and through `atlas serve`; models whose template
renders tools keep the lazy grammar alone."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from atlas_cli.backend.choice import Choice, _calibrated_margin, _log1m_exp, choose_call
from atlas_cli.serve.prompt import ChatOptions, build_chat_prompt
from atlas_cli.serve.protocol import ChatCompletionRequest

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER,
    },
}
CALL_QUESTIONS = ["What is the weather in Paris?", "Is it raining in Tokyo right now?"]
REPLY_QUESTIONS = ["Who wrote Hamlet?", "Write a haiku about the sea."]


def request(question: str, choice="auto", **extra) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": question}], "tools": [TOOL], **extra}
    return ChatCompletionRequest.model_validate({**body, "tool_choice": choice})


def prompt_for(tokenizer, question: str, choice="auto", **extra):
    req = request(question, choice, **extra)
    opts = ChatOptions(
        tools=req.tools, tool_choice=req.tool_choice, response_format=req.response_format
    )
    return build_chat_prompt(tokenizer, req.messages, opts)


# -- the rule ------------------------------------------------------------------------------------


def test_the_margin_is_the_calibrated_log_odds():
    # P(call) 0.2 against a content-free 0.1: (log 2) - log(0.8 / 0.9)
    margin = _calibrated_margin(math.log(0.2), math.log(0.1))
    assert margin == pytest.approx(math.log(2) - math.log(0.8 / 0.9))
    assert _calibrated_margin(math.log(0.1), math.log(0.1)) == pytest.approx(0)
    assert _calibrated_margin(math.log(0.05), math.log(0.1)) < 0
    assert Choice(True, math.log(0.3), math.log(0.1)).margin > 0


def test_log1m_exp_is_accurate_at_both_ends():
    for p in (1e-12, 1e-3, 0.4, 0.6, 0.999):
        assert _log1m_exp(math.log(p)) == pytest.approx(math.log1p(-p), rel=1e-9)
    assert _log1m_exp(0.0) == -math.inf


# -- when it applies -------------------------------------------------------------------------------


def test_only_auto_on_a_template_without_tools_decides_first(smollm2):
    tok = smollm2.tokenizer
    decided = prompt_for(tok, "Who wrote Hamlet?")
    assert decided.decision is not None and decided.grammar is not None
    assert tok.decode(decided.decision.opening) == "<tool_call>"
    null_text = tok.decode(decided.decision.null_ids)
    assert "Who wrote Hamlet?" not in null_text and "N/A" in null_text
    assert "get_weather" in null_text  # same system prompt and tools around it
    assert prompt_for(tok, "Who wrote Hamlet?", "required").decision is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert prompt_for(tok, "Who wrote Hamlet?", named).decision is None
    json_fmt = {"response_format": {"type": "json_object"}}
    assert prompt_for(tok, "Who wrote Hamlet?", **json_fmt).decision is None
    # a template that renders tools itself: the model has a call syntax of its own
    own = tok.chat_template.replace("{%", "{# tools #}{%", 1)
    assert prompt_for(dataclasses.replace(tok, chat_template=own), "Hi").decision is None


# -- the real default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu", ctx_size=1024)


@pytest.mark.slow
def test_the_model_calls_when_the_tool_answers_and_replies_when_not(fast):
    for question, call in [(q, True) for q in CALL_QUESTIONS] + [
        (q, False) for q in REPLY_QUESTIONS
    ]:
        p = prompt_for(fast.tokenizer, question)
        slots = len(fast.engine.pool.slots)
        choice = choose_call(fast.engine, p.ids, p.decision.null_ids, p.decision.opening)
        assert choice.call is call, (question, choice)
        # the content-free prompt leaves no slot behind: at most this conversation's own
        assert len(fast.engine.pool.slots) <= slots + 1
        assert fast.engine.cached_ids[: len(p.ids)] == p.ids


@pytest.fixture(scope="module")
def server(fast, smollm2_path):
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from tests.serve_helpers import ServerThread

    with ServerThread(
        create_app(ServeConfig(model=str(smollm2_path), served_model_name="m"), fast)
    ) as srv:
        yield srv


def ask(server, question: str, stream: bool = False):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    body = dict(
        model="m",
        messages=[{"role": "user", "content": question}],
        tools=[TOOL],
        tool_choice="auto",
        temperature=0,
        max_tokens=48,
    )
    return client.chat.completions.create(**body, stream=stream)


@pytest.mark.slow
def test_served_auto_answers_in_prose_when_the_tool_does_not_fit(server):
    whole = ask(server, "Who painted the Mona Lisa?")  # a prompt not cached before
    message = whole.choices[0].message
    assert not message.tool_calls and message.content.strip()
    assert "<tool_call>" not in message.content
    # the decision's forwards cached the prompt; usage reports what was cached before them
    assert whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens - 1


@pytest.mark.slow
def test_served_auto_calls_when_the_tool_fits_streamed_and_whole_agree(server):
    whole = ask(server, CALL_QUESTIONS[0]).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    name, args, finish = "", "", None
    for chunk in ask(server, CALL_QUESTIONS[0], stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            name += delta.function.name or ""
            args += delta.function.arguments or ""
    assert (name, args, finish) == (call.name, call.arguments, "tool_calls")
