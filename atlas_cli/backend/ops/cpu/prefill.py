"""Prefill products of the fast CPU path on int16 for the K-quants (Q4_K, Q5_K, Q6_K).

A K-quant element is `d * sc_j * q - dmin * m_j` (Q6_K: `d * sc_j * (q - 32)`), so its row is
exactly the int16 integers `sc_j * q` plus two float planes: `d` per 256-column super-block and
`-dmin * m_j` per 32 columns. x is rounded per token and super-block to int16 (scale max|x| /
X16_MAX: within 1/32766 of the block's largest value, finer than the decode path's two int8
planes). A product is then the int16 tile of cpu/ir_int16.py per super-block, plus the offset
plane times x's float 32-group sums (a product 1/32 the size, on the float tiles). Against the
float32 tiles of `cpu.kernels.gemm` this reads half the bytes per multiply-add and does twice
as many per instruction (docs/performance.md).
"""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu.ir import GROUP, Q4_K, Q5_K, Q6_K
from atlas_cli.backend.ops.cpu.ir_int16 import (
    SUPER,
    TILE_ROWS,
    TILE_TOKENS,
    X16_MAX,
    row_int16_q4_k,
    row_int16_q5_k,
    row_int16_q6_k,
    tile_dots16,
)

jit.configure()

from numba import njit, prange  # noqa: E402

from atlas_cli.backend.ops.cpu.kernels import abs_max, group_sums, tile_dots  # noqa: E402

INT16_TYPES = (Q4_K, Q5_K, Q6_K)
ROWS_PER_TASK = 16  # a multiple of TILE_ROWS: 16 rows of 1,024 int16 columns are 32 KB (L1)


@njit(parallel=True, cache=True, fastmath=False)
def quantize_x16(x, xq, xd):
    """xq (Tp, K) int16 = rint(x / s) per token and 256 columns, s = max|x| / X16_MAX, into
    xd (Tp, K / 256); tokens past x's (the tile's padding) stay as they are (zeros)."""
    n_tok, cols = x.shape
    for t in prange(n_tok):
        for s in range(cols // SUPER):
            d = abs_max(x[t], SUPER * s, SUPER * s + SUPER) / np.float32(X16_MAX)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            for k in range(SUPER * s, SUPER * s + SUPER):
                xq[t, k] = np.int16(np.rint(x[t, k] * inv))
            xd[t, s] = d


@njit(cache=True, inline="always")
def _row_int16(t, w, woff, nb, wi, wd, wm):
    if t == Q4_K:
        row_int16_q4_k(w, woff, nb, wi, wd, wm)
    elif t == Q5_K:
        row_int16_q5_k(w, woff, nb, wi, wd, wm)
    else:
        row_int16_q6_k(w, woff, nb, wi, wd, wm)


@njit(parallel=True, cache=True, fastmath=True)
def gemm_int16(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for a K-quant W (INT16_TYPES): each task turns
    ROWS_PER_TASK rows into int16 once and multiplies them with every token."""
    n_tok, cols = x.shape
    rows = perm.shape[0]
    nsb, ng = cols // SUPER, cols // GROUP
    padded = (n_tok + TILE_TOKENS - 1) // TILE_TOKENS * TILE_TOKENS
    xq = np.zeros((padded, cols), np.int16)
    xd = np.zeros((padded, nsb), np.float32)
    quantize_x16(x, xq, xd)
    xs = np.empty((n_tok, ng), np.float32)  # float sums of x per 32 columns: the offsets' side
    for i in range(n_tok):
        group_sums(x[i], xs[i])
    xqf, xdf = xq.reshape(-1), xd.reshape(-1)
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        r0 = task * ROWS_PER_TASK
        n = min(ROWS_PER_TASK, rows - r0)
        wi = np.zeros((ROWS_PER_TASK, cols), np.int16)  # rows past n stay zero
        wd = np.zeros((ROWS_PER_TASK, nsb), np.float32)
        wm = np.zeros((ROWS_PER_TASK, ng), np.float32)
        for j in range(n):
            _row_int16(t, w, off + perm[r0 + j] * rowbytes, nb, wi[j], wd[j], wm[j])
        if t == Q6_K:
            out[:, r0 : r0 + n] = 0.0
        else:
            tile_dots(xs, wm, n, out, r0)
        wif, wdf = wi.reshape(-1), wd.reshape(-1)
        for t0 in range(0, padded, TILE_TOKENS):
            for j0 in range(0, n, TILE_ROWS):
                v = tile_dots16(wif, j0 * cols, xqf, t0 * cols, cols, wdf, j0 * nsb, xdf, t0 * nsb)
                for i in range(TILE_TOKENS):
                    for r in range(TILE_ROWS):
                        if t0 + i < n_tok and j0 + r < n:
                            out[t0 + i, r0 + j0 + r] += v[TILE_ROWS * i + r]
