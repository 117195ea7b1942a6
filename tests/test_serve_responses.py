"""`POST /v1/responses` (OpenAI's Responses API) through the official openai client: plain and
streamed answers, reasoning items, a function-call round trip (by resending the output and by
`previous_response_id`), JSON output by `text.format`, the token limit, and errors.

Most tests script the engine (tests/serve_helpers.py) with the Qwen fixture tokenizer and a
Qwen3-style template (Hermes calls, `<think>` reasoning), whose small vocabulary has no capital
letters or braces: what a test looks for in a prompt is written without them. The last test
runs the real default model (slow)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from atlas_cli.backend import tokenizer as tok
from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from atlas_cli.serve.protocol import Message
from atlas_cli.serve.responses_protocol import InputItem, input_messages
from atlas_cli.serve.responses_store import ResponseStore
from tests.serve_helpers import (
    WEATHER_TOOL,
    ServerThread,
    dumps,
    raw_request,
    scripted_model,
    sse_events,
)
from tests.toolcall_helpers import QWEN3_TEMPLATE, json_call

openai = pytest.importorskip("openai")

FIXTURES = Path(__file__).parent / "fixtures"
KEY = "sk-responses"
WEATHER = {"type": "function", **WEATHER_TOOL["function"], "strict": True}  # Responses' shape
ASK = "what is the weather in paris?"
CALL = ["Let me ", "check.", *json_call("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def served():
    base = tok.from_hf_directory(FIXTURES / "qwen" / "qwen35-f32", {})
    fake = scripted_model(dataclasses.replace(base, chat_template=QWEN3_TEMPLATE))
    with ServerThread(create_app(ServeConfig(model="scripted", api_key=KEY), fake)) as srv:
        yield srv, fake.engine


@pytest.fixture(scope="module")
def smollm2_served(smollm2_path):
    """The default model's tokenizer (one that holds braces, for JSON output), scripted."""
    from atlas_cli.backend.loaders import gguf

    tokenizer = tok.from_gguf_metadata(gguf.open_gguf(smollm2_path).metadata)
    fake = scripted_model(tokenizer)
    with ServerThread(create_app(ServeConfig(model="scripted"), fake)) as srv:
        yield srv, fake.engine


@pytest.fixture
def oc(served):
    srv, _ = served
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def script(served, *pieces) -> None:
    _, engine = served
    engine.script = list(pieces)


def last_prompt(served) -> list[int]:
    return served[1].prompts[-1]


def prompt_text(served) -> str:
    _, engine = served
    return engine.tokenizer.decode(engine.prompts[-1])


def test_plain_text(served, oc):
    script(served, "It is ", "sunny.")
    resp = oc.responses.create(model="scripted", input=ASK, instructions="be brief.")
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text == "It is sunny."
    (msg,) = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_") and [p.type for p in msg.content] == ["output_text"]
    assert "be brief." in prompt_text(served) and ASK in prompt_text(served)
    usage = resp.usage
    assert usage.input_tokens == len(last_prompt(served)) and usage.output_tokens == 2
    assert usage.total_tokens == usage.input_tokens + 2
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert resp.instructions == "be brief." and resp.tools == [] and resp.tool_choice == "auto"


def test_input_items_become_the_conversation(served, oc):
    """Messages with parts, a developer message and an earlier assistant turn."""
    script(served, "Fine.")
    oc.responses.create(
        model="scripted",
        input=[
            {"role": "developer", "content": "answer in english."},
            {"role": "user", "content": [{"type": "input_text", "text": "hello there."}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hi! ask away.", "annotations": []}],
            },
            {"role": "user", "content": "how are you?"},
        ],
    )
    text = prompt_text(served)
    order = [text.index(s) for s in ("answer in english.", "hello there.", "hi! ask away.")]
    assert order == sorted(order) and text.index("how are you?") > order[-1]


def test_reasoning_item(served, oc):
    script(served, "<think>", "The user ", "asks.", "</think>", "\n\nSunny.")
    resp = oc.responses.create(model="scripted", input=ASK)
    reasoning, msg = resp.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == ["The user asks."]
    assert resp.output_text == "Sunny."
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= resp.usage.output_tokens


def test_reasoning_effort_is_a_thought_budget(served, oc, monkeypatch):
    _, engine = served
    budgets = []
    generate = engine.generate

    def spy(ids, **kw):
        budgets.append(kw["sampling"].reasoning_budget)
        return generate(ids, **kw)

    monkeypatch.setattr(engine, "generate", spy)
    for effort in ("none", "low", "high", "xhigh"):
        script(served, "Sunny.")
        resp = oc.responses.create(model="scripted", input=ASK, reasoning={"effort": effort})
        assert resp.reasoning.effort == effort
    script(served, "Sunny.")
    oc.responses.create(model="scripted", input=ASK, extra_body={"reasoning_budget": 7})
    assert budgets == [0, 1024, None, None, 7]  # as chat completions' reasoning_effort


def stream_events(oc, **kw) -> list:
    return list(oc.responses.create(model="scripted", input=ASK, stream=True, **kw))


def test_streamed_text_events_in_order(served, oc):
    script(served, "It is ", "sunny.")
    events = stream_events(oc)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "It is sunny."
    )
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:8])
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "It is sunny."
    assert final.output[0].id == item_id and final.usage.output_tokens == 2
    # the SDK's stream helper accepts the events and assembles the same response
    script(served, "It is ", "sunny.")
    with oc.responses.stream(model="scripted", input=ASK) as stream:
        assert stream.get_final_response().output_text == "It is sunny."


def test_streamed_reasoning_then_text(served, oc):
    script(served, "<think>", "Hmm.", "</think>", "\n\nSunny.")
    events = stream_events(oc)
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_events_and_response_fit_the_sdk_types(served):
    """Every event and the response validate against the openai SDK's own (pydantic) types,
    for an answer with each kind of item: reasoning, text, a call, and one cut off."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    srv, _ = served
    event_type = TypeAdapter(ResponseStreamEvent)
    auth = {"Authorization": f"Bearer {KEY}"}
    answer = ["<think>", "hm.", "</think>", "\n\n", *CALL]
    for extra in ({}, {"max_output_tokens": 12}):
        body = {"input": ASK, "tools": [WEATHER], **extra}
        script(served, *answer)
        _, _, raw = raw_request(srv.port, "POST", "/v1/responses", dumps(body), auth)
        whole = Response.model_validate(json.loads(raw))
        script(served, *answer)
        body["stream"] = True
        _, _, raw = raw_request(srv.port, "POST", "/v1/responses", dumps(body), auth)
        events = [event_type.validate_python(json.loads(e)) for e in sse_events(raw)]
        final = events[-1].response
        assert [i.type for i in final.output] == [i.type for i in whole.output]
        assert final.status == whole.status == ("incomplete" if extra else "completed")
    assert [i.type for i in whole.output] == ["reasoning", "message"]  # cut before the call


def test_an_empty_answer_is_an_empty_message(served, oc):
    script(served)
    resp = oc.responses.create(model="scripted", input=ASK)
    assert [(i.type, i.content[0].text) for i in resp.output] == [("message", "")]


def test_function_call_round_trip(served, oc):
    script(served, *CALL)
    first = oc.responses.create(model="scripted", input=ASK, tools=[WEATHER])
    msg, call = first.output
    assert msg.type == "message" and first.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    assert first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 c, sunny"}
    # the client resends the whole conversation, the output items included
    script(served, "It is 18 C.")
    items = [item.model_dump(exclude_none=True) for item in first.output]
    resent = oc.responses.create(
        model="scripted", input=[{"role": "user", "content": ASK}, *items, result], tools=[WEATHER]
    )
    assert resent.output_text == "It is 18 C."
    by_hand = last_prompt(served)
    text = prompt_text(served)
    assert '"name": "get_weather"' in text and "18 c, sunny" in text
    assert text.index("get_weather") < text.index("18 c, sunny")
    # or it sends only the result and names the response it answers: the same prompt
    script(served, "It is 18 C.")
    follow = oc.responses.create(
        model="scripted", input=[result], previous_response_id=first.id, tools=[WEATHER]
    )
    assert follow.output_text == "It is 18 C." and follow.previous_response_id == first.id
    assert last_prompt(served) == by_hand


def test_streamed_function_call(served, oc):
    script(served, *CALL)
    events = stream_events(oc, tools=[WEATHER])
    calls = [e for e in events if e.type == "response.output_item.added"][1:]
    (added,) = calls
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and all(d.output_index == added.output_index for d in deltas)
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(d.delta for d in deltas)
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert final.output[1].call_id == added.item.call_id and final.output[1].status == "completed"
    kinds = [e.type for e in events]
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")
    script(served, *CALL)
    with oc.responses.stream(model="scripted", input=ASK, tools=[WEATHER]) as stream:
        (call,) = [i for i in stream.get_final_response().output if i.type == "function_call"]
    assert call.parsed_arguments == {"city": "Paris"}  # strict tools are parsed by the SDK


def test_tool_choice(served, oc):
    script(served, *CALL)
    resp = oc.responses.create(model="scripted", input=ASK, tools=[WEATHER], tool_choice="none")
    assert [i.type for i in resp.output] == ["message"]  # no tools: the call is text
    script(served, *CALL)
    named = {"type": "function", "name": "get_weather"}
    resp = oc.responses.create(model="scripted", input=ASK, tools=[WEATHER], tool_choice=named)
    assert "must call the tool 'get_weather'." in prompt_text(served)
    assert resp.output[-1].type == "function_call" and resp.tool_choice.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as err:
        oc.responses.create(
            model="scripted", input=ASK, tools=[WEATHER], tool_choice={"type": "file_search"}
        )
    assert err.value.body["param"] == "tool_choice"


def test_json_schema_format(smollm2_served):
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    served = smollm2_served
    oc = openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0)
    script(served, '"city": ', '"Paris"}', " I hope", " that helps.")
    resp = oc.responses.parse(model="scripted", input=ASK, text_format=City)
    assert resp.output_parsed == City(city="Paris")  # the answer ends where the JSON does
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "City"
    assert '"city"' in prompt_text(served) and "JSON schema" in prompt_text(served)
    script(served, '"ok": true}')
    raw = oc.responses.with_raw_response.create(
        model="scripted", input=ASK, text={"format": {"type": "json_object"}}
    )
    assert json.loads(raw.parse().output_text) == {"ok": True}
    assert raw.headers["x-atlas-json-valid"] == "true"


def test_token_limit_is_incomplete(served, oc):
    script(served, "one ", "two ", "three ", "four")
    resp = oc.responses.create(model="scripted", input=ASK, max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "one two" and resp.output[0].status == "incomplete"
    assert resp.max_output_tokens == 2
    events = stream_events(oc, max_output_tokens=2)
    assert events[-1].type == "response.incomplete"  # OpenAI's last event for a cut-off answer
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_the_conversation(served, oc):
    script(served, "mild.")
    first = oc.responses.create(model="scripted", input=ASK, instructions="use celsius.")
    script(served, "warm.")
    second = oc.responses.create(
        model="scripted", input="and in rome?", previous_response_id=first.id
    )
    text = prompt_text(served)
    assert text.index(ASK) < text.index("mild.") < text.index("and in rome?")
    assert "use celsius." not in text  # instructions are not carried over
    script(served, "cold.")
    oc.responses.create(model="scripted", input="and oslo?", previous_response_id=second.id)
    text = prompt_text(served)
    assert text.index("mild.") < text.index("warm.") < text.index("and oslo?")


def test_unknown_or_unstored_previous_response(served, oc):
    with pytest.raises(openai.NotFoundError) as err:
        oc.responses.create(model="scripted", input="Hi", previous_response_id="resp_nope")
    assert err.value.body["code"] == "previous_response_not_found"
    script(served, "Sunny.")
    unstored = oc.responses.create(model="scripted", input=ASK, store=False)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="scripted", input="More?", previous_response_id=unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": ASK, "temperature": 3}, "temperature"),
        ({"input": ASK, "background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, None),
    ],
)
def test_bad_requests_are_openai_errors(served, body, param):
    srv, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = raw_request(srv.port, "POST", "/v1/responses", dumps(body), auth)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == (param or "text.format.schema")


def test_api_key_applies(served):
    srv, _ = served
    status, _, raw = raw_request(srv.port, "POST", "/v1/responses", dumps({"input": ASK}))
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_engine_failure_mid_stream_is_an_error_event(served):
    srv, _ = served
    script(served, "partial", RuntimeError("device lost"))
    body = dumps({"input": ASK, "stream": True})
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = raw_request(srv.port, "POST", "/v1/responses", body, auth)
    events = [json.loads(e) for e in sse_events(raw)]
    assert status == 200 and events[-1]["type"] == "error"
    assert "device lost" in events[-1]["message"] and events[-1]["code"] is None
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# -- pieces ------------------------------------------------------------------------------------


def test_assistant_items_gather_into_one_turn():
    items = [
        InputItem(role="user", content="Weather?"),
        InputItem(type="reasoning", content=[{"type": "reasoning_text", "text": "Look it up."}]),
        InputItem(role="assistant", content="Checking."),
        InputItem(type="function_call", call_id="call_1", name="f", arguments='{"a": 1}'),
        InputItem(type="function_call", call_id="call_2", name="g"),
        InputItem(type="function_call_output", call_id="call_1", output="one"),
        InputItem(type="function_call_output", call_id="call_2", output="two"),
    ]
    user, assistant, *results = input_messages(items)
    assert user.role == "user" and assistant.role == "assistant"
    assert assistant.content == "Checking." and assistant.reasoning_content == "Look it up."
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls] == [
        ("call_1", "f", '{"a": 1}'),
        ("call_2", "g", "{}"),
    ]
    assert [(m.role, m.tool_call_id, m.content) for m in results] == [
        ("tool", "call_1", "one"),
        ("tool", "call_2", "two"),
    ]


def test_store_drops_the_least_recently_used_within_its_bounds():
    turn = [Message(role="user", content="x" * 10)]
    store = ResponseStore(max_responses=2, max_chars=25)
    store.keep("a", turn)
    store.keep("b", turn)
    store.conversation("a")  # used: "b" is now the oldest
    store.keep("c", turn)
    assert len(store) == 2 and store.conversation("a") == turn
    with pytest.raises(Exception, match="no response 'b'"):
        store.conversation("b")
    store.keep("d", [Message(role="user", content="y" * 20)])  # 10 + 20 > 25: "c" and "a" go
    assert len(store) == 1 and store.conversation("d")[0].content == "y" * 20
    store.keep("huge", [Message(role="user", content="z" * 26)])  # larger than all: not kept
    assert len(store) == 1


# -- the real default model (slow) -------------------------------------------------------------


@pytest.fixture(scope="module")
def real(smollm2_path):
    from atlas_cli.session import open_model

    model = open_model(str(smollm2_path), ctx_size=2048)
    config = ServeConfig(model=str(smollm2_path), accept_any_model=True)
    with ServerThread(create_app(config, model)) as srv:
        yield model, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.slow
def test_real_model_answers_as_the_engine_does(real):
    model, client = real
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    events = model.generate(
        model.chat_prompt(messages), max_tokens=4, sampling=SamplingOverrides(temperature=0)
    )
    want = "".join(e.text for e in events)
    resp = client.responses.create(
        model="x", input=messages[0]["content"], max_output_tokens=4, temperature=0
    )
    assert resp.output_text == want.strip() and want.strip()
    assert resp.usage.input_tokens == len(model.chat_prompt(messages))
    streamed = list(
        client.responses.create(
            model="x", input=messages[0]["content"], max_output_tokens=4, temperature=0, stream=True
        )
    )
    assert streamed[-1].response.output_text == resp.output_text
    # a follow-up by previous_response_id reuses the cached prefix of the conversation
    follow = client.responses.create(
        model="x", input="And of Italy?", previous_response_id=resp.id, max_output_tokens=1
    )
    cached = follow.usage.input_tokens_details.cached_tokens
    assert resp.usage.input_tokens <= cached < follow.usage.input_tokens
