"""Samplers: each filter against a direct computation, seeds, greedy, and bad values."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.sample import (
    Sampler,
    SamplingParams,
    apply_repeat_penalty,
    filtered_distribution,
)
from atlas_cli.errors import UsageError

LOGITS = np.array([2.0, 1.0, 0.5, 3.0, -1.0, 0.0], dtype=np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS) == 3


def test_top_k_keeps_the_k_best():
    ids, probs = filtered_distribution(LOGITS, top_k=2, top_p=1.0, min_p=0.0, temperature=1.0)
    assert ids.tolist() == [3, 0]
    np.testing.assert_allclose(probs, softmax(LOGITS[[3, 0]]), rtol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = softmax(LOGITS.astype(np.float64))
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    expect = order[: int(np.searchsorted(cum, 0.8) + 1)]
    ids, _ = filtered_distribution(LOGITS, top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)
    assert ids.tolist() == expect.tolist()


def test_min_p_drops_unlikely_tokens():
    p = softmax(LOGITS.astype(np.float64))
    ids, _ = filtered_distribution(LOGITS, top_k=0, top_p=1.0, min_p=0.2, temperature=1.0)
    assert set(ids.tolist()) == set(np.nonzero(p >= 0.2 * p.max())[0].tolist())


def test_temperature_sharpens():
    _, hot = filtered_distribution(LOGITS, 0, 1.0, 0.0, temperature=2.0)
    _, cold = filtered_distribution(LOGITS, 0, 1.0, 0.0, temperature=0.5)
    assert cold[0] > hot[0]
    np.testing.assert_allclose(cold, softmax(np.sort(LOGITS)[::-1] / 0.5), rtol=1e-5)


def test_repeat_penalty():
    out = apply_repeat_penalty(LOGITS, [0, 4, 0], penalty=2.0)
    assert out[0] == 1.0 and out[4] == -2.0 and out[3] == 3.0


def test_same_seed_same_draws_and_distribution():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    s1, s2 = Sampler(params), Sampler(params)
    draws1 = [s1(LOGITS) for _ in range(200)]
    draws2 = [s2(LOGITS) for _ in range(200)]
    assert draws1 == draws2
    assert len(set(draws1)) > 1
    assert np.bincount(draws1, minlength=6).argmax() == 3  # the likeliest token is drawn most


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_k": -3},
        {"top_p": 0},
        {"top_p": 1.5},
        {"min_p": 1.0},
        {"repeat_penalty": 0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"repeat_penalty": float("inf")},
        {"presence_penalty": float("nan")},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
    ],
)
def test_bad_values_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        SamplingParams(**kwargs)


def test_presence_penalty_subtracts_once_per_seen_token():
    from atlas_cli.backend.sample import apply_presence_penalty

    out = apply_presence_penalty(LOGITS, [3, 3, 3, 0], 0.5)
    expect = LOGITS.copy()
    expect[[3, 0]] -= 0.5  # once each, however often seen
    np.testing.assert_array_equal(out, expect)


def test_presence_penalty_changes_the_greedy_choice():
    # token 3 leads token 0 by 1.0; a presence penalty above that hands the lead to token 0
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=1.5))
    assert sampler(LOGITS, history=[3]) == 0
    assert Sampler(SamplingParams(temperature=0))(LOGITS, history=[3]) == 3


def test_presence_penalty_range():
    with pytest.raises(UsageError, match="presence penalty"):
        SamplingParams(presence_penalty=3.0)


def test_overrides_take_the_layer_below_for_what_they_leave_unset():
    from atlas_cli.backend.sample import SamplingOverrides

    recipe = SamplingOverrides(temperature=0.6, top_k=20, min_p=0.0)
    user = SamplingOverrides(temperature=0.0, seed=7)
    params = user.over(recipe).params()
    assert (params.temperature, params.top_k, params.min_p, params.seed) == (0.0, 20, 0.0, 7)
    assert params.top_p == SamplingParams().top_p  # set by nobody: atlas's default
    assert SamplingOverrides().params() == SamplingParams()


def test_overrides_from_a_mapping_ignore_other_keys():
    from atlas_cli.backend.sample import SamplingOverrides

    got = SamplingOverrides.from_mapping({"temperature": 0.2, "ctx_size": 9, "top_p": 0.9})
    assert got == SamplingOverrides(temperature=0.2, top_p=0.9)


@pytest.mark.parametrize("penalty", [1e-308, 1e-45, 1e30, 1e308])
@pytest.mark.parametrize("temperature", [0.0, 1e-308, 0.8, 1e308])
def test_extreme_parameters_still_draw_a_token(penalty, temperature):
    """A penalty can push logits past float32's range (1e-308 divides them into inf): the
    sampler clips them and draws a valid token instead of taking inf - inf."""
    logits = np.array([30.0, -30.0, 1e-3, 3e38, -3e38, 0.0], dtype=np.float32)
    params = SamplingParams(repeat_penalty=penalty, temperature=temperature, min_p=0.5, seed=3)
    sampler = Sampler(params)
    for _ in range(5):
        token = sampler(logits, history=[0, 1, 2, 3, 4, 5])
        assert 0 <= token < len(logits)
    penalized = apply_repeat_penalty(logits, [0, 3], penalty)
    assert np.isfinite(penalized).all()
