"""Prefix reuse across turns must not change what the model says (real default model, greedy)."""

import numpy as np
from threadpoolctl import threadpool_limits

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.backend.sample import SamplingOverrides


def _generate(model, ids, n):
    stats = GenerationStats()
    for _ in model.generate(
        ids, max_tokens=n, stats=stats, sampling=SamplingOverrides(temperature=0, seed=42)
    ):
        pass
    return stats


def test_prefix_reuse_gives_the_same_tokens_as_a_full_prefill(smollm2):
    with threadpool_limits(limits=1):  # one BLAS thread: far faster on a shared 2-core machine
        _check_prefix_reuse(smollm2)


def _check_prefix_reuse(smollm2):
    engine = smollm2.engine
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    first, second = smollm2.chat_prompt(turn1), smollm2.chat_prompt(turn2)
    assert second[: len(first) - 3] == first[: len(first) - 3]  # turns share a prefix
    try:
        engine.reset()
        _generate(smollm2, first, 4)
        warm = _generate(smollm2, second, 6)
        warm_logits, warm_reused = engine.prefill(second)  # fully cached now: one token runs
        engine.reset()
        cold = _generate(smollm2, second, 6)
        engine.reset()
        cold_logits, cold_reused = engine.prefill(second)
    finally:
        engine.reset()
    assert warm.cached_tokens >= len(first) - 3 and cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids and len(warm.token_ids) > 0
    assert (warm_reused, cold_reused) == (len(second) - 1, 0)
    np.testing.assert_allclose(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)
