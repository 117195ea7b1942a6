"""Replays two conversations of the MLPerf Edge Agentic trajectory file against `atlas serve`,
the way the MLPerf endpoints harness does: one streaming chat request per user or tool row,
whose messages are the system prompt plus the *recorded* history up to that row, temperature
0, seed 42, one request at a time.

SmolLM2's 8K context (2K here, to keep the CPU time small) cannot hold the recorded 23K-token
prompts, so every message is capped before it is sent (see `cap`): the system prompt and the
task keep their first characters, tool outputs and commands are cut to a few hundred
characters, and reasoning is dropped (SmolLM2's template does not render it). The cap applies
to each message on its own, so each request's prompt still extends the previous one and the
prefix cache is exercised as in the real benchmark. Only the first REQUESTS requests of each
conversation are sent by default (the CPU is shared); ATLAS_REPLAY_REQUESTS=0 replays them
all.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from tests.serve_helpers import ServerThread

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RELATIVE = Path("data/mlperf-edge-agentic/agentic_coding_2.5h.jsonl")
CANDIDATES = [REPO.parent / "shared" / RELATIVE]  # beside the checkout, or ATLAS_MLPERF_DATA
REQUESTS = int(os.environ.get("ATLAS_REPLAY_REQUESTS", "3"))
CTX = 2048
MAX_COMPLETION_TOKENS = 2  # the harness asks for 1024; the answers are not what is tested
CAPS = {"system": 400, "task": 600, "tool_output": 160, "command": 120}


def trajectory_file() -> Path:
    env = os.environ.get("ATLAS_MLPERF_DATA")
    for path in [Path(env)] if env else CANDIDATES:
        if path.is_file():
            return path
    if os.environ.get("CI"):
        pytest.fail(f"the MLPerf trajectory file is missing (looked at {CANDIDATES})")
    pytest.skip("the MLPerf trajectory file is not here")


def load_conversations(path: Path) -> dict[str, list[dict]]:
    convs: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        convs.setdefault(row["conversation_id"], []).append(row)
    for rows in convs.values():
        rows.sort(key=lambda r: r["turn"])
    return convs


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + " [...]"


def cap(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The conversation as OpenAI messages (system first), each message capped; and the tools."""
    first = rows[0]
    messages = [{"role": "system", "content": _cut(first["system"], CAPS["system"])}]
    for row in rows:
        if row["role"] == "user":
            messages.append({"role": "user", "content": _cut(row["content"], CAPS["task"])})
        elif row["role"] == "assistant":
            calls = []
            for call in row.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                if isinstance(args.get("command"), str):
                    args["command"] = _cut(args["command"], CAPS["command"])
                fn = {"name": call["function"]["name"], "arguments": json.dumps(args)}
                calls.append({"id": call["id"], "type": "function", "function": fn})
            msg = {"role": "assistant", "content": row.get("content") or None}
            messages.append({**msg, "tool_calls": calls} if calls else msg)
        else:
            for result in row["tool_results"]:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": result["tool_call_id"],
                        "content": _cut(result["content"], CAPS["tool_output"]),
                    }
                )
    return messages, first["tools"]


def requests_of(rows: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """One request per user or tool row: the capped history up to and including that row."""
    out = []
    for i, row in enumerate(rows):
        if row["role"] in ("user", "tool"):
            out.append(cap(rows[: i + 1]))
    return out


@pytest.fixture(scope="module")
def server(smollm2_path):
    from atlas_cli.session import open_model

    model = open_model(str(smollm2_path), ctx_size=CTX)
    config = ServeConfig(model=str(smollm2_path), served_model_name="smollm2")
    with ServerThread(create_app(config, model)) as srv:
        yield srv


def test_cap_keeps_each_prompt_a_prefix_of_the_next():
    convs = load_conversations(trajectory_file())
    assert len(convs) == 20
    rows = min(convs.values(), key=len)
    reqs = requests_of(rows)
    assert len(reqs) == sum(r["role"] != "assistant" for r in rows)
    for (a, _), (b, _) in zip(reqs, reqs[1:], strict=False):
        assert b[: len(a)] == a


def test_replay_two_conversations(server):
    convs = load_conversations(trajectory_file())
    chosen = sorted(convs, key=lambda c: (len(convs[c]), c))[:2]  # the two shortest
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=1800)
    report = []
    for conv in chosen:
        reqs = requests_of(convs[conv])
        if REQUESTS:
            reqs = reqs[:REQUESTS]
        previous_prompt = 0
        for k, (messages, tools) in enumerate(reqs):
            sent = time.perf_counter()
            stream = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                tools=tools,
                max_completion_tokens=MAX_COMPLETION_TOKENS,
                temperature=0,
                seed=42,
                stream=True,
                stream_options={"include_usage": True},
            )
            first = None
            chunks = []
            for chunk in stream:
                first = first or time.perf_counter()
                chunks.append(chunk)
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert finish in ("stop", "length", "tool_calls")
            assert usage.prompt_tokens < CTX and usage.completion_tokens > 0
            cached = usage.prompt_tokens_details.cached_tokens
            if k:  # the recorded history grows: everything sent before is reused
                assert cached >= previous_prompt - 1
            previous_prompt = usage.prompt_tokens
            report.append((conv, k, usage.prompt_tokens, cached, first - sent))
    assert len({r[0] for r in report}) == 2
    for conv, k, prompt, cached, ttft in report:
        print(f"{conv} request {k}: prompt {prompt} tokens, cached {cached}, TTFT {ttft:.2f}s")
