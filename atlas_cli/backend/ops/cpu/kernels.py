"""Numba kernels of the fast CPU path: products straight on GGUF blocks, and attention.

Weights stay in their GGUF blocks; a row's blocks are decoded by the LLVM IR of cpu/ir.py,
dispatched here on the format. Decode products by default round x to two int8 planes
(`quantize_x`) and use the integer dots of cpu/ir_int8.py (cpu/gemv_int8.py);
`gemv_batch` and prefill keep x in float32. Every @njit function is cached on disk
(`cache=True`), stamped with all the kernel files (jit.py). The exact ones (the
dequantizers, `quantize_x`) say `fastmath=False`: numba compiles a callee with the fast-math of
the caller that first needs it unless the callee sets it, and caches that version (quantize_x
first compiled for gemv_batch_int8 divided by 127 as a multiply by 1/127, one ulp off numpy).
Shapes: H hidden size, I MLP size, S cached positions.

Non-finite values never raise: a kernel whose denominator comes from the data (a softmax's
sum, a norm's mean square) divides with numpy's error model, and NaN or Inf activations reach
the logits as NaN, which the engine reports as a damaged model (`softmax_row`, `abs_max`).
"""

from __future__ import annotations

import math

import numpy as np

from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu.ir import (  # noqa: F401  (BLOCKS, F16, ...: this path's facts)
    BF16,
    BLOCKS,
    F16,
    F32,
    GROUP,
    IQ4_NL,
    IQ4_XS,
    PREFETCH_BYTES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    deq_bf16,
    deq_f16,
    deq_f32,
    deq_iq4_nl,
    deq_iq4_xs,
    deq_q2_k,
    deq_q3_k,
    deq_q4_0,
    deq_q4_1,
    deq_q4_k,
    deq_q5_0,
    deq_q5_1,
    deq_q5_k,
    deq_q6_k,
    deq_q8_0,
    dot_bf16,
    dot_f16,
    dot_f32,
    dot_iq4_nl,
    dot_iq4_xs,
    dot_q2_k,
    dot_q3_k,
    dot_q4_0,
    dot_q4_1,
    dot_q4_k,
    dot_q5_0,
    dot_q5_1,
    dot_q5_k,
    dot_q6_k,
    dot_q8_0,
    f32_from_bits,
    narrow_half,
    prefetch,
    widen_half,
)
from atlas_cli.backend.ops.cpu.ir_int8 import INT8_TYPES, XF  # noqa: F401  (this path's facts)

jit.configure()

from numba import njit, prange, types  # noqa: E402
from numba.extending import overload  # noqa: E402

from atlas_cli.backend.ops.cpu.ir_attention import QK_KEYS, QK_QUERIES, tile_qk  # noqa: E402


@njit(cache=True, fastmath=True, inline="always")
def fast_exp(x):
    """exp(x) in float32 within 2 ulp (Cephes expf: exp(x) = 2^n * exp(r), |r| <= ln2/2),
    with x clamped to [-87.3, 88]. Unlike libm's expf it is branch-free and inlined, so loops
    over it vectorise; softmax and SiLU spend much of their time here."""
    x = min(max(x, np.float32(-87.33654)), np.float32(88.0))  # 2^n stays a normal float
    n = np.floor(x * np.float32(1.442695041) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


# fast-math but for nnan and ninf: under those LLVM may assume no value is NaN or Inf, and it
# folds away the very checks that find them (a NaN score then divided by a zero sum, raising
# ZeroDivisionError inside a parallel kernel). Vectorisation does not need them.
NAN_AWARE_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# fast-math but for arcp and afn, for the loops that divide with numpy's error model: without
# the python model's zero check they vectorise, and with approximate reciprocals a vector
# lane's quotient is not the scalar remainder's, so an activation would depend on where a
# worker's chunk of rows starts (the fused decode step must not depend on the thread count).
EXACT_DIVISION_FASTMATH = {"nnan", "ninf", "nsz", "contract", "reassoc"}


@njit(cache=True, fastmath=NAN_AWARE_FASTMATH, error_model="numpy")
def softmax_row(row, n):
    """row[:n] = softmax(row[:n]) in place (n >= 1), or NaN throughout when a score is NaN or
    Inf (broken weights): the engine reports NaN logits as a damaged model. The maximum is kept
    per lane of 16 (one vmaxps per 16 scores: a running max(best, x) stays scalar, 5x slower at
    2,048 scores) and is exact in any order. `spread`, the sum of score - max, is NaN or Inf
    when a score is; otherwise the exps sum to at least 1 (the max's own term), so the division
    is safe."""
    lanes = np.full(16, -np.inf, np.float32)
    n16 = n // 16 * 16
    for s in range(0, n16, 16):
        for k in range(16):
            v = row[s + k]
            lanes[k] = v if v > lanes[k] else lanes[k]
    best = np.float32(-np.inf)
    for k in range(16):
        best = lanes[k] if lanes[k] > best else best
    for s in range(n16, n):
        best = row[s] if row[s] > best else best
    total = np.float32(0.0)
    spread = np.float32(0.0)
    for s in range(n):
        d = row[s] - best
        spread += d
        e = fast_exp(d)
        row[s] = e
        total += e
    if not -np.inf < spread < np.inf:
        row[:n] = np.nan
        return
    inv = np.float32(1.0) / total
    for s in range(n):
        row[s] *= inv


# ---------------------------------------------------------------------------------------------
# The KV cache's element types: float32, or float16 held as its bits (uint16: numba has no
# float16). The kernels reach a cache only through these two, compiled for each type.

KV_TILE = 64  # keys or values widened to float32 at a time: 32 KB at hd 128, in L1/L2


def kv_bits(a: np.ndarray) -> np.ndarray:
    """A KV array as the kernels take it: float16 as its bits (uint16, a view), else float32
    (the array itself when it is float32 already, so writes land in the cache)."""
    return a.view(np.uint16) if a.dtype == np.float16 else np.asarray(a, np.float32)


def kv_rows(slab, s0, n, scratch):
    """The float32 rows s0 .. s0+n-1 of a KV slab (S, hd): a view of a float32 slab, or the
    rows of a float16 one widened into scratch (>= n, hd)."""
    raise NotImplementedError("numba only")


def kv_store(row, x):
    """row (hd,) of a KV slab = x (float32 (hd,)), rounded to nearest even for float16."""
    raise NotImplementedError("numba only")


@overload(kv_rows)
def _kv_rows(slab, s0, n, scratch):
    if slab.dtype == types.uint16:
        if slab.layout == "C" and scratch.layout == "C":  # the rows are one run: one call

            def widen_run(slab, s0, n, scratch):
                hd = slab.shape[1]
                widen_half(slab, s0 * hd, scratch, 0, n * hd)
                return scratch[:n]

            return widen_run

        def widen(slab, s0, n, scratch):
            hd = slab.shape[1]
            for j in range(n):
                widen_half(slab[s0 + j], 0, scratch[j], 0, hd)
            return scratch[:n]

        return widen
    return lambda slab, s0, n, scratch: slab[s0 : s0 + n]


@overload(kv_store)
def _kv_store(row, x):
    if row.dtype == types.uint16:
        return lambda row, x: narrow_half(x, 0, row, 0, x.shape[0])

    def copy(row, x):
        row[:] = x

    return copy


# ---------------------------------------------------------------------------------------------
# Type dispatch (a branch per row is noise next to a row's hundreds of elements)


@njit(cache=True)
def row_dot(t, w, woff, x, xoff, xs, xsoff, nb):
    """Dot product of one stored row (type `t`, `nb` blocks at byte `woff` of `w`) with x."""
    if t == Q4_1:
        return dot_q4_1(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q8_0:
        return dot_q8_0(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q4_0:
        return dot_q4_0(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q4_K:
        return dot_q4_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q6_K:
        return dot_q6_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q5_K:
        return dot_q5_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q5_0:
        return dot_q5_0(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q5_1:
        return dot_q5_1(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q3_K:
        return dot_q3_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == IQ4_NL:
        return dot_iq4_nl(w, woff, x, xoff, xs, xsoff, nb)
    if t == IQ4_XS:
        return dot_iq4_xs(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q2_K:
        return dot_q2_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == F16:
        return dot_f16(w, woff, x, xoff, xs, xsoff, nb)
    if t == BF16:
        return dot_bf16(w, woff, x, xoff, xs, xsoff, nb)
    return dot_f32(w, woff, x, xoff, xs, xsoff, nb)


@njit(cache=True, fastmath=False)
def row_dequant(t, w, woff, out, ooff, nb):
    """Write the float32 values of one stored row into out[ooff:]."""
    if t == Q4_1:
        deq_q4_1(w, woff, out, ooff, nb)
    elif t == Q8_0:
        deq_q8_0(w, woff, out, ooff, nb)
    elif t == Q4_0:
        deq_q4_0(w, woff, out, ooff, nb)
    elif t == Q4_K:
        deq_q4_k(w, woff, out, ooff, nb)
    elif t == Q6_K:
        deq_q6_k(w, woff, out, ooff, nb)
    elif t == Q5_K:
        deq_q5_k(w, woff, out, ooff, nb)
    elif t == Q5_0:
        deq_q5_0(w, woff, out, ooff, nb)
    elif t == Q5_1:
        deq_q5_1(w, woff, out, ooff, nb)
    elif t == Q3_K:
        deq_q3_k(w, woff, out, ooff, nb)
    elif t == IQ4_NL:
        deq_iq4_nl(w, woff, out, ooff, nb)
    elif t == IQ4_XS:
        deq_iq4_xs(w, woff, out, ooff, nb)
    elif t == Q2_K:
        deq_q2_k(w, woff, out, ooff, nb)
    elif t == F16:
        deq_f16(w, woff, out, ooff, nb)
    elif t == BF16:
        deq_bf16(w, woff, out, ooff, nb)
    else:
        deq_f32(w, woff, out, ooff, nb)


@njit(cache=True, fastmath=True)
def group_sums(x, xs):
    """xs[g] = sum(x[32g : 32g + 32]) for each whole 32-group of the 1-D x."""
    for g in range(xs.shape[0]):
        s = np.float32(0.0)
        for i in range(GROUP * g, GROUP * g + GROUP):
            s += x[i]
        xs[g] = s


@njit(cache=True, fastmath=False, inline="always")
def abs_max(x, start, end):
    """max |x[start:end]| of the 1-D x, or NaN when one of them is NaN or Inf: the scale of an
    int8 rounding, so that a non-finite activation makes its products NaN (which the engine
    reports as a damaged model) rather than the finite garbage NaN rounds to."""
    amax = np.float32(0.0)
    probe = np.float32(0.0)  # + 0 * x: stays 0 while every x is finite
    for i in range(start, end):
        amax = max(amax, abs(x[i]))
        probe += x[i] * np.float32(0.0)
    return amax + probe


@njit(cache=True, fastmath=False)  # numpy reproduces it exactly (tests)
def quantize_x(x, xq, xf):
    """Round the 1-D x (n,) to two int8 planes per 32-group: with d = max|x| / 127,
    xq[:n] = hi = rint(x / d) (llama.cpp's Q8_0) and xq[n:] = lo = rint((x - d * hi) * 256 / d),
    so x ~ d/256 * (256 * hi + lo) to within d/512. xf (XF * ng,) gets d/256 per group, then
    d/256 times the sum of (256 * hi + lo) over each group, then over each 16-half."""
    n = x.shape[0]
    ng = n // GROUP
    for g in range(ng):
        d = abs_max(x, GROUP * g, GROUP * g + GROUP) / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        sums = [0, 0]
        for half in range(2):
            s = 0
            for i in range(GROUP * g + 16 * half, GROUP * g + 16 * half + 16):
                hi = min(max(np.rint(x[i] * inv), np.float32(-127.0)), np.float32(127.0))
                r = (x[i] - hi * d) * inv * np.float32(256.0)
                lo = min(max(np.rint(r), np.float32(-127.0)), np.float32(127.0))
                xq[i], xq[n + i] = np.int8(hi), np.int8(lo)
                s += np.int32(hi) * 256 + np.int32(lo)
            sums[half] = s
        unit = d / np.float32(256.0)
        xf[g] = unit
        xf[ng + g] = unit * np.float32(sums[0] + sums[1])
        xf[2 * ng + 2 * g] = unit * np.float32(sums[0])
        xf[2 * ng + 2 * g + 1] = unit * np.float32(sums[1])


# ---------------------------------------------------------------------------------------------
# Matrix products on a stored matrix: w is the flat uint8 buffer, the matrix starts at byte
# `off`, stored row `perm[r]` is logical row r (llama.cpp's Q/K row order, undone for free).


@njit(cache=True, inline="always")
def prefetch_row(w, off, rowbytes, perm, r, end):
    """Ask for the bytes of the row ~PREFETCH_BYTES after logical row r (stored row
    perm[r + ahead]) when it is before `end`: decode GEMVs stream their rows from memory."""
    ahead = r + max(1, PREFETCH_BYTES // rowbytes)
    if ahead < end:
        prefetch(w, off + perm[ahead] * rowbytes, rowbytes)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_batch(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for a few tokens: each row is read once for all T."""
    n_tok, cols = x.shape
    rows = perm.shape[0]
    xf = x.reshape(-1)  # (T * cols,)
    xs = np.empty(n_tok * (cols // GROUP), np.float32)
    ng = cols // GROUP
    for i in range(n_tok):
        group_sums(x[i], xs[i * ng : (i + 1) * ng])
    for r in prange(rows):
        prefetch_row(w, off, rowbytes, perm, r, rows)
        woff = off + perm[r] * rowbytes
        for i in range(n_tok):
            out[i, r] = row_dot(t, w, woff, xf, i * cols, xs, i * ng, nb)


@njit(parallel=True, cache=True, fastmath=False)
def dequant_rows(t, w, off, rowbytes, nb, perm, r0, out):
    """out (R, cols) = float32 values of logical rows r0 .. r0 + R - 1."""
    rows, cols = out.shape
    of = out.reshape(-1)
    for i in prange(rows):
        row_dequant(t, w, off + perm[r0 + i] * rowbytes, of, i * cols, nb)


@njit(parallel=True, cache=True, fastmath=False)
def gather_rows(t, w, off, rowbytes, nb, ids, out):
    """Embedding lookup: out (T, cols) = float32 values of rows `ids` (stored order)."""
    cols = out.shape[1]
    of = out.reshape(-1)
    for i in prange(ids.shape[0]):
        row_dequant(t, w, off + ids[i] * rowbytes, of, i * cols, nb)


@njit(cache=True, fastmath=True)
def tile_dots(x, b, nrows, out, r0):
    """out[t, r0 + j] = x[t] . b[j] for every token t and j < nrows: x (T, K), b (>= nrows, K).
    Three tokens times four rows per inner loop: each loaded x and b value feeds several
    multiply-adds (12 accumulators, which LLVM keeps in vector registers), which is what lets
    this reach ~90% of OpenBLAS's single-core sgemm."""
    n_tok, k_len = x.shape
    t = 0
    while t + 2 < n_tok:
        j = 0
        while j + 3 < nrows:
            a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = np.float32(0.0)
            for k in range(k_len):
                x0, x1, x2 = x[t, k], x[t + 1, k], x[t + 2, k]
                b0, b1, b2, b3 = b[j, k], b[j + 1, k], b[j + 2, k], b[j + 3, k]
                a0 += x0 * b0
                a1 += x0 * b1
                a2 += x0 * b2
                a3 += x0 * b3
                c0 += x1 * b0
                c1 += x1 * b1
                c2 += x1 * b2
                c3 += x1 * b3
                e0 += x2 * b0
                e1 += x2 * b1
                e2 += x2 * b2
                e3 += x2 * b3
            out[t, r0 + j], out[t, r0 + j + 1] = a0, a1
            out[t, r0 + j + 2], out[t, r0 + j + 3] = a2, a3
            out[t + 1, r0 + j], out[t + 1, r0 + j + 1] = c0, c1
            out[t + 1, r0 + j + 2], out[t + 1, r0 + j + 3] = c2, c3
            out[t + 2, r0 + j], out[t + 2, r0 + j + 1] = e0, e1
            out[t + 2, r0 + j + 2], out[t + 2, r0 + j + 3] = e2, e3
            j += 4
        while j < nrows:
            a0 = c0 = e0 = np.float32(0.0)
            for k in range(k_len):
                a0 += x[t, k] * b[j, k]
                c0 += x[t + 1, k] * b[j, k]
                e0 += x[t + 2, k] * b[j, k]
            out[t, r0 + j], out[t + 1, r0 + j], out[t + 2, r0 + j] = a0, c0, e0
            j += 1
        t += 3
    while t < n_tok:  # the last one or two tokens
        j = 0
        while j + 3 < nrows:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(k_len):
                x0 = x[t, k]
                a0 += x0 * b[j, k]
                a1 += x0 * b[j + 1, k]
                a2 += x0 * b[j + 2, k]
                a3 += x0 * b[j + 3, k]
            out[t, r0 + j], out[t, r0 + j + 1] = a0, a1
            out[t, r0 + j + 2], out[t, r0 + j + 3] = a2, a3
            j += 4
        while j < nrows:
            a0 = np.float32(0.0)
            for k in range(k_len):
                a0 += x[t, k] * b[j, k]
            out[t, r0 + j] = a0
            j += 1
        t += 1


TILE_ROWS = 16  # rows dequantized per task: small tasks keep both cores busy to the end


@njit(parallel=True, cache=True, fastmath=True)
def gemm(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for many tokens: each task dequantizes TILE_ROWS rows
    once (bit-exact) and multiplies them with every token."""
    cols = x.shape[1]
    rows = perm.shape[0]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for ti in prange(n_tiles):
        r0 = ti * TILE_ROWS
        n = min(TILE_ROWS, rows - r0)
        tile = np.empty((TILE_ROWS, cols), np.float32)
        flat = tile.reshape(-1)
        for j in range(n):
            row_dequant(t, w, off + perm[r0 + j] * rowbytes, flat, j * cols, nb)
        tile_dots(x, tile, n, out, r0)


QUERY_BLOCK = 16


@njit(parallel=True, cache=True, fastmath=True)
def _transposed(kv, width):
    """(nkv, hd, width) float32 of a KV slab (nkv, S, hd), zero past S (width >= S): keys as
    tile_qk's columns, values as rows for tile_dots' P @ V. Made once per call: made per task
    it cost as much as the product itself (every query block of every head of a group copied
    the same values again)."""
    n_kv, n_keys, hd = kv.shape
    out = np.zeros((n_kv, hd, width), np.float32)
    n_tiles = (n_keys + KV_TILE - 1) // KV_TILE
    for job in prange(n_kv * n_tiles):
        g, s0 = job // n_tiles, (job % n_tiles) * KV_TILE
        n = min(KV_TILE, n_keys - s0)
        tile = np.empty((KV_TILE, hd), np.float32)
        rows = kv_rows(kv[g], s0, n, tile)
        for d in range(hd):
            for s in range(n):
                out[g, d, s0 + s] = rows[s, d]
    return out


@njit(parallel=True, cache=True, fastmath=True)
def attention(q, k, v, start, out):
    """Causal GQA attention (as numpy_ref.attention): q (T, nh, hd) at positions start..,
    k, v (nkv, S, hd) with S = start + T, float32 or float16 bits (kv_rows); out (T, nh, hd).
    One task per head and block of queries: scores from tile_qk on the transposed keys (4
    queries x 32 keys per tile), P @ V from tile_dots on the transposed values."""
    n_tok, n_heads, hd = q.shape
    n_kv, n_all = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    n_blocks = (n_tok + QUERY_BLOCK - 1) // QUERY_BLOCK
    scale = np.float32(1.0 / math.sqrt(hd))
    width = (n_all + QK_KEYS - 1) // QK_KEYS * QK_KEYS
    ktf = _transposed(k, width).reshape(-1)
    vt = _transposed(v, width)
    for job in prange(n_heads * n_blocks):
        h = job // n_blocks
        i0 = (job % n_blocks) * QUERY_BLOCK
        nq = min(QUERY_BLOCK, n_tok - i0)
        rows = (nq + QK_QUERIES - 1) // QK_QUERIES * QK_QUERIES
        n_keys = start + i0 + nq  # the last query of the block sees this many keys
        cols = (n_keys + QK_KEYS - 1) // QK_KEYS * QK_KEYS
        qb = np.zeros((rows, hd), np.float32)
        for i in range(nq):
            for d in range(hd):
                qb[i, d] = q[i0 + i, h, d] * scale
        scores = np.empty((rows, cols), np.float32)
        qf, sf, koff = qb.reshape(-1), scores.reshape(-1), (h // group) * hd * width
        for i in range(0, rows, QK_QUERIES):
            for s0 in range(0, cols, QK_KEYS):
                tile_qk(qf, i * hd, ktf, koff + s0, width, hd, sf, i * cols + s0, cols)
        for i in range(rows):
            seen = start + i0 + i + 1 if i < nq else 0  # causal: keys 0 .. start + i0 + i
            if seen:
                softmax_row(scores[i], seen)
            for s in range(seen, cols):
                scores[i, s] = 0.0
        ob = np.empty((rows, hd), np.float32)
        tile_dots(scores, vt[h // group], hd, ob, 0)  # P (rows, cols) @ V (cols, hd)
        for i in range(nq):
            for d in range(hd):
                out[i0 + i, h, d] = ob[i, d]
