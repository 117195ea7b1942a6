"""MTP speculative decoding: the token stream is the one without speculation (greedy, and
seeded sampling), with drafts accepted and rejected, and rejected drafts rolled back exactly in
the linear-attention (Gated DeltaNet) layers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from atlas_cli.backend.engine import Engine, GenerationStats
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.cli import app
from atlas_cli.session import open_model

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"


@pytest.fixture(scope="module")
def model():
    m = open_model(str(FIXTURES / "qwen35-vlm-bf16"), device="cpu-ref")
    assert m.engine.model.has_mtp and m.engine.speculator is not None  # on by default
    return m


def generate(model, ids, n, draft, temperature=0.0, seed=None, engine=None):
    engine = engine or Engine(model.engine.model, model.tokenizer, 256, draft=draft)
    stats = GenerationStats()
    params = SamplingParams(temperature=temperature, seed=seed, top_k=0, top_p=1.0, min_p=0.0)
    list(engine.generate(ids, max_tokens=n, sampling=params, stats=stats))
    return stats


def random_prompts(seed, count):
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.integers(8, 64, int(rng.integers(1, 40)))] for _ in range(count)]


@pytest.mark.parametrize("draft", [1, 2, 4])
def test_greedy_stream_is_unchanged(model, draft):
    for ids in random_prompts(draft, 8):
        plain = generate(model, ids, 20, draft=0)
        spec = generate(model, ids, 20, draft=draft)
        assert spec.token_ids == plain.token_ids
        assert plain.draft_rounds == 0 and spec.draft_rounds > 0
        assert spec.draft_tokens > 0


def test_seeded_sampling_stream_is_unchanged(model):
    for seed, ids in enumerate(random_prompts(10, 6)):
        plain = generate(model, ids, 20, draft=0, temperature=1.0, seed=seed)
        spec = generate(model, ids, 20, draft=3, temperature=1.0, seed=seed)
        assert spec.token_ids == plain.token_ids


def spoiling_oracle(truth: list[int], prompt_len: int, k: int):
    """Drafts the true continuation, but spoils the second draft of every third round."""
    rounds = []

    def draft(token: int, n: int) -> list[int]:
        i = n - prompt_len  # `token` is reply token i
        drafts = list(truth[i + 1 : i + 1 + k]) or [5]
        rounds.append(n)
        if len(rounds) % 3 == 0 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 64  # rejected from the second draft on
        return drafts

    return draft


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_accepted_and_rejected_drafts(model, temperature):
    """An oracle drafter that knows the answer but spoils every third round: full accepts,
    partial accepts and rollbacks in the GDN layers all happen, and the stream is unchanged."""
    for seed, ids in enumerate(random_prompts(20, 4)):
        plain = generate(model, ids, 24, draft=0, temperature=temperature, seed=seed)
        truth = plain.token_ids
        engine = Engine(model.engine.model, model.tokenizer, 256, draft=3)
        oracle = spoiling_oracle(truth, len(ids), engine.speculator.k)
        engine.speculator.draft = oracle
        out = generate(model, ids, 24, draft=3, temperature=temperature, seed=seed, engine=engine)
        assert out.token_ids == truth
        assert out.accepted_tokens > out.draft_rounds  # mostly accepted
        assert out.accepted_tokens < out.draft_tokens  # some rejected
        assert out.mean_accepted_length > 2.0


def test_rollback_of_a_rejected_draft_in_linear_layers(model):
    """Verify [t, d1, d2, d3] with the state trail on, keep [t, d1]: the GDN states and the
    next token's output equal those of a cache that never saw d2, d3."""
    net = model.engine.model
    ids = np.array([9, 17, 33, 12, 40], np.int64)
    spec_cache, plain = net.new_cache(64), net.new_cache(64)
    for cache in (spec_cache, plain):
        cache.reserve(16)
        net.forward(ids, cache, 0)
        cache.length = 5
    spec_cache.start_trail()
    net.forward(np.array([20, 21, 22, 23]), spec_cache, 5)
    spec_cache.stop_trail()
    spec_cache.length = 9
    assert spec_cache.truncate(7) == 7
    net.forward(np.array([20, 21]), plain, 5)
    plain.length = 7
    assert set(spec_cache.linear) == {0, 2}  # both linear-attention layers were rolled back
    for i in spec_cache.linear:
        a, b = spec_cache.linear[i], plain.linear[i]
        assert np.allclose(a.recurrent, b.recurrent, atol=1e-6)
        assert np.allclose(a.conv, b.conv, atol=1e-5)  # batched matmuls round differently
    x = np.array([30])
    assert np.allclose(net.forward(x, spec_cache, 7), net.forward(x, plain, 7), atol=1e-5)


def test_prefix_reuse_with_speculation(model):
    engine = Engine(model.engine.model, model.tokenizer, 256, draft=2)
    first = random_prompts(30, 1)[0]
    reply = generate(model, first, 10, draft=2, engine=engine).token_ids
    for ids in (first + reply + [7, 8], first[:3] + [9, 10], first):
        again = generate(model, ids, 10, draft=2, engine=engine)
        assert again.token_ids == generate(model, ids, 10, draft=0).token_ids


def test_gguf_mtp_head_drafts(tmp_path):
    m = open_model(str(FIXTURES / "qwen35-gguf" / "model.gguf"), device="cpu-ref")
    assert m.engine.speculator is not None
    for ids in random_prompts(40, 3):
        assert generate(m, ids, 12, 2).token_ids == generate(m, ids, 12, 0).token_ids


def test_cli_draft_flags():
    path = str(FIXTURES / "qwen35-vlm-bf16")
    runner = CliRunner()
    base = ["run", path, "hello", "-n", "12", "--temperature", "0"]
    spec = runner.invoke(app, [*base, "--draft", "3", "--json"])
    assert spec.exit_code == 0, spec.output
    out = json.loads(spec.output)
    assert out["speculative"]["rounds"] > 0 and out["speculative"]["drafted"] > 0
    plain = runner.invoke(app, [*base, "--no-speculative", "--json"])
    assert plain.exit_code == 0, plain.output
    assert "speculative" not in json.loads(plain.output)
    assert json.loads(plain.output)["text"] == out["text"]
    verbose = runner.invoke(app, [*base, "--verbose"])
    assert verbose.exit_code == 0 and "mean accepted length" in verbose.output
    bad = runner.invoke(app, [*base, "--draft", "-1"])
    assert bad.exit_code != 0
    no_mtp = runner.invoke(app, ["run", str(FIXTURES / "qwen3-tied-bf16"), "hi", "--draft", "2"])
    assert no_mtp.exit_code == 2 and "no multi-token-prediction head" in no_mtp.output
