"""The replay over HTTP, against a small fake OpenAI-compatible server on 127.0.0.1."""

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atlas_cli.bench import agentic, http_target, mlperf_rules
from atlas_cli.bench import trajectories as traj
from atlas_cli.errors import UsageError
from tests.bench_helpers import tiny_conversation, write_jsonl


class FakeOpenAI(BaseHTTPRequestHandler):
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append({"path": self.path, **body})
        if body["model"] == "broken":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "boom"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [
            {"choices": [{"delta": {"role": "assistant"}}]},  # no output yet: not the TTFT
            {"choices": [{"delta": {"content": "Hel"}}]},
            {"choices": [{"delta": {"content": "lo"}}]},
            {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 50 + len(FakeOpenAI.bodies),
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 40},
                },
            },
        ]
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def server():
    FakeOpenAI.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_chat_url_forms():
    assert http_target.chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert http_target.chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert http_target.chat_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"


def test_streamed_timing_and_usage(server):
    client = http_target.HttpTarget(server, "m")
    try:
        t = client.complete([{"role": "user", "content": "hi"}], [], max_tokens=7)
    finally:
        client.close()
    assert t.text == "Hello there"
    assert (t.prompt_tokens, t.completion_tokens, t.cached_tokens) == (51, 3, 40)
    assert t.finish_reason == "stop"
    assert 0 <= t.first_s <= t.last_s <= t.latency_s
    body = FakeOpenAI.bodies[0]
    assert body["path"] == "/v1/chat/completions"
    assert body["stream"] is True and body["temperature"] == 0 and body["seed"] == 42
    assert body["max_completion_tokens"] == 7 and "tools" not in body


def test_server_errors_are_clear(server):
    client = http_target.HttpTarget(server, "broken")
    with pytest.raises(http_target.EndpointError, match="HTTP 500"):
        client.complete([{"role": "user", "content": "hi"}], [], max_tokens=1)
    client.close()
    client = http_target.HttpTarget("http://127.0.0.1:9", "m")  # nothing listens on port 9
    with pytest.raises(http_target.EndpointError, match="cannot reach"):
        client.complete([{"role": "user", "content": "hi"}], [], max_tokens=1)
    client.close()


def test_replay_over_http_sends_the_recorded_history(server, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", tiny_conversation("a", 2) + tiny_conversation("b"))
    conversations = traj.load(path)
    settings = agentic.Settings(str(path), 1, 2, None, 16, True, False, "auto", server)
    target = agentic.UrlTarget(server, "m", 16, None, "auto", settings.seed_set.model)
    seen = []
    try:
        turns, wall = agentic.replay(conversations, target, settings, lambda t, d: seen.append(t))
    finally:
        target.close()
    assert len(turns) == len(seen) == 2 == agentic.total_requests(conversations, settings)
    assert [t.turn for t in turns] == [1, 3]
    assert all(t.output_tokens == 3 and t.cached_tokens == 40 for t in turns)
    assert all(t.tpot_s is not None and t.ttft_s <= t.latency_s for t in turns)
    sent = FakeOpenAI.bodies
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent[1]["messages"][2]["tool_calls"][0]["id"] == "call:0"  # native tool calls
    assert sent[1]["tools"] == conversations[0].tools
    result = agentic.as_result(turns, wall, settings, {"device": "http"}, {"model": "m"})
    assert result["summary"]["requests"] == 2
    assert result["summary"]["cached_tokens"]["p50"] == 40
    assert "TTFT (ms)" in agentic.summary_table(result)


def test_replay_over_http_as_text(server, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", tiny_conversation("a", 1))
    settings = agentic.Settings(
        str(path), None, None, None, 4, True, False, "text", server, min_duration_s=0
    )
    target = agentic.UrlTarget(server, "m", 4, None, "text", 42)
    try:
        agentic.replay(traj.load(path), target, settings)
    finally:
        target.close()
    last = FakeOpenAI.bodies[-1]
    assert "tools" not in last
    assert "<tool_call>" in last["messages"][2]["content"]


def test_replay_follows_the_mlperf_v61_rules(server, tmp_path):
    """Conversations in the dataloader seed's order (turns in order within each), the model
    seed in every request, the selection repeated until the minimum duration has passed, and
    the result says why a short or limited run is not a valid one."""
    names = [f"c{i}" for i in range(6)]
    rows = [row for name in names for row in tiny_conversation(name, 2)]
    conversations = traj.load(write_jsonl(tmp_path / "t.jsonl", rows))
    settings = agentic.Settings(
        str(tmp_path / "t.jsonl"), None, None, None, 4, True, False, "auto", server,
        min_duration_s=0.3,
    )  # fmt: skip
    assert settings.seed_set.dataloader == 2747215439041700203
    assert settings.seed_set.scheduler == 16159082839903944936
    order = [names[i] for i in mlperf_rules.conversation_order(6, settings.seed_set)]
    assert order != names and sorted(order) == names  # seeded, and every conversation once
    target = agentic.UrlTarget(server, "m", 4, None, "auto", settings.seed_set.model)
    FakeOpenAI.bodies.clear()
    try:
        turns, wall = agentic.replay(conversations, target, settings)
    finally:
        target.close()
    one_pass = agentic.total_requests(conversations, settings)
    assert wall >= 0.3 and len(turns) % one_pass == 0 and len(turns) >= one_pass
    first = [t.conversation_id for t in turns[:one_pass]]
    assert list(dict.fromkeys(first)) == order
    assert all(b["seed"] == 42 for b in FakeOpenAI.bodies)
    result = agentic.as_result(turns, wall, settings, {"device": "http"}, {"model": "m"})
    assert result["mlperf"]["seeds"]["dataloader"] == 2747215439041700203
    assert result["mlperf"]["valid"] is False
    assert any("600 s minimum" in r for r in result["mlperf"]["not_valid_because"])
    assert "Not a valid MLPerf v6.1 run" in agentic.summary_table(result)
    # a whole-dataset run lasts the minimum by default; a limited one is a quick look
    assert agentic.Settings("t", None, None, None, 4, True, False, "auto", None).min_duration == 600
    assert agentic.Settings("t", 1, None, None, 4, True, False, "auto", None).min_duration == 0
    legacy = agentic.Settings("t", None, None, None, 4, True, False, "auto", None, seeds="legacy")
    assert legacy.seed_set.dataloader == 42
    with pytest.raises(UsageError, match="--seeds must be one of"):
        agentic.check_settings(replace(legacy, seeds="v5"), None)
