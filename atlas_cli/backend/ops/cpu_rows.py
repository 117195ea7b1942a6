"""The prefill's elementwise ops on numba, one task per row: RMSNorm, RoPE, SiLU-and-multiply.

numpy_ref's versions make several full-size temporaries per call (a 512-token prompt of a 0.6B
model: 0.8 s of an 8 s prefill on one core went to them); these read each input once and write
their output once, with the arithmetic of numpy_ref in float32 (sums reassociated, exp within
2 ulp: cpu_kernels.fast_exp). cpu_fast uses them for inputs of PARALLEL_ROWS rows or more.
"""

from __future__ import annotations

import math

import numpy as np

from atlas_cli.backend.ops import cpu_numba

cpu_numba.configure()

from numba import njit, prange  # noqa: E402

from atlas_cli.backend.ops.cpu_kernels import fast_exp  # noqa: E402

PARALLEL_ROWS = 8  # below this the numpy versions' call overhead is smaller than a task's


@njit(parallel=True, cache=True, fastmath=True)
def rms_norm_rows(x, w, eps, out):
    """out[r] = x[r] / rms(x[r]) * w for the rows of x (R, H) (w already (1 + w) where the
    model says so)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[r, i] * x[r, i]
        scale = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + np.float32(eps)))
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


@njit(parallel=True, cache=True, fastmath=True)
def silu_mul_rows(gate, up, out):
    """out = silu(gate) * up for (R, I) arrays."""
    n_rows, n = gate.shape
    for r in prange(n_rows):
        for i in range(n):
            g = gate[r, i]
            out[r, i] = g / (np.float32(1.0) + fast_exp(-g)) * up[r, i]


def warm_up() -> None:
    """Load (or compile) each kernel with the argument types of real calls (C-contiguous
    float32 arrays, int64 positions)."""
    x, rows = np.ones((2, 1, 4), np.float32), np.ones((2, 4), np.float32)
    rms_norm_rows(rows, np.ones(4, np.float32), 1e-6, np.empty_like(rows))
    rope_rows(x, np.arange(2, dtype=np.int64), np.ones(1, np.float32), np.empty_like(x))
    silu_mul_rows(rows, rows, np.empty_like(rows))
