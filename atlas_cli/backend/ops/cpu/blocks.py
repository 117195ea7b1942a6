"""The fast CPU path's layer-at-a-time fused decode step (fused.FusedLayers): one numba call
per layer, for the Gated DeltaNet and gated attention layers of hybrid models (Qwen3.5).

Op by op, a Qwen3.5 decode step is ~20 numpy and kernel calls per layer (projections, conv,
norms, gates, the recurrent update, the output norm), a third of a 0.8B model's step time on
one core. Here each layer and its MLP is one call with one parallel loop: a Gated DeltaNet
layer (`gdn_block`: its four input projections, the causal conv, the L2 norms and gates, the
gated delta rule on the layer's state in place, the gated RMSNorm, out_proj) or a gated
attention layer (`attention_block`), each then its MLP. As in cpu.decode's step, the loop has
one iteration per thread and hands each stage's rows, channels and heads out through counters
(cpu.ir_sync) instead of a `prange` per stage, six per layer: a layer with hot weights ran
4-9% faster, the whole step (weights streamed from memory) the same. Same math
as the op path (models/qwen3_5.py with numpy_ref's ops), the same packed weights, the same
host `cache.HybridCache`.

Shapes: H hidden size, C conv channels (2 nk dk + nv dv), nk/nv key/value heads of dk/dv
(value head h reads key head h // (nv // nk)), nh/nkv attention heads of dim hd.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from atlas_cli.backend.cache import FAST_KV_DTYPE
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu.decode import (
    add_rows,
    attend_group,
    chunk_size,
    dots,
    mlp_rows,
    prepare_input,
    rms_norm_into,
    rope_neox,
    take,
    worker_scratch,
)
from atlas_cli.backend.ops.cpu.gdn import gated_delta_rule_chunked
from atlas_cli.backend.ops.cpu.ir_sync import SLOT, claim, wait_until
from atlas_cli.backend.ops.cpu.kernels import (
    BLOCKS,
    EXACT_DIVISION_FASTMATH,
    Q8_0,
    fast_exp,
    kv_bits,
    kv_store,
)

jit.configure()

from numba import njit, prange  # noqa: E402

L2_EPS = 1e-6  # numpy_ref.l2norm's (FLA's and transformers')


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, inline="always", error_model="numpy")
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + fast_exp(-v))


@njit(cache=True, fastmath=True, inline="always")
def _softplus(v):
    """log(1 + exp(v)) without overflow (numpy_ref.softplus: logaddexp(0, v))."""
    return max(v, np.float32(0.0)) + np.log1p(np.exp(-abs(v)))


# The stages of a layer, in order, each needing all of the one before (cpu.ir_sync): the input
# projections; the Gated DeltaNet's conv channels or the attention's KV heads; the Gated
# DeltaNet's value heads (the attention has none); the output projection; the MLP's gate/up
# rows, then its down rows.
PROJECT, MIX, HEADS, OUT_ROWS, GATE_UP_ROWS, DOWN_ROWS = range(6)
STAGES = 6


@njit(cache=True, fastmath=True)
def _project_rows(descs, bufs, n_mats, h, xs, xq, xf, int8, out, rows, part, counters, at,
                  workers):  # fmt: skip
    """out = the products with h of the rows of the first n_mats matrices (descs[i]: [type,
    offset, row bytes, blocks, rows] in bufs[i]), matrix i's rows after matrix i - 1's, claimed
    in chunks that may span two matrices."""
    n = 0
    for i in range(n_mats):
        n += descs[i, 4]
    step = chunk_size(n, workers)
    while True:
        r0, r1 = take(counters, at, step, n)
        if r0 == r1:
            break
        lo = 0
        for i in range(n_mats):
            hi = lo + descs[i, 4]
            a, b = max(r0, lo), min(r1, hi)
            if a < b:
                dots(descs[i], rows, a - lo, b - lo, bufs[i], h, xs, xq, xf, int8, part)
                for r in range(a, b):
                    out[r] = part[r - a]
            lo = hi
        claim(counters, at + 1, r1 - r0)
    wait_until(counters, at + 1, n)


@njit(cache=True, fastmath=True)
def _norm_project(x, norm, eps, descs, bufs, n_mats, h, xs, xq, xf, int8, proj, rows, part,
                  counters, workers):  # fmt: skip
    """A layer's first stage: every worker norms x into h and prepares it, then they share the
    rows of the layer's n_mats input projections (into proj)."""
    xn = h[: x.shape[0]]
    rms_norm_into(x, norm, eps, xn)
    prepare_input(xn, xs, xq, xf, int8)
    _project_rows(descs, bufs, n_mats, xn, xs, xq, xf, int8, proj, rows, part[0], counters,
                  PROJECT * SLOT, workers)  # fmt: skip


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def _conv_channels(conv_w, conv_state, proj, counters, at, workers):
    """The depthwise causal conv over (state..., this token) of each channel, then SiLU, in
    place on proj; the channel's state shifts by one token. Claimed in chunks of channels."""
    n, taps = conv_w.shape
    step = chunk_size(n, workers)
    while True:
        c0, c1 = take(counters, at, step, n)
        if c0 == c1:
            break
        for c in range(c0, c1):
            acc = np.float32(0.0)
            for j in range(taps - 1):
                acc += conv_w[c, j] * conv_state[j, c]
            acc += conv_w[c, taps - 1] * proj[c]
            for j in range(taps - 2):
                conv_state[j, c] = conv_state[j + 1, c]
            conv_state[taps - 2, c] = proj[c]
            proj[c] = acc * _sigmoid(acc)
        claim(counters, at + 1, c1 - c0)
    wait_until(counters, at + 1, n)


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def _delta_rule_head(h, n_kh, proj, n_conv, rec, a_neg, dt_bias, gnorm, eps, core):
    """Value head h of a Gated DeltaNet layer for one token: L2 norms of its q and k, the gates,
    the gated delta rule on its state rec[h] in place, the gated RMSNorm into its slice of
    core (h dv .. (h + 1) dv)."""
    n_vh, dk, dv = rec.shape
    z0 = n_conv
    b0 = z0 + n_vh * dv
    a0 = b0 + n_vh
    kh = h // (n_vh // n_kh)
    q = proj[kh * dk : (kh + 1) * dk]
    k = proj[(n_kh + kh) * dk : (n_kh + kh + 1) * dk]
    v = proj[2 * n_kh * dk + h * dv : 2 * n_kh * dk + (h + 1) * dv]
    qq = np.float32(0.0)
    kk = np.float32(0.0)
    for i in range(dk):
        qq += q[i] * q[i]
        kk += k[i] * k[i]
    q_scale = np.float32(1.0 / math.sqrt(dk)) / np.sqrt(qq + np.float32(L2_EPS))
    k_scale = np.float32(1.0) / np.sqrt(kk + np.float32(L2_EPS))
    beta = _sigmoid(proj[b0 + h])
    decay = np.exp(a_neg[h] * _softplus(proj[a0 + h] + dt_bias[h]))
    s = rec[h]
    kv = np.zeros(dv, np.float32)
    for i in range(dk):  # S *= exp(g); kv = k.S
        ki = k[i] * k_scale
        for j in range(dv):
            s[i, j] *= decay
            kv[j] += ki * s[i, j]
    for j in range(dv):  # d = (v - k.S) * beta
        kv[j] = (v[j] - kv[j]) * beta
    o = np.zeros(dv, np.float32)
    for i in range(dk):  # S += k (x) d; o = q.S
        ki = k[i] * k_scale
        qi = q[i] * q_scale
        for j in range(dv):
            s[i, j] += ki * kv[j]
            o[j] += qi * s[i, j]
    ss = np.float32(0.0)
    for j in range(dv):
        ss += o[j] * o[j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(dv) + np.float32(eps))
    for j in range(dv):  # RMSNormGated: rms_norm(o) * w * silu(z)
        zj = proj[z0 + h * dv + j]
        core[h * dv + j] = o[j] * inv * gnorm[j] * (zj * _sigmoid(zj))


@njit(cache=True, fastmath=EXACT_DIVISION_FASTMATH, error_model="numpy")
def _attend_kv_heads(proj, q_norm, k_norm, cos, sin, eps, pos, kc, vc, qk, scores, att,
                     counters, at):  # fmt: skip
    """Per KV head, claimed one at a time: the q/k norms and RoPE of its query heads and its
    key, its key and value into the cache at `pos`, the attention of its query heads (which
    share each key and value read), each head's output gated by sigmoid(its gate rows)."""
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
        for h in range(h0, h0 + group):
            rms_norm_into(proj[2 * h * hd : (2 * h + 1) * hd], q_norm, eps,
                          qk[h * hd : (h + 1) * hd])  # fmt: skip
        k = qk[nq + kvh * hd : nq + (kvh + 1) * hd]
        rms_norm_into(proj[2 * nq + kvh * hd : 2 * nq + (kvh + 1) * hd], k_norm, eps, k)
        q = qk[h0 * hd : (h0 + group) * hd]
        rope_neox(q, group, hd, cos, sin)
        rope_neox(k, 1, hd, cos, sin)
        kv_store(kc[kvh, pos], k)
        kv_store(vc[kvh, pos], proj[2 * nq + nk + kvh * hd : 2 * nq + nk + (kvh + 1) * hd])
        out = att[h0 * hd : (h0 + group) * hd]
        attend_group(q, kc[kvh], vc[kvh], pos + 1, inv_sqrt, scores[h0 : h0 + group], out)
        for h in range(h0, h0 + group):
            for d in range(hd):
                att[h * hd + d] *= _sigmoid(proj[(2 * h + 1) * hd + d])
        claim(counters, at + 1, 1)
    wait_until(counters, at + 1, n_kv)


@njit(parallel=True, cache=True, fastmath=True)
def gdn_block(
    x, norm, post_norm, eps, descs, bufs, out_perm, conv_w, conv_state, rec, a_neg, dt_bias,
    gnorm, n_kh, mlp_w, mlp, proj, core, act, int8, workers,
):  # fmt: skip
    """One Gated DeltaNet layer and its MLP for one token, in one parallel loop of `workers`
    iterations that claim each stage's rows, channels or heads (as cpu.decode._layers does):
    x += out_proj(gated_norm(delta_rule(conv(projections(rms_norm(x)))))), then the MLP. The
    conv_state (K-1, C) and the recurrent state rec (nv, dk, dv) are updated in place.
    descs (5, 5): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj as [type, offset,
    row bytes, blocks, rows], bufs their buffers; out_perm: stored column j of out_proj is
    logical column out_perm[j]; mlp (7, 4): cpu.decode's table (GATE, UP, DOWN rows) in mlp_w.
    proj (C + nv dv + 2 nv,), core (nv dv,), act (I,) scratch."""
    n_conv = conv_w.shape[0]
    widest = max(x.shape[0], act.shape[0], proj.shape[0], core.shape[0])
    rows = np.arange(widest)  # every matrix here is stored in order
    counters = np.zeros(STAGES * SLOT, np.int64)
    for _worker in prange(workers):
        h, xs, xq, xf, part = worker_scratch(widest)
        _norm_project(x, norm, eps, descs, bufs, 4, h, xs, xq, xf, int8, proj, rows, part,
                      counters, workers)  # fmt: skip
        _conv_channels(conv_w, conv_state, proj, counters, MIX * SLOT, workers)
        while True:
            head, end = take(counters, HEADS * SLOT, 1, rec.shape[0])
            if head == end:
                break
            _delta_rule_head(head, n_kh, proj, n_conv, rec, a_neg, dt_bias, gnorm, eps, core)
            claim(counters, HEADS * SLOT + 1, 1)
        wait_until(counters, HEADS * SLOT + 1, rec.shape[0])
        stored = h[: core.shape[0]]  # out_proj's input in its stored column order
        for j in range(core.shape[0]):
            stored[j] = core[out_perm[j]]
        prepare_input(stored, xs, xq, xf, int8)
        add_rows(bufs[4], descs[4], rows, stored, xs, xq, xf, int8, x, part[0], counters,
                 OUT_ROWS * SLOT, workers)  # fmt: skip
        mlp_rows(mlp_w, mlp, post_norm, eps, x, h[: x.shape[0]], xs, xq, xf, int8, act, rows,
                 part, counters, GATE_UP_ROWS * SLOT, DOWN_ROWS * SLOT, workers)  # fmt: skip


@njit(parallel=True, cache=True, fastmath=True)
def attention_block(
    x, norm, post_norm, eps, descs, bufs, q_norm, k_norm, cos, sin, pos, kc, vc, mlp_w, mlp,
    proj, qk, att, scores, act, int8, workers,
):  # fmt: skip
    """One gated attention layer (Qwen3.5's Qwen3_5Attention) and its MLP for one token, in one
    parallel loop as gdn_block: x += o_proj(attention(q, k, v) * sigmoid(gate)), writing this
    position's K/V into kc, vc (nkv, cap, hd), then the MLP. descs (4, 5): q_proj (per head hd
    query rows then hd gate rows), k_proj, v_proj, o_proj; q_norm and k_norm are the (1 + w)
    weights. proj (2 nq + 2 nk,), qk (nq + nk,), att (nq,), act (I,) scratch."""
    widest = max(x.shape[0], act.shape[0], proj.shape[0], att.shape[0])
    rows = np.arange(widest)
    counters = np.zeros(STAGES * SLOT, np.int64)
    for _worker in prange(workers):
        h, xs, xq, xf, part = worker_scratch(widest)
        _norm_project(x, norm, eps, descs, bufs, 3, h, xs, xq, xf, int8, proj, rows, part,
                      counters, workers)  # fmt: skip
        _attend_kv_heads(proj, q_norm, k_norm, cos, sin, eps, pos, kc, vc, qk, scores, att,
                         counters, MIX * SLOT)  # fmt: skip
        prepare_input(att, xs, xq, xf, int8)
        add_rows(bufs[3], descs[3], rows, att, xs, xq, xf, int8, x, part[0], counters,
                 OUT_ROWS * SLOT, workers)  # fmt: skip
        mlp_rows(mlp_w, mlp, post_norm, eps, x, h[: x.shape[0]], xs, xq, xf, int8, act, rows,
                 part, counters, GATE_UP_ROWS * SLOT, DOWN_ROWS * SLOT, workers)  # fmt: skip


def warm_up(kv_dtype=FAST_KV_DTYPE) -> None:
    """Load (or compile) both layer kernels with the argument types of real calls, on a tiny
    model of Q8_0 rows 32 wide, the KV cache of `kv_dtype` (cpu.decode.warm_up does the same
    for the shared kernels)."""
    n, rb = 32, BLOCKS[Q8_0][1]
    w = np.zeros(4 * n * rb, np.uint8)  # 128 rows; every matrix reads from its start
    w.flags.writeable = False  # as a GGUF memory map
    f32 = functools.partial(np.zeros, dtype=np.float32)
    mlp = np.zeros((7, 4), np.int64)
    mlp[:, 0], mlp[:, 2], mlp[:, 3] = Q8_0, rb, 1  # gate/up 32 x 32, down 32 x 32
    x, workers = f32(n), 2
    # one key and one value head of 32: conv channels 3 * 32; in_proj_qkv, z, b, a, out_proj
    descs = np.array([[Q8_0, 0, rb, 1, rows] for rows in (3 * n, n, 1, 1, n)], np.int64)
    gdn_block(
        x, f32(n), f32(n), 1e-6, descs, (w,) * 5, np.arange(n), f32((3 * n, 4)),
        f32((3, 3 * n)), f32((1, n, n)), f32(1), f32(1), f32(n), 1, w, mlp, f32(5 * n + 2),
        f32(n), f32(n), True, workers,
    )  # fmt: skip
    # one head of 32 (query and gate: 64 rows), one KV head, 4 cached positions
    descs = np.array([[Q8_0, 0, rb, 1, rows] for rows in (2 * n, n, n, n)], np.int64)
    cache = kv_bits(np.zeros((1, 4, n), kv_dtype))
    attention_block(
        x, f32(n), f32(n), 1e-6, descs, (w,) * 4, f32(n), f32(n), f32(8), f32(8), 0, cache,
        cache.copy(), w, mlp, f32(4 * n), f32(2 * n), f32(n), f32((1, 4)), f32(n), True,
        workers,
    )  # fmt: skip
    # the chunked prefill of the linear-attention layers: two tokens, one head of 32
    q = np.ones((2, 1, n), np.float32)
    gated_delta_rule_chunked(q, q, q, f32((2, 1)), f32((2, 1)), f32((1, n, n)))
