"""The prefill's elementwise ops on numba (cpu_rows.py, through cpu_fast) against numpy_ref:
within float32 rounding on the shapes a prefill has (q/k heads, partial rotary, (1 + w)
norms), and small inputs left to numpy_ref."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu import rows as cpu_rows


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("shape", [(300, 1024), (40, 16, 128), (9, 3, 64)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_the_reference(shape, unit_offset):
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = cpu_fast.rms_norm(x, w, 1e-6, unit_offset)
    assert got.shape == x.shape and got.dtype == np.float32
    assert rel(got, numpy_ref.rms_norm(x, w, 1e-6, unit_offset)) < 1e-6


@pytest.mark.parametrize("rotary", [64, 16])  # whole heads of 64; a partial rotary factor
def test_rope_matches_the_reference(rotary):
    rng = np.random.default_rng(rotary)
    x = rng.standard_normal((33, 4, 64)).astype(np.float32)
    inv = (1.0 / 1e6 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    positions = np.arange(5000, 5033)
    got = cpu_fast.rope(x, positions, inv)
    assert rel(got, numpy_ref.rope(x, positions, inv)) < 1e-6
    assert np.array_equal(got[..., rotary:], x[..., rotary:])  # the rest of each head copied


def test_silu_mul_matches_the_reference():
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal((64, 3072)) * 6).astype(np.float32)
    gate[0, :4] = [-100.0, 100.0, 0.0, -88.5]  # exp's clamp at both ends
    up = rng.standard_normal((64, 3072)).astype(np.float32)
    with np.errstate(over="ignore"):  # numpy's exp(100) is inf, and silu(-100) -0.0
        want = numpy_ref.silu_mul(gate, up)
    assert rel(cpu_fast.silu_mul(gate, up), want) < 1e-6


def test_small_inputs_stay_on_numpy(monkeypatch):
    """A decode-sized input (one row) costs less in numpy than a parallel task: the row kernels
    are not called for it."""

    def boom(*args):
        raise AssertionError("row kernel called")

    monkeypatch.setattr(cpu_rows, "rms_norm_rows", boom)
    monkeypatch.setattr(cpu_rows, "silu_mul_rows", boom)
    x = np.ones((1, 64), np.float32)
    cpu_fast.rms_norm(x, np.ones(64, np.float32), 1e-6)
    cpu_fast.silu_mul(x, x)
    with pytest.raises(AssertionError, match="row kernel"):
        cpu_fast.rms_norm(np.ones((cpu_rows.PARALLEL_ROWS, 64), np.float32), x[0], 1e-6)


def test_qwen35_ops_match_the_reference():
    """silu, l2norm and the gated norm on a Gated DeltaNet layer's shapes (T, heads, 128)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 16, 128)) * 3).astype(np.float32)
    gate = (rng.standard_normal((40, 16, 128)) * 3).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    assert rel(cpu_fast.silu(x), numpy_ref.silu(x)) < 1e-6
    assert rel(cpu_fast.l2norm(x), numpy_ref.l2norm(x)) < 1e-6
    q = x.reshape(40, -1)[:, :1024].reshape(40, 8, 128)  # q as a slice of the conv output
    assert rel(cpu_fast.l2norm(q), numpy_ref.l2norm(q)) < 1e-6
    want = numpy_ref.rms_norm_gated(x, gate, w, 1e-6)
    assert rel(cpu_fast.rms_norm_gated(x, gate, w, 1e-6), want) < 1e-6


@pytest.mark.parametrize("n_tok", [9, 200])
def test_causal_conv1d_matches_the_reference(n_tok):
    """Out and the new state (the last K - 1 inputs), after a state that is not zeros."""
    rng = np.random.default_rng(n_tok)
    x = rng.standard_normal((n_tok, 96)).astype(np.float32)
    weight = rng.standard_normal((96, 4)).astype(np.float32)
    state = rng.standard_normal((3, 96)).astype(np.float32)
    got, got_state = cpu_fast.causal_conv1d(x, weight, state)
    want, want_state = numpy_ref.causal_conv1d(x, weight, state)
    assert rel(got, want) < 1e-6
    assert np.array_equal(got_state, want_state)
