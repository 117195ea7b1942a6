"""The prefill's elementwise ops on numba, one task per row: RMSNorm (plain and gated), L2 norm,
RoPE, SiLU (and times another input), Qwen3.5's causal depthwise convolution.

numpy_ref's versions make several full-size temporaries per call (a 512-token prompt of a 0.6B
model: 0.8 s of an 8 s prefill on one core went to them); these read each input once and write
their output once, with the arithmetic of numpy_ref in float32 (sums reassociated, exp within
2 ulp: cpu.kernels.fast_exp). cpu.fast offers the functions at the end of this file: these
kernels for inputs of PARALLEL_ROWS rows or more, numpy_ref's versions otherwise. Those that
divide use numpy's error model (a zero or NaN denominator gives Inf or NaN, never an exception
inside the parallel loop) and exact division (cpu.kernels.EXACT_DIVISION_FASTMATH).
"""

from __future__ import annotations

import math

import numpy as np

from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import jit

jit.configure()

from numba import njit, prange  # noqa: E402

from atlas_cli.backend.ops.cpu.kernels import EXACT_DIVISION_FASTMATH, fast_exp  # noqa: E402

PARALLEL_ROWS = 8  # below this the numpy versions' call overhead is smaller than a task's


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, inline="always", error_model="numpy")
def _inv_rms(row, eps):
    """1 / sqrt(mean(row^2) + eps), float32."""
    ss = np.float32(0.0)
    for i in range(row.shape[0]):
        ss += row[i] * row[i]
    return np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(row.shape[0]) + np.float32(eps)))


@njit(parallel=True, cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def rms_norm_rows(x, w, eps, out):
    """out[r] = x[r] / rms(x[r]) * w for the rows of x (R, H) (w already (1 + w) where the
    model says so)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        scale = _inv_rms(x[r], eps)
        for i in range(n):
            out[r, i] = x[r, i] * scale * w[i]


@njit(parallel=True, cache=True, fastmath=True)
def rope_rows(x, positions, inv_freq, out):
    """rotate_half RoPE of x (T, n, hd) at `positions` (T,) on the first 2 * len(inv_freq)
    dims of each head, the rest copied; angles float32(position) * inv_freq, as numpy_ref."""
    n_tok, n_heads, hd = x.shape
    half = inv_freq.shape[0]
    for t in prange(n_tok):
        cos = np.empty(half, np.float32)
        sin = np.empty(half, np.float32)
        for i in range(half):
            angle = np.float32(positions[t]) * inv_freq[i]
            cos[i], sin[i] = np.cos(angle), np.sin(angle)
        for h in range(n_heads):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, half + i]
                out[t, h, i] = a * cos[i] - b * sin[i]
                out[t, h, half + i] = b * cos[i] + a * sin[i]
            for i in range(2 * half, hd):
                out[t, h, i] = x[t, h, i]


@njit(parallel=True, cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def silu_mul_rows(gate, up, out):
    """out = silu(gate) * up for (R, I) arrays."""
    n_rows, n = gate.shape
    for r in prange(n_rows):
        for i in range(n):
            g = gate[r, i]
            out[r, i] = g / (np.float32(1.0) + fast_exp(-g)) * up[r, i]


@njit(parallel=True, cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def silu_rows(x, out):
    """out = silu(x) for (R, I) arrays."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        for i in range(n):
            out[r, i] = x[r, i] / (np.float32(1.0) + fast_exp(-x[r, i]))


@njit(parallel=True, cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def l2norm_rows(x, eps, out):
    """out[r] = x[r] / sqrt(sum(x[r]^2) + eps) for the rows of x (R, d)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.float32(math.sqrt(ss + np.float32(eps)))
        for i in range(n):
            out[r, i] = x[r, i] * inv


@njit(parallel=True, cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def rms_norm_gated_rows(x, gate, w, eps, out):
    """out[r] = rms_norm(x[r]) * w * silu(gate[r]) (Qwen3.5's RMSNormGated) for (R, d) rows."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        scale = _inv_rms(x[r], eps)
        for i in range(n):
            g = gate[r, i]
            out[r, i] = x[r, i] * scale * w[i] * (g / (np.float32(1.0) + fast_exp(-g)))


@njit(parallel=True, cache=True, fastmath=True)
def causal_conv_rows(full, taps, out):
    """out[t, c] = sum_j taps[j, c] * full[t + j, c]: the depthwise causal convolution of
    numpy_ref.causal_conv1d, full (K - 1 + T, C) the previous K - 1 inputs then the new ones,
    taps (K, C) (the weight transposed, so that channels are contiguous)."""
    n_tok, n_ch = out.shape
    for t in prange(n_tok):
        for c in range(n_ch):
            out[t, c] = np.float32(0.0)
        for j in range(taps.shape[0]):
            for c in range(n_ch):
                out[t, c] += taps[j, c] * full[t + j, c]


# ---- the ops as cpu.fast offers them: numpy_ref for small inputs and the other cases


def _rows_of(x: np.ndarray, n: int) -> np.ndarray | None:
    """x as a C-contiguous float32 (rows, n) view when it has PARALLEL_ROWS rows or more (the
    numba row kernels' case), else None."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.size < PARALLEL_ROWS * n:
        return None
    return x.reshape(-1, n)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, unit_offset: bool = False):
    """As numpy_ref.rms_norm."""
    rows = _rows_of(x, x.shape[-1])
    if rows is None:
        return numpy_ref.rms_norm(x, weight, eps, unit_offset)
    w = (weight + 1.0 if unit_offset else weight).astype(np.float32, copy=False)
    out = np.empty(x.shape, np.float32)
    rms_norm_rows(rows, w, float(eps), out.reshape(rows.shape))
    return out


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """As numpy_ref.rope."""
    if _rows_of(x, x.shape[-1]) is None or x.ndim != 3:
        return numpy_ref.rope(x, positions, inv_freq)
    out = np.empty(x.shape, np.float32)
    pos = np.asarray(positions, dtype=np.int64)
    rope_rows(x, pos, inv_freq.astype(np.float32, copy=False), out)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """As numpy_ref.silu_mul."""
    n = gate.shape[-1]
    g, u = _rows_of(gate, n), _rows_of(up, n)
    if g is None or u is None or gate.shape != up.shape:
        return numpy_ref.silu_mul(gate, up)
    out = np.empty(gate.shape, np.float32)
    silu_mul_rows(g, u, out.reshape(g.shape))
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """As numpy_ref.silu."""
    rows = _rows_of(x, x.shape[-1])
    if rows is None:
        return numpy_ref.silu(x)
    out = np.empty(x.shape, np.float32)
    silu_rows(rows, out.reshape(rows.shape))
    return out


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """As numpy_ref.l2norm."""
    x = np.ascontiguousarray(x)  # q and k arrive as column slices of the convolution's output
    rows = _rows_of(x, x.shape[-1])
    if rows is None:
        return numpy_ref.l2norm(x, eps)
    out = np.empty(x.shape, np.float32)
    l2norm_rows(rows, float(eps), out.reshape(rows.shape))
    return out


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float):
    """As numpy_ref.rms_norm_gated."""
    n = x.shape[-1]
    rows, gates = _rows_of(x, n), _rows_of(gate, n)
    if rows is None or gates is None or x.shape != gate.shape:
        return numpy_ref.rms_norm_gated(x, gate, weight, eps)
    out = np.empty(x.shape, np.float32)
    w = weight.astype(np.float32, copy=False)
    rms_norm_gated_rows(rows, gates, w, float(eps), out.reshape(rows.shape))
    return out


def causal_conv1d(x, weight, state, all_states=False, act=False):
    """As numpy_ref.causal_conv1d (the prefill's case on numba: no per-token states)."""
    if all_states or act or _rows_of(x, x.shape[-1]) is None or x.ndim != 2:
        return numpy_ref.causal_conv1d(x, weight, state, all_states, act)
    k = weight.shape[1]
    full = np.concatenate([state.astype(np.float32, copy=False), x], axis=0)  # (K-1+T, C)
    out = np.empty(x.shape, np.float32)
    taps = np.ascontiguousarray(weight.T, dtype=np.float32)
    causal_conv_rows(full, taps, out)
    return out, np.ascontiguousarray(full[full.shape[0] - (k - 1) :])


def warm_up() -> None:
    """Load (or compile) each kernel with the argument types of real calls (C-contiguous
    float32 arrays, int64 positions)."""
    x, rows = np.ones((2, 1, 4), np.float32), np.ones((2, 4), np.float32)
    w = np.ones(4, np.float32)
    rms_norm_rows(rows, w, 1e-6, np.empty_like(rows))
    rms_norm_gated_rows(rows, rows, w, 1e-6, np.empty_like(rows))
    l2norm_rows(rows, 1e-6, np.empty_like(rows))
    rope_rows(x, np.arange(2, dtype=np.int64), np.ones(1, np.float32), np.empty_like(x))
    silu_rows(rows, np.empty_like(rows))
    silu_mul_rows(rows, rows, np.empty_like(rows))
    causal_conv_rows(np.ones((3, 4), np.float32), rows, np.empty_like(rows))
