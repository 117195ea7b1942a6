"""The fused decode step of the fast CPU path: every layer of a Llama-family decoder for one
token in one numba call (cpu.fast.FusedDecoder), and the start-up that loads the kernels.

Shapes: H hidden size, I MLP size, L layers, nq/nkv query/key-value heads of dim hd.
"""

from __future__ import annotations

import ctypes
import math
import sys

import numpy as np

from atlas_cli.backend.cache import FAST_KV_DTYPE
from atlas_cli.backend.ops.cpu import amx as cpu_amx
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu import rows as cpu_rows
from atlas_cli.backend.ops.cpu.gemv_int8 import gemv_batch_int8, has_int8_dot, int8_rows
from atlas_cli.backend.ops.cpu.ir_attention import (
    dots16,
    pv16_1,
    pv16_2,
    pv16_4,
    pv64_1,
    pv64_2,
    pv64_4,
)
from atlas_cli.backend.ops.cpu.ir_sync import SLOT, claim, wait_until
from atlas_cli.backend.ops.cpu.kernels import (
    BLOCKS,
    EXACT_DIVISION_FASTMATH,
    GROUP,
    KV_TILE,
    Q4_K,
    Q8_0,
    XF,
    attention,
    fast_exp,
    gather_rows,
    gemm,
    gemv_batch,
    group_sums,
    kv_bits,
    kv_rows,
    kv_store,
    prefetch_row,
    quantize_x,
    row_dequant,
    row_dot,
    softmax_row,
    tile_dots,
)
from atlas_cli.backend.ops.cpu.prefill import gemm_int16

jit.configure()

from numba import njit, prange  # noqa: E402

# # mats (L, 7, 4) int64: for q, k, v, o, gate, up, down: [type, byte offset, row bytes, blocks].
# norms (L, 2, H): input and post-attention RMSNorm weights. bias (L, nq*hd + 2*nkv*hd): q/k/v
# biases (zeros when the model has none). qk_norm (L, 2, hd): per-head q/k norms (used when
# `use_qk_norm`). kc, vc (L, nkv, capacity, hd): the KV cache.

Q, K, V, O, GATE, UP, DOWN = range(7)


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def rms_norm_into(x, w, eps, out):
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        ss += x[i] * x[i]
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + np.float32(eps))
    for i in range(n):
        out[i] = x[i] * scale * w[i]


@njit(cache=True, fastmath=True)
def rope_neox(v, n_heads, hd, cos, sin):
    """In place on v (n_heads * hd,): rotate_half RoPE on the first 2 * len(cos) dims of each
    head (as numpy_ref.rope)."""
    half = cos.shape[0]
    for h in range(n_heads):
        base = h * hd
        for i in range(half):
            a = v[base + i]
            b = v[base + half + i]
            v[base + i] = a * cos[i] - b * sin[i]
            v[base + half + i] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=True)
def attend_group(q, keys, vals, n_pos, scale, scores, out):
    """Attention of one GQA group's query heads q (g * hd,) over keys/vals (>= n_pos, hd),
    float32 or float16 bits (kv_rows); scores (g, >= n_pos) scratch; writes out (g * hd,).
    Slabs of whole rows with hd % 16 == 0 (every model here) are read in place by the IR
    kernels, float16 widened in registers: the scores 16 keys at a time (dots16), the values
    64 (or 16) columns at a time with the group's heads summed in registers (pv64_*, pv16_*)."""
    g = scores.shape[0]
    hd = keys.shape[1]
    rows_whole = keys.strides[0] == keys.itemsize * hd and vals.strides[0] == vals.itemsize * hd
    in_place = hd % 16 == 0 and rows_whole and keys.strides[1] == keys.itemsize
    in_place = in_place and vals.strides[1] == vals.itemsize and scores.strides[1] == 4
    qs = np.empty((g, hd), np.float32)
    for j in range(g):
        for d in range(hd):
            qs[j, d] = q[j * hd + d] * scale
    tile = np.empty((KV_TILE, hd), np.float32)
    n16 = n_pos // 16 * 16 if in_place else 0
    for j in range(g):
        for c in range(0, n16, 16):
            dots16(qs[j], keys, c * hd, hd, scores[j], c)
    for s0 in range(n16, n_pos, KV_TILE):  # the last keys (all of them for other slabs)
        n = min(KV_TILE, n_pos - s0)
        tile_dots(qs, kv_rows(keys, s0, n, tile), n, scores, s0)
    for j in range(g):
        softmax_row(scores[j], n_pos)
    acc = np.zeros((g, hd), np.float32)
    if in_place:
        stride = scores.strides[0] // 4
        cols = 64 if hd % 64 == 0 else 16
        for c in range(0, hd, cols):
            j = 0
            while j < g:  # the group's heads in sets of 4, 2, 1
                heads = 4 if g - j >= 4 else 2 if g - j >= 2 else 1
                at, to = j * stride, j * hd + c
                if cols == 64 and heads == 4:
                    pv64_4(scores, at, stride, vals, c, n_pos, hd, acc, to)
                elif cols == 64 and heads == 2:
                    pv64_2(scores, at, stride, vals, c, n_pos, hd, acc, to)
                elif cols == 64:
                    pv64_1(scores, at, stride, vals, c, n_pos, hd, acc, to)
                elif heads == 4:
                    pv16_4(scores, at, stride, vals, c, n_pos, hd, acc, to)
                elif heads == 2:
                    pv16_2(scores, at, stride, vals, c, n_pos, hd, acc, to)
                else:
                    pv16_1(scores, at, stride, vals, c, n_pos, hd, acc, to)
                j += heads
    else:
        for s0 in range(0, n_pos, KV_TILE):
            n = min(KV_TILE, n_pos - s0)
            rows = kv_rows(vals, s0, n, tile)
            for j in range(g):  # per head, on 1-D views of its sums and probabilities
                head, probs = acc[j], scores[j]
                for s in range(n):
                    p, row = probs[s0 + s], rows[s]
                    for d in range(hd):
                        head[d] += p * row[d]
    for j in range(g):
        for d in range(hd):
            out[j * hd + d] = acc[j, d]


@njit(cache=True, fastmath=True)
def decode_step(
    w,  # uint8 (file bytes)
    mats,  # int64 (L, 7, 4)
    perm_q,  # int64 (nq * hd,)
    perm_k,  # int64 (nkv * hd,)
    embed,  # int64 (4,): [type, offset, row bytes, blocks] of the embedding table
    token,
    pos,
    norms,  # float32 (L, 2, H)
    final_norm,  # float32 (H,)
    bias,  # float32 (L, nq*hd + 2*nkv*hd)
    qk_norm,  # float32 (L, 2, hd)
    use_qk_norm,
    inv_freq,  # float32 (rot/2,)
    eps,
    kc,  # float32 (L, nkv, cap, hd)
    vc,
    qkv,  # float32 scratch (nq*hd + 2*nkv*hd,)
    act,  # float32 scratch (I,)
    scores,  # float32 scratch (nq, cap)
    x,  # float32 scratch (H,): the residual stream
    out,  # float32 (H,): the final normed hidden state
    int8,  # products on int8-rounded activations (cpu.ir_int8) where the format has them
    workers,  # iterations of the one parallel loop (the thread count; any count is correct)
):
    n_layers = mats.shape[0]
    half = inv_freq.shape[0]
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for i in range(half):
        angle = np.float32(pos) * inv_freq[i]  # float32, as numpy_ref.rope
        cos[i] = np.cos(angle)
        sin[i] = np.sin(angle)
    row_dequant(embed[0], w, embed[1] + token * embed[2], x, 0, embed[3])
    att = np.empty(scores.shape[0] * kc.shape[3], np.float32)
    counters = np.zeros(n_layers * STAGES * SLOT, np.int64)
    _layers(
        w, mats, perm_q, perm_k, pos, norms, bias, qk_norm, use_qk_norm, cos, sin, eps, kc, vc,
        qkv, act, scores, x, att, int8, counters, workers,
    )  # fmt: skip
    rms_norm_into(x, final_norm, eps, out)


# The stages of a layer, in order; each needs all of the one before (cpu.ir_sync).
QKV_ROWS, ATTEND, O_ROWS, GATE_UP_ROWS, DOWN_ROWS = range(5)
STAGES = 5
CHUNKS_PER_WORKER = 8  # claims per worker and stage: small enough to even out, few atomics


@njit(parallel=True, cache=True, fastmath=True)
def _layers(
    w, mats, perm_q, perm_k, pos, norms, bias, qk_norm, use_qk_norm, cos, sin, eps, kc, vc, qkv,
    act, scores, x, att, int8, counters, workers,
):  # fmt: skip
    """Every layer for one token, on `workers` iterations that claim each stage's rows or heads
    from `counters` (zeros, STAGES * SLOT per layer). What every worker needs of a stage's input
    (the norm of x, its int8 rounding) it computes into its own buffers: a worker can only
    claim work of a stage while nobody has finished it, so no input it read was changing."""
    hidden, inter = x.shape[0], act.shape[0]
    n_heads, hd = scores.shape[0], kc.shape[3]
    widest = max(hidden, inter, n_heads * hd)
    rows = np.arange(widest)  # the stored row of each logical row, where nothing is permuted
    for _worker in prange(workers):
        xn, xs, xq, xf, part = worker_scratch(widest)
        for layer in range(mats.shape[0]):
            m, at = mats[layer], layer * STAGES * SLOT
            h = xn[:hidden]
            rms_norm_into(x, norms[layer, 0], eps, h)
            prepare_input(h, xs, xq, xf, int8)
            _qkv_rows(w, m, perm_q, perm_k, rows, bias[layer], h, xs, xq, xf, int8, qkv, part[0],
                      counters, at, workers)  # fmt: skip
            _attend_heads(
                qkv, qk_norm[layer], use_qk_norm, cos, sin, eps, kc[layer], vc[layer], pos,
                scores, att, counters, at + ATTEND * SLOT,
            )  # fmt: skip
            prepare_input(att, xs, xq, xf, int8)
            add_rows(w, m[O], rows, att, xs, xq, xf, int8, x, part[0], counters,
                      at + O_ROWS * SLOT, workers)  # fmt: skip
            mlp_rows(w, m, norms[layer, 1], eps, x, h, xs, xq, xf, int8, act, rows, part, counters,
                     at + GATE_UP_ROWS * SLOT, at + DOWN_ROWS * SLOT, workers)  # fmt: skip


@njit(cache=True)
def worker_scratch(widest):
    """A worker's own buffers for inputs up to `widest` wide: the input (the normed x, or a
    later stage's), its 32-group sums, its int8 rounding (quantize_x) with its scales and sums,
    a claimed chunk's dots."""
    return (
        np.empty(widest, np.float32),
        np.empty(widest // GROUP, np.float32),
        np.empty(2 * widest, np.int8),
        np.empty(widest // GROUP * XF, np.float32),
        np.empty((2, widest), np.float32),
    )


@njit(cache=True, fastmath=True)
def dots(mat, rows, r0, r1, w, v, xs, xq, xf, int8, out):
    """out[i] = the dot of logical row r0 + i (stored row rows[r0 + i]) of mat ([type, offset,
    row bytes, blocks]) with v, for r0 <= row < r1. The int8 choice is made once here, not per
    row: a row loop with both branches inlined per row ran ~2x slower on the default model's
    rows (docs/performance.md)."""
    t, off, rb, nb = mat[0], mat[1], mat[2], mat[3]
    if int8 and has_int8_dot(t):
        int8_rows(t, w, off, rb, nb, rows, r0, r1, xq, 0, xf, 0, out, 0)
    else:
        for r in range(r0, r1):
            prefetch_row(w, off, rb, rows, r, r1)
            out[r - r0] = row_dot(t, w, off + rows[r] * rb, v, 0, xs, 0, nb)


@njit(cache=True, inline="always")
def take(counters, at, step, n):
    """Claim the next chunk of up to `step` of a stage's n rows: (r0, r1), empty when none is
    left. The stage's done count is the counter after `at`."""
    r0 = min(n, claim(counters, at, step))
    return r0, min(n, r0 + step)


@njit(cache=True, inline="always")
def chunk_size(n, workers):
    """Rows per claim of a stage of n rows."""
    return max(1, n // (CHUNKS_PER_WORKER * workers))


@njit(cache=True, fastmath=True)
def _qkv_rows(w, m, perm_q, perm_k, rows, bias, h, xs, xq, xf, int8, qkv, part, counters, at,
              workers):  # fmt: skip
    """qkv = the q, k, v projections of the normed x h (+ biases), claimed in chunks."""
    nq, nk = perm_q.shape[0], perm_k.shape[0]
    n = qkv.shape[0]
    step = chunk_size(n, workers)
    while True:
        r0, r1 = take(counters, at, step, n)
        if r0 == r1:
            break
        for mat, perm, lo, hi in ((m[Q], perm_q, 0, nq), (m[K], perm_k, nq, nq + nk),
                                  (m[V], rows, nq + nk, n)):  # fmt: skip
            a, b = max(r0, lo), min(r1, hi)
            if a < b:
                dots(mat, perm, a - lo, b - lo, w, h, xs, xq, xf, int8, part)
                for r in range(a, b):
                    qkv[r] = part[r - a] + bias[r]
        claim(counters, at + 1, r1 - r0)
    wait_until(counters, at + 1, n)


@njit(cache=True, fastmath=True)
def _attend_heads(qkv, qk_norm, use_qk_norm, cos, sin, eps, kc, vc, pos, scores, att, counters, at):
    """Per KV head, claimed one at a time: q/k norms and RoPE of its query heads and its key,
    its key and value into the cache at `pos`, and the attention of its query heads."""
    n_kv, hd = kc.shape[0], kc.shape[2]
    n_heads = scores.shape[0]
    nq, nk = n_heads * hd, n_kv * hd
    group = n_heads // n_kv
    inv_sqrt = np.float32(1.0 / math.sqrt(hd))
    while True:
        kvh, end = take(counters, at, 1, n_kv)
        if kvh == end:
            break
        h0 = kvh * group
        q = qkv[h0 * hd : (h0 + group) * hd]
        k = qkv[nq + kvh * hd : nq + (kvh + 1) * hd]
        v = qkv[nq + nk + kvh * hd : nq + nk + (kvh + 1) * hd]
        if use_qk_norm:
            for j in range(group):
                seg = q[j * hd : (j + 1) * hd]
                rms_norm_into(seg, qk_norm[0], eps, seg)
            rms_norm_into(k, qk_norm[1], eps, k)
        rope_neox(q, group, hd, cos, sin)
        rope_neox(k, 1, hd, cos, sin)
        kv_store(kc[kvh, pos], k)
        kv_store(vc[kvh, pos], v)
        # the query heads of one KV head share each key and value read
        attend_group(
            q, kc[kvh], vc[kvh], pos + 1, inv_sqrt, scores[h0 : h0 + group],
            att[h0 * hd : (h0 + group) * hd],
        )  # fmt: skip
        claim(counters, at + 1, 1)
    wait_until(counters, at + 1, n_kv)


@njit(cache=True, fastmath=True)
def add_rows(w, mat, rows, v, xs, xq, xf, int8, x, part, counters, at, workers):
    """x += mat @ v (o_proj, down_proj), claimed in chunks of rows."""
    n = x.shape[0]
    step = chunk_size(n, workers)
    while True:
        r0, r1 = take(counters, at, step, n)
        if r0 == r1:
            break
        dots(mat, rows, r0, r1, w, v, xs, xq, xf, int8, part)
        for r in range(r0, r1):
            x[r] += part[r - r0]
        claim(counters, at + 1, r1 - r0)
    wait_until(counters, at + 1, n)


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def gate_up_rows(w, m, rows, h, xs, xq, xf, int8, act, part, counters, at, workers):
    """act = silu(gate(h)) * up(h), claimed in chunks of rows."""
    n = act.shape[0]
    step = chunk_size(n, workers)
    while True:
        r0, r1 = take(counters, at, step, n)
        if r0 == r1:
            break
        dots(m[GATE], rows, r0, r1, w, h, xs, xq, xf, int8, part[0])
        dots(m[UP], rows, r0, r1, w, h, xs, xq, xf, int8, part[1])
        for r in range(r0, r1):
            g = part[0, r - r0]
            act[r] = g / (np.float32(1.0) + fast_exp(-g)) * part[1, r - r0]
        claim(counters, at + 1, r1 - r0)
    wait_until(counters, at + 1, n)


@njit(cache=True, fastmath=True)
def mlp_rows(w, m, post_norm, eps, x, h, xs, xq, xf, int8, act, rows, part, counters,
             at_gate_up, at_down, workers):  # fmt: skip
    """x += down(silu(gate(h)) * up(h)), h = rms_norm(x): a layer's last two stages (counters
    at at_gate_up and at_down), on m's GATE, UP and DOWN rows in w."""
    rms_norm_into(x, post_norm, eps, h)
    prepare_input(h, xs, xq, xf, int8)
    gate_up_rows(w, m, rows, h, xs, xq, xf, int8, act, part, counters, at_gate_up, workers)
    prepare_input(act, xs, xq, xf, int8)
    add_rows(w, m[DOWN], rows, act, xs, xq, xf, int8, x, part[0], counters, at_down, workers)


@njit(cache=True)
def prepare_input(v, xs, xq, xf, int8):
    """What the row dots read of the input v besides v: its 32-group sums, and where `int8`
    its int8 rounding (quantize_x)."""
    n = v.shape[0]
    group_sums(v, xs[: n // GROUP])
    if int8:
        quantize_x(v, xq[: 2 * n], xf[: n // GROUP * XF])


# -- start-up --------------------------------------------------------------------------------

GEMV_WARM_TOKENS = 8  # any count above cpu.fast.GEMV_MAX_TOKENS: the gemm kernel


def warm_up(kv_dtype=FAST_KV_DTYPE) -> None:
    """Load every kernel a generation uses (from numba's disk cache, or compile it) by running
    each once on a tiny dummy model with the argument types of real calls: a KV cache of
    `kv_dtype` (float16 is passed as its bits)."""
    hidden, hd, heads, n_kv, inter = 32, 16, 2, 1, 32
    nb, rb = 1, BLOCKS[Q8_0][1]  # one Q8_0 block per 32-wide row
    w = np.zeros(64 * rb, np.uint8)
    w.flags.writeable = False  # as a GGUF memory map: numba types read-only arrays apart
    perm = np.arange(32, dtype=np.int64)
    x = np.zeros((1, hidden), np.float32)
    gemv_batch(Q8_0, w, 0, rb, nb, perm, x, np.empty((1, 32), np.float32))
    gemv_batch_int8(Q8_0, w, 0, rb, nb, perm, x, np.empty((1, 32), np.float32))
    x = np.zeros((GEMV_WARM_TOKENS, hidden), np.float32)
    gemm(Q8_0, w, 0, rb, nb, perm, x, np.empty((GEMV_WARM_TOKENS, 32), np.float32))
    kq = np.zeros(32 * BLOCKS[Q4_K][1], np.uint8)  # 32 rows of one Q4_K super-block each
    kq.flags.writeable = False
    x = np.zeros((GEMV_WARM_TOKENS, BLOCKS[Q4_K][0]), np.float32)
    out = np.empty((GEMV_WARM_TOKENS, 32), np.float32)
    gemm_int16(Q4_K, kq, 0, BLOCKS[Q4_K][1], 1, perm, x, out)
    if cpu_amx.ready():
        cpu_amx.gemm_amx(Q4_K, kq, 0, BLOCKS[Q4_K][1], 1, perm, x, out)
    gather_rows(Q8_0, w, 0, rb, nb, np.zeros(2, np.int64), np.empty((2, hidden), np.float32))
    q = np.ones((2, heads, hd), np.float32)
    kc = kv_bits(np.zeros((n_kv, 2, hd), kv_dtype))
    attention(q, kc, kc, 0, np.empty_like(q))
    mats = np.zeros((1, 7, 4), np.int64)
    mats[0, :, 0], mats[0, :, 2], mats[0, :, 3] = Q8_0, rb, nb
    mats[0, O, 3] = mats[0, DOWN, 3] = 1  # o_proj and down_proj read 32 columns too
    cache = kv_bits(np.zeros((1, n_kv, 4, hd), kv_dtype))
    decode_step(
        w,
        mats,
        perm,
        perm[: n_kv * hd],
        np.array([Q8_0, 0, rb, nb], np.int64),
        0,
        0,
        np.ones((1, 2, hidden), np.float32),
        np.ones(hidden, np.float32),
        np.zeros((1, (heads + 2 * n_kv) * hd), np.float32),
        np.ones((1, 2, hd), np.float32),
        False,
        np.ones(hd // 2, np.float32),
        1e-5,
        cache,
        cache.copy(),
        np.empty((heads + 2 * n_kv) * hd, np.float32),
        np.empty(inter, np.float32),
        np.empty((heads, 4), np.float32),
        np.empty(hidden, np.float32),
        np.empty(hidden, np.float32),
        True,
        2,
    )
    cpu_rows.warm_up()  # the prefill's elementwise ops


def kernels_cached(kernel=None) -> bool:
    """Whether numba's disk cache already holds `kernel` (default: decode_step, for this
    source file), so loading takes a fraction of a second instead of a compile. Best effort:
    numba's cache index is not public API, and any surprise counts as cached."""
    try:
        return bool((kernel or decode_step)._cache._cache_file._load_index())
    except Exception:
        return True


def release_compiler_memory() -> None:
    """Drop LLVM's code pages from this process's resident memory (Linux, MADV_PAGEOUT).

    Once the kernels are loaded, the ~60-70 MB of libllvmlite code that loading touched is
    not run again (unless a new kernel has to be compiled, when the pages fault back in from
    the page cache). Called after `warm_up` and before the weights are first read, it keeps
    the compiler and the weights from being resident at the same time."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            ranges = [
                line.split()[0]
                for line in maps
                if line.rstrip().endswith(".so") and "libllvmlite" in line.rsplit("/", 1)[-1]
            ]
    except (OSError, AttributeError):
        return
    for span in ranges:
        lo, hi = (int(v, 16) for v in span.split("-"))
        madvise(lo, hi - lo, 21)  # MADV_PAGEOUT; clean file pages only, errors are harmless
