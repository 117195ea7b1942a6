"""The Gated DeltaNet reference ops: chunked prefill form against the recurrent one, the causal
conv's rolling state, and the small ops they use, on random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ops


def random_inputs(rng, t, nk=2, nv=4, dk=8, dv=16):
    q = ops.l2norm(rng.standard_normal((t, nk, dk)).astype(np.float32))
    k = ops.l2norm(rng.standard_normal((t, nk, dk)).astype(np.float32))
    v = rng.standard_normal((t, nv, dv)).astype(np.float32)
    # log-decays as the model makes them: -exp(A_log) * softplus(a + dt_bias)
    g = -np.exp(rng.uniform(0, 2, nv)).astype(np.float32) * ops.softplus(
        rng.standard_normal((t, nv)).astype(np.float32)
    )
    beta = ops.sigmoid(rng.standard_normal((t, nv)).astype(np.float32))
    state = 0.3 * rng.standard_normal((nv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 63, 64, 65, 100, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize(("nk", "nv"), [(2, 4), (3, 3)])
def test_chunked_equals_recurrent(t, chunk, nk, nv):
    rng = np.random.default_rng(1000 * t + chunk + nv)
    q, k, v, g, beta, state = random_inputs(rng, t, nk=nk, nv=nv)
    out_r, state_r = ops.gated_delta_rule(q, k, v, g, beta, state)
    out_c, state_c = ops.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    assert out_c.shape == out_r.shape == (t, nv, 16)
    assert state_c.shape == state_r.shape == (nv, 8, 16)
    assert np.abs(out_c - out_r).max() < 1e-5
    assert np.abs(state_c - state_r).max() < 1e-5
    assert np.abs(out_r).max() > 0.1  # not trivially zero


def test_recurrent_matches_the_delta_rule_written_out():
    """One head, float64, the update exactly as formats.md 3.2 (Gated DeltaNet step 7) states it."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta, state = random_inputs(rng, 9, nk=1, nv=1, dk=4, dv=3)
    out, final = ops.gated_delta_rule(q, k, v, g, beta, state)
    s = state[0].astype(np.float64)
    qs = q[:, 0].astype(np.float64) / 2.0  # dk^-0.5 with dk = 4
    for t in range(9):
        s = s * np.exp(g[t, 0])
        delta = (v[t, 0] - k[t, 0] @ s) * beta[t, 0]
        s = s + np.outer(k[t, 0], delta)
        assert np.allclose(out[t, 0], qs[t] @ s, atol=1e-6)
    assert np.allclose(final[0], s, atol=1e-6)


def test_value_heads_use_their_key_group():
    """With nv = 2 nk, value heads 0 and 1 read key head 0 (repeat_interleave grouping)."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta, state = random_inputs(rng, 5, nk=2, nv=4)
    out, _ = ops.gated_delta_rule(q, k, v, g, beta, state)
    single, _ = ops.gated_delta_rule(
        q[:, :1], k[:, :1], v[:, 1:2], g[:, 1:2], beta[:, 1:2], state[1:2]
    )
    assert np.allclose(out[:, 1], single[:, 0], atol=1e-7)


@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_causal_conv1d_state_carries_over(kernel):
    rng = np.random.default_rng(kernel)
    x = rng.standard_normal((11, 6)).astype(np.float32)
    w = rng.standard_normal((6, kernel)).astype(np.float32)
    zero = np.zeros((kernel - 1, 6), np.float32)
    full, state = ops.causal_conv1d(x, w, zero)
    # written out: out[t] = sum_j w[:, j] * x[t - (K-1) + j], zero before the start
    padded = np.concatenate([zero, x])
    expected = sum(w[:, j] * padded[j : j + 11] for j in range(kernel))
    assert np.allclose(full, expected, atol=1e-6)
    assert np.array_equal(state, x[-(kernel - 1) :])
    # in pieces, the state carries the window
    first, s = ops.causal_conv1d(x[:4], w, zero)
    rest = []
    for t in range(4, 11):
        y, s = ops.causal_conv1d(x[t : t + 1], w, s)
        rest.append(y)
    assert np.allclose(np.concatenate([first, *rest]), full, atol=1e-6)


def test_small_ops():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    assert np.allclose(ops.l2norm(x), [[0.6, 0.8], [0.0, 0.0]], atol=1e-6)
    assert np.allclose(ops.sigmoid(np.array([0.0, 100.0, -100.0])), [0.5, 1.0, 0.0])
    assert np.allclose(ops.softplus(np.array([0.0, 50.0, -50.0])), [np.log(2), 50.0, 0.0])
    z = np.array([[1.0, -2.0]], np.float32)
    w = np.array([2.0, 0.5], np.float32)
    rms = np.sqrt(np.mean(z**2) + 1e-6)
    silu = z / (1 + np.exp(-z))
    assert np.allclose(ops.rms_norm_gated(z, z, w, 1e-6), z / rms * w * silu, atol=1e-6)
    # the (1 + w) form of rms_norm used by Qwen3.5
    assert np.allclose(ops.rms_norm(z, w, 1e-6, unit_offset=True), z / rms * (1 + w), atol=1e-6)
