"""The decode products of the fast CPU path on int8 activations: GGUF weight rows times an x
rounded by cpu.kernels.quantize_x, with the integer dots of cpu/ir_int8.py (one row) and
cpu/ir_int8_rows.py (ROWS rows in one loop, streaming the weights ahead into L2).
"""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu.ir import (
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
)
from atlas_cli.backend.ops.cpu.ir_int8 import (
    INT8_TYPES,
    XF,
    idot_iq4_nl,
    idot_iq4_xs,
    idot_q2_k,
    idot_q3_k,
    idot_q4_0,
    idot_q4_1,
    idot_q4_k,
    idot_q5_0,
    idot_q5_1,
    idot_q5_k,
    idot_q6_k,
    idot_q8_0,
)
from atlas_cli.backend.ops.cpu.ir_int8_rows import (
    ROWS,
    rdot_iq4_nl,
    rdot_iq4_xs,
    rdot_q2_k,
    rdot_q3_k,
    rdot_q4_0,
    rdot_q4_1,
    rdot_q4_k,
    rdot_q5_0,
    rdot_q5_1,
    rdot_q5_k,
    rdot_q6_k,
    rdot_q8_0,
)
from atlas_cli.backend.ops.cpu.kernels import GROUP, prefetch_row, quantize_x

jit.configure()

from numba import njit, prange  # noqa: E402


@njit(cache=True, inline="always")
def row_dot_int8(t, w, woff, xq, xqoff, xf, xfoff, nb):
    """row_dot on the int8-quantized x (quantize_x); only for the types in INT8_TYPES.
    Inlined where it is called: the decode kernels' row loops then branch on the type instead
    of calling a dispatcher per row, 13% of a 1,024-column Q4_K matrix (docs/performance.md)."""
    if t == Q4_K:
        return idot_q4_k(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q6_K:
        return idot_q6_k(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q8_0:
        return idot_q8_0(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q5_K:
        return idot_q5_k(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q4_1:
        return idot_q4_1(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q5_0:
        return idot_q5_0(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q5_1:
        return idot_q5_1(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q3_K:
        return idot_q3_k(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == IQ4_NL:
        return idot_iq4_nl(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == IQ4_XS:
        return idot_iq4_xs(w, woff, xq, xqoff, xf, xfoff, nb)
    if t == Q2_K:
        return idot_q2_k(w, woff, xq, xqoff, xf, xfoff, nb)
    return idot_q4_0(w, woff, xq, xqoff, xf, xfoff, nb)


@njit(cache=True, inline="always")
def rows_dot_int8(t, w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff):
    """row_dot_int8 of the ROWS stored rows at bytes o0 .. o3 into out[ooff:], asking for the
    weight bytes ahead of them up to byte `end` (ir_int8.rows_dot_int8)."""
    if t == Q4_K:
        rdot_q4_k(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q6_K:
        rdot_q6_k(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q8_0:
        rdot_q8_0(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q5_K:
        rdot_q5_k(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q4_1:
        rdot_q4_1(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q5_0:
        rdot_q5_0(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q5_1:
        rdot_q5_1(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q3_K:
        rdot_q3_k(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == IQ4_NL:
        rdot_iq4_nl(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == IQ4_XS:
        rdot_iq4_xs(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    elif t == Q2_K:
        rdot_q2_k(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)
    else:
        rdot_q4_0(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nb, end, out, ooff)


@njit(cache=True, inline="always")
def int8_rows(t, w, off, rowbytes, nb, perm, r0, r1, xq, xqoff, xf, xfoff, out, ooff):
    """out[ooff + r - r0] = the int8 dot of logical row r (stored row perm[r]) for r0 <= r <
    r1: ROWS rows at a time (rows_dot_int8), the rest one by one."""
    r, end = r0, off + perm.shape[0] * rowbytes  # asked for up to the matrix's end
    while r + ROWS <= r1:
        rows_dot_int8(t, w, off + perm[r] * rowbytes, off + perm[r + 1] * rowbytes,
                      off + perm[r + 2] * rowbytes, off + perm[r + 3] * rowbytes, xq, xqoff, xf,
                      xfoff, nb, end, out, ooff + r - r0)  # fmt: skip
        r += ROWS
    while r < r1:
        prefetch_row(w, off, rowbytes, perm, r, r1)
        out[ooff + r - r0] = row_dot_int8(t, w, off + perm[r] * rowbytes, xq, xqoff, xf, xfoff, nb)
        r += 1


@njit(cache=True, inline="always")
def has_int8_dot(t):
    return t in INT8_TYPES


CHUNK = 16  # rows per parallel iteration of gemv_batch_int8: a multiple of ROWS, few KB


@njit(parallel=True, cache=True, fastmath=True)
def gemv_batch_int8(t, w, off, rowbytes, nb, perm, x, out):
    """gemv_batch with x rounded to int8 per 32-group and integer dot products (INT8_TYPES)."""
    n_tok, cols = x.shape
    rows = perm.shape[0]
    ng = cols // GROUP
    xq = np.empty(n_tok * 2 * cols, np.int8)  # per token: its two planes
    xf = np.empty(n_tok * ng * XF, np.float32)
    for i in range(n_tok):
        quantize_x(x[i], xq[i * 2 * cols : (i + 1) * 2 * cols], xf[i * ng * XF : (i + 1) * ng * XF])
    flat = out.reshape(-1)
    for c in prange((rows + CHUNK - 1) // CHUNK):
        r0, r1 = c * CHUNK, min(rows, (c + 1) * CHUNK)
        for i in range(n_tok):  # the chunk's rows are in the cache for the tokens after the first
            int8_rows(t, w, off, rowbytes, nb, perm, r0, r1, xq, i * 2 * cols, xf, i * ng * XF,
                      flat, i * rows + r0)  # fmt: skip
