"""`atlas serve` with a scripted engine (outputs the small real model does not produce: tool
calls, reasoning, JSON mode's early stop, engine failures), while the model loads, and as the
`atlas serve` command a user starts."""

from __future__ import annotations

import json
import threading

import pytest

from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import AppState, ServeConfig
from tests.serve_helpers import (
    ASK,
    WEATHER_TOOL,
    ServerThread,
    dumps,
    free_port,
    raw_request,
    scripted_model,
    sse_events,
    wait_for_health,
)

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

CTX = 2048


@pytest.fixture(scope="module")
def model(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), ctx_size=CTX)


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
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "atlas_cli", "serve", str(smollm2_path)]
    cmd += ["--port", str(port), "--ctx-size", "256", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        status = wait_for_health(port, proc)
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
    log = proc.stderr.read()
    assert log.count("ready") == 1 and f"tiny ready at http://127.0.0.1:{port}/v1" in log, log
    bad = subprocess.run(
        [sys.executable, "-m", "atlas_cli", "serve", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "unknown model" in bad.stderr
