"""The fast CPU path's chunked Gated DeltaNet prefill (cpu_gdn.py) against numpy_ref's
token-by-token rule: outputs and final state within 1e-5, on the reference tests' inputs and
at the Qwen3.5 head size, with decays strong enough to go subnormal."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.cpu import gdn as cpu_gdn
from tests.test_gated_deltanet import random_inputs


@pytest.mark.parametrize("t", [1, 2, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize(("nk", "nv"), [(2, 4), (3, 3)])
def test_chunked_equals_recurrent(t, chunk, nk, nv):
    args = random_inputs(np.random.default_rng(1000 * t + chunk + nv), t, nk=nk, nv=nv)
    out_r, state_r = ref.gated_delta_rule(*args)
    out_c, state_c = cpu_gdn.gated_delta_rule_chunked(*args, chunk=chunk)
    assert out_c.shape == out_r.shape and state_c.shape == state_r.shape
    assert np.abs(out_c - out_r).max() < 1e-5
    assert np.abs(state_c - state_r).max() < 1e-5
    assert np.abs(out_r).max() > 0.1


@pytest.mark.parametrize("decay_scale", [0.01, 1.0, 30.0])
def test_qwen35_head_size_and_strong_decays(decay_scale):
    """dk = dv = 128, 16 value heads on 8 key heads; with the larger scales the chunk's
    cumulative decays reach exp(-100) and beyond (the subnormal range of float32)."""
    q, k, v, g, beta, state = random_inputs(
        np.random.default_rng(5), 150, nk=8, nv=16, dk=128, dv=128
    )
    g = (g * decay_scale).astype(np.float32)
    assert decay_scale < 1 or g.sum(axis=0).min() < -100
    out_r, state_r = ref.gated_delta_rule(q, k, v, g, beta, state)
    out_c, state_c = cpu_gdn.gated_delta_rule_chunked(q, k, v, g, beta, state)
    assert np.abs(out_c - out_r).max() < 1e-5
    assert np.abs(state_c - state_r).max() < 1e-5


def test_the_thread_keeps_its_subnormals():
    """The kernel flushes subnormals inside its tasks and restores the thread's mode after."""
    cpu_gdn.gated_delta_rule_chunked(*random_inputs(np.random.default_rng(2), 20))
    tiny = np.float32(1e-38) / np.float32(1000.0)  # subnormal unless flushed
    assert 0 < tiny < np.finfo(np.float32).tiny
