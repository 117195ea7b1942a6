"""`atlas serve` against the real default model, through the official openai and anthropic
clients: chat (streamed and whole), completions, tool-call round trips, prefix-cache usage,
every error case, a client leaving mid-stream, and 50 queued concurrent requests."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from tests.serve_helpers import (
    ASK,
    WEATHER_TOOL,
    ServerThread,
    dumps,
    raw_request,
    sse_events,
)
from tests.serve_helpers import metric as keyed_metric

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
NAME = "smollm2-test"
CTX = 2048
BODY_LIMIT = 256 * 1024


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


def metric(port: int, name: str, labels: str = "") -> float:
    return keyed_metric(port, name, labels, key=KEY)  # /metrics is behind the server's key


_EXPECTED: dict[str, str] = {}


def expected_chat(model, messages, max_tokens) -> str:
    """The engine's own greedy answer, for the server's to equal (memoised: the CPU is slow)."""
    key = json.dumps([messages, max_tokens])
    if key not in _EXPECTED:
        ids = model.chat_prompt(messages)
        events = model.generate(
            ids, max_tokens=max_tokens, sampling=SamplingOverrides(temperature=0)
        )
        _EXPECTED[key] = "".join(e.text for e in events)
    return _EXPECTED[key]


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
    want = "".join(
        e.text for e in model.generate(ids, max_tokens=3, sampling=SamplingOverrides(temperature=0))
    )
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
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, raw = raw_request(server.port, "GET", "/metrics", headers=auth)
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
    status, _, raw = raw_request(server.port, "GET", "/metrics")  # its counts are the key's too
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


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
