"""llama-server's `timings` beside OpenAI's `usage` (what Lemonade reads its TTFT and tokens per
second from): the fields from an answer's GenerationStats, where they ride in a stream, and
their agreement with `usage` on the real default model, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import pytest

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.serve import openai_api
from atlas_cli.serve.toolcalls import ContentDelta
from atlas_cli.serve.turn import Outcome
from tests.serve_helpers import ASK, ServerThread, dumps, raw_request, sse_events

FIELDS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


def outcome(**stats) -> Outcome:
    return Outcome(GenerationStats(**stats), "stop", "Paris.", "Paris.")


def test_timings_from_the_generation_stats():
    out = outcome(prompt_tokens=50, cached_tokens=40, completion_tokens=8, prompt_s=0.5, eval_s=2)
    assert out.timings == {
        "cache_n": 40,  # the prompt tokens the prefix cache had
        "prompt_n": 10,  # the ones evaluated
        "prompt_ms": 500.0,
        "prompt_per_token_ms": 50.0,
        "prompt_per_second": 20.0,
        "predicted_n": 8,
        "predicted_ms": 2000.0,
        "predicted_per_token_ms": 250.0,
        "predicted_per_second": 4.0,
    }


def test_nothing_to_divide_by_reads_zero():
    """JSON has no infinity: llama.cpp's server would write null; these stay numbers."""
    timings = outcome(prompt_tokens=5, cached_tokens=5).timings
    assert timings["prompt_n"] == 0 and timings["prompt_per_token_ms"] == 0.0
    assert timings["predicted_n"] == 0 and timings["predicted_per_second"] == 0.0


def test_drafting_adds_llama_cpp_draft_counts():
    assert "draft_n" not in outcome(completion_tokens=3, eval_s=1).timings
    out = outcome(completion_tokens=9, eval_s=1, draft_rounds=3, draft_tokens=9, accepted_tokens=6)
    assert (out.timings["draft_n"], out.timings["draft_n_accepted"]) == (9, 6)


class FinishedTurn:
    """What the stream writers read of a Turn: its pieces, then its outcome."""

    def __init__(self, out: Outcome):
        self.out = out
        self.outcome = None

    async def deltas(self):
        yield ContentDelta(self.out.content)
        self.outcome = self.out

    async def texts(self):
        yield self.out.text

    async def finish_plain(self, text):
        return self.out


def chunks(events) -> list[dict]:
    async def collect():
        return [json.loads(e[6:]) async for e in events]

    return asyncio.run(collect())


@pytest.mark.parametrize("include_usage", [False, True])
def test_timings_ride_on_the_last_chunk(include_usage):
    out = outcome(prompt_tokens=12, completion_tokens=3, prompt_s=0.1, eval_s=0.2)
    meta = {"id": "x", "created": 0, "model": "m", "system_fingerprint": "atlas"}
    chat = chunks(openai_api.chat_stream(FinishedTurn(out), meta, include_usage))
    text = chunks(openai_api.completion_stream(FinishedTurn(out), meta, include_usage, ""))
    for stream in (chat, text):
        assert [("timings" in c) for c in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1]["timings"] == out.timings
        assert (stream[-1]["choices"] == []) is include_usage  # the usage chunk when asked


# -- the real default model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path):
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from atlas_cli.session import open_model

    model = open_model(str(smollm2_path), ctx_size=1024)
    with ServerThread(create_app(ServeConfig(model=str(smollm2_path)), model)) as srv:
        yield srv


def post(server, path: str, body: dict) -> bytes:
    status, _, raw = raw_request(server.port, "POST", path, dumps(body))
    assert status == 200, raw
    return raw


def check_consistent(timings: dict, usage: dict) -> None:
    assert set(timings) == FIELDS
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["predicted_n"] == usage["completion_tokens"] > 0
    assert timings["prompt_n"] > 0 and timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    per_token = timings["prompt_ms"] / timings["prompt_n"]
    assert timings["prompt_per_token_ms"] == pytest.approx(per_token)
    assert timings["prompt_per_second"] == pytest.approx(1e3 / per_token)
    rate = timings["predicted_n"] / timings["predicted_ms"] * 1e3
    assert timings["predicted_per_second"] == pytest.approx(rate)


@pytest.mark.slow
def test_whole_and_streamed_answers_carry_consistent_timings(server):
    ask = {"messages": ASK, "max_tokens": 4, "temperature": 0}
    whole = json.loads(post(server, "/v1/chat/completions", ask))
    check_consistent(whole["timings"], whole["usage"])
    # the same prompt again: the prefix cache has it, and timings say so as usage does
    again = json.loads(post(server, "/v1/chat/completions", ask))
    assert again["timings"]["cache_n"] >= whole["usage"]["prompt_tokens"] - 1
    check_consistent(again["timings"], again["usage"])
    streamed = {**ask, "stream": True, "stream_options": {"include_usage": True}}
    last = json.loads(sse_events(post(server, "/v1/chat/completions", streamed))[-2])
    check_consistent(last["timings"], last["usage"])
    text = {"prompt": "The capital of France is", "max_tokens": 3}
    done = json.loads(post(server, "/v1/completions", text))
    check_consistent(done["timings"], done["usage"])
    plain = json.loads(sse_events(post(server, "/v1/completions", {**text, "stream": True}))[-2])
    assert plain["choices"][0]["finish_reason"] and set(plain["timings"]) == FIELDS
