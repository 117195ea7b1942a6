"""The fused decode step of Qwen3.5 on the fast CPU path: one numba call per layer.

Op by op, a Qwen3.5 decode step is ~20 numpy and kernel calls per layer (projections, conv,
norms, gates, the recurrent update, the output norm), a third of a 0.8B model's step time on
one core. Here each layer is one call: a Gated DeltaNet layer (`gdn_layer`: its four input
projections, the causal conv, the L2 norms and gates, the gated delta rule on the layer's state
in place, the gated RMSNorm, out_proj) or a gated attention layer (`gated_attention_layer`),
then the MLP (cpu_decode.mlp_block). Same math as the op path (models/qwen3_5.py with
numpy_ref's ops), the same packed weights, the same host `cache.HybridCache`. The decoder
that drives them layer by layer is `cpu_fast.FusedQwen35`.

Shapes: H hidden size, C conv channels (2 nk dk + nv dv), nk/nv key/value heads of dk/dv
(value head h reads key head h // (nv // nk)), nh/nkv attention heads of dim hd.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from atlas_cli.backend.cache import FAST_KV_DTYPE
from atlas_cli.backend.ops import cpu_numba
from atlas_cli.backend.ops.cpu_decode import (
    attend_group,
    prepare_input,
    rms_norm_into,
    rope_neox,
)
from atlas_cli.backend.ops.cpu_gdn import gated_delta_rule_chunked
from atlas_cli.backend.ops.cpu_kernels import (
    BLOCKS,
    GROUP,
    Q8_0,
    XF,
    any_dot,
    fast_exp,
    kv_bits,
    kv_store,
)

cpu_numba.configure()

from numba import njit, prange  # noqa: E402

L2_EPS = 1e-6  # numpy_ref.l2norm's (FLA's and transformers')


@njit(cache=True, fastmath=True, inline="always")
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + fast_exp(-v))


@njit(cache=True, fastmath=True, inline="always")
def _softplus(v):
    """log(1 + exp(v)) without overflow (numpy_ref.softplus: logaddexp(0, v))."""
    return max(v, np.float32(0.0)) + np.log1p(np.exp(-abs(v)))


@njit(parallel=True, cache=True, fastmath=True)
def _project(descs, bufs, n_mats, xn, xs, xq, xf, int8, out):
    """out = the products with xn of the rows of the first n_mats matrices (descs[i]: [type,
    offset, row bytes, blocks, rows] in bufs[i]), matrix i's rows after matrix i - 1's."""
    ends = np.empty(n_mats, np.int64)
    total = 0
    for i in range(n_mats):
        total += descs[i, 4]
        ends[i] = total
    for r in prange(total):
        i = 0
        while r >= ends[i]:
            i += 1
        row = r - (ends[i] - descs[i, 4])
        d = descs[i]
        out[r] = any_dot(int8, d[0], bufs[i], d[1] + row * d[2], xn, xs, xq, xf, d[3])


@njit(parallel=True, cache=True, fastmath=True)
def gdn_layer(
    x, norm, eps, descs, bufs, out_perm, conv_w, conv_state, rec, a_neg, dt_bias, gnorm,
    n_kh, proj, xn, core, xs, xq, xf, int8,
):  # fmt: skip
    """x += out_proj(gated_norm(delta_rule(conv(projections(rms_norm(x)))))) for one Gated
    DeltaNet layer, updating its conv_state (K-1, C) and recurrent state rec (nv, dk, dv) in
    place. descs (5, 5): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj as
    [type, offset, row bytes, blocks, rows], bufs their buffers; out_perm: stored column j of
    out_proj is logical column out_perm[j]. proj (C + nv dv + 2 nv,), core (nv dv,) scratch."""
    n_vh, dk, dv = rec.shape
    n_conv = conv_w.shape[0]
    taps = conv_w.shape[1]
    hidden = x.shape[0]
    rms_norm_into(x, norm, eps, xn)
    prepare_input(xn, xs, xq, xf, int8)
    _project(descs, bufs, 4, xn, xs, xq, xf, int8, proj)

    for c in prange(n_conv):  # depthwise causal conv over (state..., this token), then SiLU
        acc = np.float32(0.0)
        for j in range(taps - 1):
            acc += conv_w[c, j] * conv_state[j, c]
        acc += conv_w[c, taps - 1] * proj[c]
        for j in range(taps - 2):
            conv_state[j, c] = conv_state[j + 1, c]
        conv_state[taps - 2, c] = proj[c]
        proj[c] = acc * _sigmoid(acc)

    z0 = n_conv
    b0 = z0 + n_vh * dv
    a0 = b0 + n_vh
    ratio = n_vh // n_kh
    scale = np.float32(1.0 / math.sqrt(dk))
    for h in prange(n_vh):
        kh = h // ratio
        q = proj[kh * dk : (kh + 1) * dk]
        k = proj[(n_kh + kh) * dk : (n_kh + kh + 1) * dk]
        v = proj[2 * n_kh * dk + h * dv : 2 * n_kh * dk + (h + 1) * dv]
        qq = np.float32(0.0)
        kk = np.float32(0.0)
        for i in range(dk):
            qq += q[i] * q[i]
            kk += k[i] * k[i]
        q_scale = scale / np.sqrt(qq + np.float32(L2_EPS))
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

    stored = np.empty_like(core)  # out_proj's input in its stored column order
    for j in range(core.shape[0]):
        stored[j] = core[out_perm[j]]
    prepare_input(stored, xs, xq, xf, int8)
    d = descs[4]
    for r in prange(hidden):
        x[r] += any_dot(int8, d[0], bufs[4], d[1] + r * d[2], stored, xs, xq, xf, d[3])


@njit(parallel=True, cache=True, fastmath=True)
def gated_attention_layer(
    x, norm, eps, descs, bufs, q_norm, k_norm, cos, sin, pos, kc, vc, proj, qk, att, scores,
    xn, xs, xq, xf, int8,
):  # fmt: skip
    """x += o_proj(attention(q, k, v) * sigmoid(gate)) for one gated attention layer (Qwen3.5's
    Qwen3_5Attention), writing this position's K/V into kc, vc (nkv, cap, hd). descs (4, 5):
    q_proj (per head hd query rows then hd gate rows), k_proj, v_proj, o_proj; q_norm and
    k_norm are the (1 + w) weights. proj (2 nq + 2 nk,), qk (nq + nk,) scratch."""
    n_kv, hd = kc.shape[0], kc.shape[2]
    n_heads = scores.shape[0]
    nq, nk = n_heads * hd, n_kv * hd
    group = n_heads // n_kv
    hidden = x.shape[0]
    rms_norm_into(x, norm, eps, xn)
    prepare_input(xn, xs, xq, xf, int8)
    _project(descs, bufs, 3, xn, xs, xq, xf, int8, proj)
    for h in range(n_heads):
        rms_norm_into(proj[2 * h * hd : (2 * h + 1) * hd], q_norm, eps, qk[h * hd : (h + 1) * hd])
    for h in range(n_kv):
        src = proj[2 * nq + h * hd : 2 * nq + (h + 1) * hd]
        rms_norm_into(src, k_norm, eps, qk[nq + h * hd : nq + (h + 1) * hd])
    rope_neox(qk[:nq], n_heads, hd, cos, sin)
    rope_neox(qk[nq:], n_kv, hd, cos, sin)
    for h in range(n_kv):
        kv_store(kc[h, pos], qk[nq + h * hd : nq + (h + 1) * hd])
        kv_store(vc[h, pos], proj[2 * nq + nk + h * hd : 2 * nq + nk + (h + 1) * hd])
    inv_sqrt = np.float32(1.0 / math.sqrt(hd))
    for kvh in prange(n_kv):
        h0 = kvh * group
        attend_group(
            qk[h0 * hd : (h0 + group) * hd],
            kc[kvh],
            vc[kvh],
            pos + 1,
            inv_sqrt,
            scores[h0 : h0 + group],
            att[h0 * hd : (h0 + group) * hd],
        )
    for h in range(n_heads):
        for d in range(hd):
            att[h * hd + d] *= _sigmoid(proj[(2 * h + 1) * hd + d])
    prepare_input(att, xs, xq, xf, int8)
    d = descs[3]
    for r in prange(hidden):
        x[r] += any_dot(int8, d[0], bufs[3], d[1] + r * d[2], att, xs, xq, xf, d[3])


def warm_up(kv_dtype=FAST_KV_DTYPE) -> None:
    """Load (or compile) both layer kernels with the argument types of real calls, on a tiny
    model of Q8_0 rows 32 wide, the KV cache of `kv_dtype` (cpu_decode.warm_up does the same
    for the shared kernels)."""
    n, rb = 32, BLOCKS[Q8_0][1]
    w = np.zeros(4 * n * rb, np.uint8)
    w.flags.writeable = False  # as a GGUF memory map
    f32 = functools.partial(np.zeros, dtype=np.float32)
    desc = np.array([[Q8_0, 0, rb, 1, n]] * 5, np.int64)
    widest, x = 3 * n, f32(n)
    scratch = (f32(widest // GROUP), np.zeros(2 * widest, np.int8), f32(widest // GROUP * XF))
    # one key and one value head of 32: conv channels 3 * 32
    gdn_layer(
        x, f32(n), 1e-6, desc, (w,) * 5, np.arange(n), f32((3 * n, 4)), f32((3, 3 * n)),
        f32((1, n, n)), f32(1), f32(1), f32(n), 1, f32(5 * n), f32(n), f32(n), *scratch, True,
    )  # fmt: skip
    # one head of 32 (query and gate: 64 rows), one KV head, 4 cached positions
    cache = kv_bits(np.zeros((1, 4, n), kv_dtype))
    gated_attention_layer(
        x, f32(n), 1e-6, desc[:4], (w,) * 4, f32(n), f32(n), f32(8), f32(8), 0, cache,
        cache.copy(), f32(4 * n), f32(2 * n), f32(n), f32((1, 4)), f32(n), *scratch, True,
    )  # fmt: skip
    # the chunked prefill of the linear-attention layers: two tokens, one head of 32
    q = np.ones((2, 1, n), np.float32)
    gated_delta_rule_chunked(q, q, q, f32((2, 1)), f32((2, 1)), f32((1, n, n)))
