"""The prefix cache on disk (backend/prefix_disk.py): a conversation spilled by one engine is
resumed by a fresh one (a restarted server) with the logits of a cold prefill, on the hybrid
cache and the default model; evictions spill; the quota holds; an entry a longer one covers
goes; corrupt, foreign and short entries are skipped or never written; `atlas serve` keeps its
conversations across a restart and reports them as cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend import prefix_disk
from atlas_cli.backend.engine import Engine
from tests.serve_helpers import dumps, free_port, raw_request, wait_for_health
from tests.test_prefix_pool import FIXTURES, fresh_logits, greedy

SYSTEM = "You are a coding agent. " + " ".join(
    f"Rule {i}: use the tools, keep answers short and cite rule {i}." for i in range(3)
)
MIN_TOKENS = 48  # what the tiny models' conversations here reach (the tiny Qwen3.5 holds 512)


@pytest.fixture(autouse=True)
def min_tokens(monkeypatch):
    monkeypatch.setattr(prefix_disk, "MIN_TOKENS", MIN_TOKENS)


@pytest.fixture(scope="module")
def qwen35():
    from atlas_cli.session import open_model

    return open_model(str(FIXTURES / "qwen35-vlm-bf16"), device="cpu-ref")


def conversation(model, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return model.tokenizer.encode(model.tokenizer.render_chat(messages))


def engine_on_disk(model, folder: Path, source: Path, quota: int = 1 << 30, budget=None):
    engine = Engine(model.engine.model, model.tokenizer, 512, cache_bytes=budget)
    engine.keep_on_disk(folder, quota, source)
    return engine


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.npz"))


@pytest.mark.parametrize("which", ["qwen35", "smollm2"])
def test_a_fresh_engine_resumes_a_spilled_conversation_exactly(which, request, tmp_path):
    model = request.getfixturevalue(which)
    source = tmp_path / "weights"
    source.write_bytes(b"the weights' identity")
    first = engine_on_disk(model, tmp_path, source)
    turn1 = conversation(model, "list the files")
    assert len(turn1) >= MIN_TOKENS
    reply = greedy(first, turn1, 5)
    first.spill_all()
    (entry,) = entries(tmp_path)

    restarted = engine_on_disk(model, tmp_path, source)
    turn2 = turn1 + reply.token_ids + conversation(model, "ok")[-6:]
    logits, cached = restarted.prefill(turn2)
    assert cached >= len(turn1) - 1  # the whole first turn (hybrid: from its checkpoint)
    assert np.allclose(logits, fresh_logits(model, turn2), atol=1e-5)

    # another weights file (a re-quantisation) never sees it
    other = tmp_path / "other"
    other.write_bytes(b"other weights")
    assert engine_on_disk(model, tmp_path, other).prefill(turn2)[1] == 0


def test_evictions_spill_and_a_longer_entry_replaces_the_one_it_covers(smollm2, tmp_path):
    source = tmp_path / "weights"
    source.write_bytes(b"w")
    engine = engine_on_disk(smollm2, tmp_path, source, budget=0)  # keeps only the one in use
    a = conversation(smollm2, "read main.py")
    b = conversation(smollm2, "write a test")
    reply = greedy(engine, a, 3).token_ids
    greedy(engine, b, 3)  # b leaves a inside its prompt, with no room for a copy: a goes
    engine.disk.flush()
    assert len(entries(tmp_path)) == 1
    a_cached = engine.prefill(a + reply + [1, 2, 3])[1]  # back from disk, b evicted in turn
    assert a_cached == len(a) + len(reply) - 1
    engine.spill_all()
    names = {p.name for p in entries(tmp_path)}
    assert len(names) == 2  # a's longer entry replaced its first one; b's is there


def test_the_quota_keeps_the_most_recent_entries(smollm2, tmp_path):
    source = tmp_path / "weights"
    source.write_bytes(b"w")
    engine = engine_on_disk(smollm2, tmp_path, source, budget=0)
    for i in range(3):
        greedy(engine, conversation(smollm2, f"task {i}"), 2)
        time.sleep(0.01)  # distinct mtimes
    engine.spill_all()
    size = entries(tmp_path)[0].stat().st_size
    engine.disk.quota = int(2.5 * size)
    engine.disk.spill(engine.pool.current)  # the newest again: touches it, enforces the quota
    engine.disk.flush()
    assert len(entries(tmp_path)) == 2


def test_a_stopping_process_writes_the_most_recent_first_within_its_time(smollm2, tmp_path):
    """Lemonade kills its backend 5 s after SIGTERM: the spill at shutdown is bounded (the most
    recent conversation always written), and what a killed write leaves is cleared later."""
    source = tmp_path / "weights"
    source.write_bytes(b"w")
    engine = engine_on_disk(smollm2, tmp_path, source)
    for i in range(3):
        greedy(engine, conversation(smollm2, f"task {i}"), 2)
    engine.spill_all(seconds=0)
    (entry,) = entries(tmp_path)
    last = engine.pool.current.ids
    assert list(np.load(entry)["ids"]) == last
    stale = entry.parent / f".{entry.name}.123.partial"
    stale.write_bytes(b"cut")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    engine_on_disk(smollm2, tmp_path, source).disk.index()
    assert not stale.exists() and entry.exists()


def test_short_corrupt_and_foreign_entries(smollm2, tmp_path, caplog):
    source = tmp_path / "weights"
    source.write_bytes(b"w")
    engine = engine_on_disk(smollm2, tmp_path, source)
    greedy(engine, smollm2.tokenizer.encode("hi"), 2)
    engine.spill_all()
    assert entries(tmp_path) == []  # under MIN_TOKENS: not worth a file

    ids = conversation(smollm2, "read main.py")
    greedy(engine, ids, 2)
    engine.spill_all()
    (entry,) = entries(tmp_path)
    good = entry.read_bytes()
    cut = entry.with_name("cut.npz")
    cut.write_bytes(good[: len(good) // 2])
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF  # a CRC-32 mismatch inside the keys
    entry.write_bytes(bytes(flipped))
    (entry.parent / "junk.npz").write_bytes(b"not a zip")

    fresh = engine_on_disk(smollm2, tmp_path, source)
    logits, cached = fresh.prefill(ids + [5, 6])
    assert cached == 0 and np.allclose(logits, fresh_logits(smollm2, ids + [5, 6]), atol=1e-5)
    assert "skipping the cached conversation" in caplog.text
    assert not entry.exists() and not (entry.parent / "junk.npz").exists()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "qwen35"])
def test_a_restarted_server_answers_the_next_turn_from_the_cache(which, smollm2_path, tmp_path):
    """`atlas serve` as a user runs it, on the default model and the tiny hybrid Qwen3.5:
    stopped with SIGTERM after one turn, started again; the second turn's prompt tokens are
    reported as cached."""
    from atlas_cli.backend.ops.cpu.jit import kernel_cache_dir

    env = dict(os.environ, ATLAS_HOME=str(tmp_path), NUMBA_CACHE_DIR=str(kernel_cache_dir()))
    model = smollm2_path if which == "smollm2" else FIXTURES / "qwen35-vlm-bf16"
    notes = 30 if which == "smollm2" else 0  # past MIN_TOKENS (the tiny Qwen3.5's words are
    system = SYSTEM + " ".join(f"Note {i}: be exact." for i in range(notes))  # many tokens)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "2+2?"}]

    def one_turn(messages) -> dict:
        port = free_port()
        cmd = [sys.executable, "-m", "atlas_cli", "serve", str(model), "--port", str(port)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert wait_for_health(port, proc) == 200
            body = {"messages": messages, "max_tokens": 6, "temperature": 0}
            status, _, raw = raw_request(port, "POST", "/v1/chat/completions", dumps(body))
            assert status == 200, raw
            return json.loads(raw)
        finally:
            proc.terminate()
            # uvicorn ends a graceful shutdown by raising the signal again
            assert proc.wait(60) in (0, -15), proc.stderr.read().decode()[-2000:]

    first = one_turn(messages)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [first["choices"][0]["message"], {"role": "user", "content": "and 3+3?"}]
    second = one_turn(messages)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"], second["usage"]
