"""`atlas serve` against the real default model, through the official openai and anthropic
clients: chat (streamed and whole), completions, tool-call round trips, prefix-cache usage,
every error case, a client leaving mid-stream, and 50 queued concurrent requests."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from atlas_cli.serve.app import AppState, ServeConfig, create_app
from tests.serve_helpers import (
    ServerThread,
    dumps,
    metric,
    raw_request,
    scripted_model,
    sse_events,
)

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
NAME = "smollm2-test"
CTX = 2048
BODY_LIMIT = 256 * 1024
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def model(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), ctx_size=CTX)


@pytest.fixture(scope="module")
def server(model, smollm2_path):
    config = ServeConfig(
        model=str(smollm2_path), served_model_name=NAME, api_key=KEY, max_body_bytes=BODY_LIMIT
    )
    with ServerThread(create_app(config, model)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=1800)


_EXPECTED: dict[str, str] = {}


def expected_chat(model, messages, max_tokens) -> str:
    """The engine's own greedy answer, for the server's to equal (memoised: the CPU is slow)."""
    key = json.dumps([messages, max_tokens])
    if key not in _EXPECTED:
        ids = model.chat_prompt(messages)
        events = model.generate(ids, max_tokens=max_tokens, temperature=0)
        _EXPECTED[key] = "".join(e.text for e in events)
    return _EXPECTED[key]


ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # newer anthropic clients have no temperature argument


def test_health_models_and_auth_free_endpoints(server, client):
    status, _, body = raw_request(server.port, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_chat_non_streamed_matches_engine(model, client):
    want = expected_chat(model, ASK, 4)
    resp = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want and want
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(model.chat_prompt(ASK))
    assert 0 < resp.usage.completion_tokens <= 4
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model == NAME and resp.object == "chat.completion"


def test_chat_streamed(model, client, server):
    want = expected_chat(model, ASK, 4)
    stream = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        max_completion_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 4
    # the raw stream ends with the [DONE] sentinel
    body = dumps({"model": NAME, "messages": ASK, "max_tokens": 1, "stream": True})
    status, headers, raw = raw_request(
        server.port, "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert sse_events(raw)[-1] == "[DONE]"


def test_second_turn_reuses_the_prefix(client):
    first = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, temperature=0)
    history = [
        *ASK,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(
        model=NAME, messages=history, max_tokens=1, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the whole first prompt, at least
    assert cached < second.usage.prompt_tokens


def test_tool_round_trip_through_the_template(model, client, server):
    """SmolLM2's template renders neither tools nor tool calls: the server renders them the
    Hermes way, and the real model answers after a tool result."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ]
    resp = client.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER_TOOL], max_tokens=2, temperature=0
    )
    assert resp.choices[0].message.content or resp.choices[0].message.tool_calls
    # the prompt the model saw holds the tool list, the call and its result
    body = dumps({"messages": messages, "tools": [WEATHER_TOOL]})
    status, _, raw = raw_request(
        server.port, "POST", "/tokenize", body, {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200
    ids = json.loads(raw)["tokens"]
    assert resp.usage.prompt_tokens == len(ids)
    text = model.tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_completions(model, client):
    prompt = "The capital of France is"
    ids = model.tokenizer.encode(prompt, add_special_tokens=True)
    want = "".join(e.text for e in model.generate(ids, max_tokens=3, temperature=0))
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert resp.choices[0].text == want
    assert resp.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    echoed = client.completions.create(
        model=NAME, prompt=ids, max_tokens=1, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(prompt) and want.startswith(
        echoed.choices[0].text[len(prompt) :]
    )


def test_tokenize_detokenize(model, server):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = raw_request(
        server.port, "POST", "/tokenize", dumps({"content": "Hello world"}), auth
    )
    ids = json.loads(raw)["tokens"]
    assert status == 200 and ids == model.tokenizer.encode("Hello world")
    status, _, raw = raw_request(server.port, "POST", "/detokenize", dumps({"tokens": ids}), auth)
    assert status == 200 and json.loads(raw)["content"] == "Hello world"
    status, _, raw = raw_request(server.port, "POST", "/detokenize", dumps({"tokens": [-1]}), auth)
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"


def test_anthropic_messages(model, server, client):
    want = expected_chat(model, ASK, 4)
    ac = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    msg = ac.messages.create(model=NAME, messages=ASK, max_tokens=4, extra_body=GREEDY)
    assert msg.content[0].type == "text" and msg.content[0].text == want
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with ac.messages.stream(model=NAME, messages=ASK, max_tokens=4, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want and final.usage.output_tokens == msg.usage.output_tokens
    # the same prompt again: all but its last token come from the prefix cache
    assert final.usage.cache_read_input_tokens == len(model.chat_prompt(ASK)) - 1
    assert final.usage.input_tokens == 1
    count = ac.messages.count_tokens(model=NAME, messages=ASK)
    assert count.input_tokens == len(model.chat_prompt(ASK))
    with pytest.raises(anthropic.NotFoundError) as err:
        ac.messages.create(model="claude-nope", messages=ASK, max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_json_mode(client):
    resp = client.chat.completions.with_raw_response.create(
        model=NAME,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=8,
        temperature=0,
    )
    content = resp.parse().choices[0].message.content
    assert content.startswith("{")
    try:
        json.loads(content)
        valid = True
    except ValueError:
        valid = False
    assert resp.headers["x-atlas-json-valid"] == str(valid).lower()


def test_metrics(server, client):
    client.chat.completions.create(model=NAME, messages=ASK, max_tokens=1, temperature=0)
    status, headers, raw = raw_request(server.port, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        "atlas_time_to_first_token_seconds_bucket",
        "atlas_time_per_output_token_seconds_bucket",
        "atlas_kv_cache_usage_ratio",
        "atlas_prompt_tokens_cached_total",
    ):
        assert name in text
    assert metric(server.port, "atlas_time_to_first_token_seconds_count") > 0
    assert 0 < metric(server.port, "atlas_kv_cache_usage_ratio") <= 1
    assert metric(server.port, "atlas_requests_total", 'endpoint="chat_completions",status="200"')


# -- errors ------------------------------------------------------------------------------------


def test_malformed_json(server):
    status, _, raw = raw_request(
        server.port, "POST", "/v1/chat/completions", b'{"model": ', {"x-api-key": KEY}
    )
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json" and err["message"]


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", messages=ASK, max_tokens=2)
    assert err.value.code == "model_not_found"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": 7}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"n": 3}, "n"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_bad_parameter_values(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=NAME, messages=ASK, max_tokens=2, tools=[WEATHER_TOOL], extra_body=extra
        )
    assert err.value.status_code == 400 and err.value.param == param


def test_prompt_longer_than_context(client):
    long = [{"role": "user", "content": "word " * (CTX + 10)}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=long, max_tokens=2)
    assert err.value.code == "context_length_exceeded"
    assert f"{CTX:,}" in err.value.message


def test_body_over_the_limit(client, server):
    huge = [{"role": "user", "content": "x" * (BODY_LIMIT + 10)}]
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=NAME, messages=huge, max_tokens=2)
    assert err.value.status_code == 413 and err.value.code == "request_too_large"


def test_wrong_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=NAME, messages=ASK, max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    status, _, _ = raw_request(server.port, "GET", "/v1/models")  # no key at all
    assert status == 401


# -- disconnects and queueing ------------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_engine(model, client, server):
    before_tokens = metric(server.port, "atlas_generation_tokens_total")
    before_cut = metric(server.port, "atlas_generations_total", 'finish_reason="interrupted"')
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 2:
            break
    stream.close()  # the client goes away mid-answer
    # the next request is answered normally (and only after the cut one let go)
    want = expected_chat(model, ASK, 4)
    resp = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, temperature=0)
    assert resp.choices[0].message.content == want
    cut = metric(server.port, "atlas_generations_total", 'finish_reason="interrupted"')
    assert cut == before_cut + 1
    spent = metric(server.port, "atlas_generation_tokens_total") - before_tokens
    assert spent - resp.usage.completion_tokens < 400  # it stopped well before max_tokens


def test_disconnect_while_not_streaming(model, server):
    """A non-streamed request whose client leaves is stopped too."""
    import socket
    import time

    before = metric(server.port, "atlas_generations_total", 'finish_reason="interrupted"')
    # a long answer: the fast CPU path would finish a short one before the client has left
    long = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    body = dumps({"model": NAME, "messages": long, "max_tokens": 400, "temperature": 0})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        for _ in range(600):  # wait until it is generating
            if metric(server.port, "atlas_num_requests_running") == 1:
                break
            time.sleep(0.1)
    for _ in range(600):  # the client is gone: the engine lets go
        if metric(server.port, "atlas_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(server.port, "atlas_generations_total", 'finish_reason="interrupted"') == (
        before + 1
    )


def test_fifty_queued_concurrent_requests(model, client, server):
    # five questions whose answers start with different tokens, so a mix-up shows
    questions = [
        "What is 2+2?",
        "Say hello.",
        "What is water?",
        "Count to 3.",
        "Is the sky blue? Answer yes or no.",
    ]
    want = {q: expected_chat(model, [{"role": "user", "content": q}], 1) for q in questions}
    assert len(set(want.values())) == len(questions)
    jobs = [questions[i % len(questions)] for i in range(50)]
    barrier = threading.Barrier(50)

    def ask(q: str) -> str:
        barrier.wait()  # all 50 in flight together
        resp = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": q}], max_tokens=1, temperature=0
        )
        return resp.choices[0].message.content

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(ask, jobs))
    assert answers == [want[q] for q in jobs]
    assert metric(server.port, "atlas_num_requests_waiting") == 0
    assert metric(server.port, "atlas_num_requests_running") == 0


# -- parsing, with a scripted engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(model):
    fake = scripted_model(model.tokenizer)
    with ServerThread(create_app(ServeConfig(model="scripted"), fake)) as srv:
        yield srv, fake.engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x")


CALL_SCRIPT = [
    "Let me ",
    "check.",
    "<tool",
    "_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_call>",
]


def test_tool_call_parsed(scripted):
    _, engine, oc = scripted
    engine.script = CALL_SCRIPT
    resp = oc.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id


def test_tool_call_streamed_as_deltas(scripted):
    _, engine, oc = scripted
    engine.script = CALL_SCRIPT
    chunks = list(
        oc.chat.completions.create(
            model="scripted", messages=ASK, tools=[WEATHER_TOOL], stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert content == "Let me check."
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_without_tools_is_text(scripted):
    _, engine, oc = scripted
    engine.script = CALL_SCRIPT
    resp = oc.chat.completions.create(model="scripted", messages=ASK)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == "".join(CALL_SCRIPT)


def test_reasoning_content(scripted):
    _, engine, oc = scripted
    engine.script = ["<think>", "Paris is ", "the capital.", "</think>", "\n\nParis."]
    resp = oc.chat.completions.create(model="scripted", messages=ASK)
    msg = resp.choices[0].message
    assert msg.reasoning_content == "Paris is the capital." and msg.content == "Paris."
    chunks = list(oc.chat.completions.create(model="scripted", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "Paris is the capital."
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_json_mode_stops_after_the_object(scripted):
    _, engine, oc = scripted
    engine.script = ['"city": ', '"Paris"}', " I hope", " that helps."]
    resp = oc.chat.completions.with_raw_response.create(
        model="scripted", messages=ASK, response_format={"type": "json_object"}
    )
    assert resp.parse().choices[0].message.content == '{"city": "Paris"}'
    assert resp.headers["x-atlas-json-valid"] == "true"
    assert resp.parse().choices[0].finish_reason == "stop"


def test_engine_failure_is_a_500(scripted):
    srv, engine, oc = scripted
    engine.script = ["partial", RuntimeError("device lost")]
    oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        oc.chat.completions.create(model="scripted", messages=ASK)
    assert "device lost" in err.value.message and err.value.type == "server_error"
    body = dumps({"messages": ASK, "stream": True})
    status, _, raw = raw_request(srv.port, "POST", "/v1/chat/completions", body)
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    engine.script = ["fine"]  # and the server goes on
    assert oc.chat.completions.create(model="scripted", messages=ASK).choices[0].message.content


def test_anthropic_tool_use(scripted):
    srv, engine, _ = scripted
    engine.script = CALL_SCRIPT
    ac = anthropic.Anthropic(base_url=srv.url, api_key="x")
    tool = {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
    msg = ac.messages.create(model="scripted", max_tokens=64, messages=ASK, tools=[tool])
    assert msg.stop_reason == "tool_use"
    text, use = msg.content
    assert text.text == "Let me check."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    with ac.messages.stream(model="scripted", max_tokens=64, messages=ASK, tools=[tool]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    # the tool result goes back as a tool message in the prompt
    engine.script = ["It is 21 C."]
    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
        },
    ]
    reply = ac.messages.create(model="scripted", max_tokens=64, messages=history, tools=[tool])
    assert reply.content[0].text == "It is 21 C."
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tool_response>\n21 C\n</tool_response>" in prompt
    assert '"arguments": {"city": "Paris"}' in prompt


# -- loading -----------------------------------------------------------------------------------


def test_health_is_503_while_loading(model, monkeypatch):
    release = threading.Event()

    def slow_load(self):
        release.wait(30)
        self.set_model(model)

    monkeypatch.setattr(AppState, "load", slow_load)
    with ServerThread(create_app(ServeConfig(model="smollm2"))) as srv:
        status, _, raw = raw_request(srv.port, "GET", "/health")
        assert status == 503 and json.loads(raw)["status"] == "loading"
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            oc.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1)
        assert err.value.status_code == 503 and err.value.code == "model_loading"
        release.set()
        for _ in range(200):
            status, _, _ = raw_request(srv.port, "GET", "/health")
            if status == 200:
                break
            threading.Event().wait(0.05)
        assert status == 200


# -- the command line --------------------------------------------------------------------------


def test_accept_any_model_like_llama_server(model):
    fake = scripted_model(model.tokenizer)
    fake.engine.script = ["ok"]
    app = create_app(ServeConfig(model="x", accept_any_model=True), fake)
    with ServerThread(app) as srv:
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        resp = oc.chat.completions.create(model="Qwen3-0.6B-GGUF", messages=ASK)
        assert resp.choices[0].message.content == "ok"


def test_atlas_serve_command(smollm2_path, tmp_path):
    """`atlas serve` as a user starts it: binds, loads, answers, and refuses a taken port."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "atlas_cli", "serve", str(smollm2_path)]
    cmd += ["--port", str(port), "--ctx-size", "256", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        status = None
        for _ in range(1200):
            if proc.poll() is not None:
                break
            try:
                status, _, _ = raw_request(port, "GET", "/health")
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200, proc.stderr.read() if proc.poll() is not None else "no health"
        _, _, raw = raw_request(port, "GET", "/v1/models")
        assert json.loads(raw)["data"][0]["id"] == "tiny"
        assert json.loads(raw)["data"][0]["meta"]["context_length"] == 256
        taken = subprocess.run(
            [sys.executable, "-m", "atlas_cli", "serve", str(smollm2_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert taken.returncode == 2 and "pick another --port" in taken.stderr
        assert "Traceback" not in taken.stderr
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run(
        [sys.executable, "-m", "atlas_cli", "serve", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "unknown model" in bad.stderr
