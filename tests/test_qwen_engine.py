"""Generation on the hybrid (Gated DeltaNet + attention) cache: prefix reuse across requests
falls back to checkpoints and stays exact; snapshot/restore; and `atlas run` on Qwen3 and
Qwen3.5 checkpoint directories from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from atlas_cli.backend.cache import HybridCache, KVCache
from atlas_cli.backend.engine import Engine
from atlas_cli.backend.layers import CacheLayout, LayerKind
from atlas_cli.cli import app
from atlas_cli.session import open_model

LINEAR, FULL = LayerKind.GATED_DELTANET, LayerKind.ATTENTION

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"


@pytest.fixture(scope="module")
def qwen35():
    return open_model(str(FIXTURES / "qwen35-vlm-bf16"), device="cpu-ref")


def fresh_last_logits(model, ids) -> np.ndarray:
    engine = Engine(model.engine.model, model.tokenizer, model.context_length)
    return engine.logits(ids)[-1]


def greedy(engine: Engine, ids, n: int):
    from atlas_cli.backend.engine import GenerationStats
    from atlas_cli.backend.sample import SamplingParams

    stats = GenerationStats()
    sampling = SamplingParams(temperature=0.0)
    list(engine.generate(ids, max_tokens=n, sampling=sampling, stats=stats))
    return stats


def test_prefix_reuse_on_hybrid_cache_is_exact(qwen35):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    assert isinstance(engine.cache, HybridCache)
    rng = np.random.default_rng(0)
    first = [int(i) for i in rng.integers(8, 64, 12)]
    stats = greedy(engine, first, 6)
    reply = stats.token_ids
    assert len(reply) == 6 and stats.cached_tokens == 0

    def check(ids, expect_cached):
        logits, cached = engine.prefill(ids)
        assert cached == expect_cached
        assert np.allclose(logits, fresh_last_logits(qwen35, ids), atol=1e-5)

    # the next turn extends prompt + reply: everything cached is reused (all but the last
    # reply token, which was sampled but never fed)
    turn = first + reply + [9, 10, 11]
    check(turn, len(first) + len(reply) - 1)
    # a prompt that leaves the previous one inside the reply (e.g. reasoning dropped from the
    # history) restarts from the checkpoint taken before the last prompt token
    check(first + [12, 13, 14], len(first) - 1)
    # the same prompt again: the same checkpoint
    check(first + [12, 13, 14], len(first) + 2)
    # diverging before any checkpoint: from scratch, still exact
    check(first[:4] + [20, 21], 0)


def test_generation_after_reuse_equals_fresh(qwen35):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    rng = np.random.default_rng(1)
    prompts = [[int(i) for i in rng.integers(8, 64, 10)]]
    prompts.append(prompts[0][:7] + [30, 31, 32])
    prompts.append(prompts[0] + [40])
    for ids in prompts:
        reused = greedy(engine, ids, 8).token_ids
        fresh = greedy(Engine(qwen35.engine.model, qwen35.tokenizer, 256), ids, 8).token_ids
        assert reused == fresh


def test_snapshot_restore_rolls_back_linear_state(qwen35):
    net = qwen35.engine.model
    cache = net.new_cache(64)
    ids = np.arange(8, 20)
    cache.reserve(12)
    net.forward(ids[:6], cache, 0)
    cache.length = 6
    snap = cache.snapshot()
    first = net.forward(ids[6:9], cache, 6)
    cache.length = 9
    assert any(
        not np.array_equal(cache.linear[i].recurrent, snap.states[i].recurrent) for i in snap.states
    )
    cache.restore(snap)
    assert cache.length == 6
    again = net.forward(ids[6:9], cache, 6)
    assert np.array_equal(first, again)


def test_hybrid_truncate_keeps_what_it_can():
    cache = HybridCache(CacheLayout((LINEAR, FULL), 1, 4, (2, 3), (1, 2, 2)), max_len=512)
    cache.length = 5
    cache.checkpoint()
    cache.linear[0].recurrent[:] = 1.0
    cache.length = 9
    cache.checkpoint()
    cache.length = 12
    assert cache.truncate(20) == 12  # nothing to cut
    assert cache.truncate(10) == 9
    assert cache.truncate(7) == 5
    assert np.all(cache.linear[0].recurrent == 0)
    assert [c.length for c in cache.checkpoints] == [5]
    assert cache.truncate(3) == 0
    cache.kv[1].k[:, :3] = 7.0
    cache.length = 3
    cache.reserve(300)
    assert cache.capacity >= 300 and cache.kv[1].k.shape[1] == cache.capacity
    assert np.all(cache.kv[1].k[:, :3] == 7.0)  # growing keeps the filled positions
    kv = KVCache(1, 1, 4, 32)
    kv.length = 9
    assert kv.truncate(4) == 4  # a KV cache cuts anywhere


def test_hybrid_checkpoints_are_bounded():
    cache = HybridCache(CacheLayout((LINEAR,), 1, 4, (2, 3), (1, 2, 2)), 64, max_checkpoints=3)
    for n in range(1, 8):
        cache.length = n
        cache.checkpoint()
    assert [c.length for c in cache.checkpoints] == [5, 6, 7]


@pytest.mark.parametrize(
    "name", ["qwen3-tied-bf16", "qwen35-text-bf16", "qwen35-vlm-bf16", "qwen35-nvfp4"]
)
def test_atlas_run_streams_tokens(name):
    runner = CliRunner()
    path = str(FIXTURES / name)
    result = runner.invoke(app, ["run", path, "hello there", "-n", "10", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert len(result.output) > 10  # ten tokens of at least one character each, then "\n"
    result = runner.invoke(
        app, ["run", path, "hello there", "-n", "10", "--temperature", "0", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["completion_tokens"] == 10 and out["finish_reason"] == "length"
    # "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n": one id per character
    # (the fixture tokenizer is character-level) and per special token
    assert out["prompt_tokens"] == 3 + len("user\nhello there\nassistant\n")


def test_atlas_run_on_qwen35_gguf():
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(FIXTURES / "qwen35-gguf" / "model.gguf"),
            "hi",
            "-n",
            "5",
            "--json",
            "--seed",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["completion_tokens"] == 5
