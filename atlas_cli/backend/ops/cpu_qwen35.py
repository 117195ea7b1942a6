"""The fused decode step of Qwen3.5 on the fast CPU path: one numba call per layer.

Op by op, a Qwen3.5 decode step is ~20 numpy and kernel calls per layer (projections, conv,
norms, gates, the recurrent update, the output norm), a third of a 0.8B model's step time on
one core. Here each layer is one call: a Gated DeltaNet layer (`gdn_layer`: its four input
projections, the causal conv, the L2 norms and gates, the gated delta rule on the layer's state
in place, the gated RMSNorm, out_proj) or a gated attention layer (`gated_attention_layer`),
then the MLP (cpu_decode.mlp_block). Same math as the op path (models/qwen3_5.py with
numpy_ref's ops), the same packed weights, the same host `cache.HybridCache`.

Shapes: H hidden size, C conv channels (2 nk dk + nv dv), nk/nv key/value heads of dk/dv
(value head h reads key head h // (nv // nk)), nh/nkv attention heads of dim hd.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from atlas_cli.backend.ops import cpu_decode, cpu_numba
from atlas_cli.backend.ops.cpu_decode import (
    DOWN,
    GATE,
    UP,
    attend_group,
    mlp_block,
    prepare_input,
    rms_norm_into,
    rope_neox,
)
from atlas_cli.backend.ops.cpu_kernels import BLOCKS, GROUP, Q8_0, XF, any_dot, fast_exp

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
        kc[h, pos, :] = qk[nq + h * hd : nq + (h + 1) * hd]
        vc[h, pos, :] = proj[2 * nq + nk + h * hd : 2 * nq + nk + (h + 1) * hd]
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


def warm_up() -> None:
    """Load (or compile) both layer kernels with the argument types of real calls, on a tiny
    model of Q8_0 rows 32 wide (cpu_decode.warm_up does the same for the shared kernels)."""
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
    cache = f32((1, 4, n))
    gated_attention_layer(
        x, f32(n), 1e-6, desc[:4], (w,) * 4, f32(n), f32(n), f32(8), f32(8), 0, cache,
        cache.copy(), f32(4 * n), f32(2 * n), f32(n), f32((1, 4)), f32(n), *scratch, True,
    )  # fmt: skip


# -- the decoder -----------------------------------------------------------------------------

_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _desc(m) -> tuple[int, int, int, int, int]:
    return (m.type_id, m.offset, m.row_bytes, m.blocks_per_row, m.shape[0])


def _buffers(mats) -> tuple[np.ndarray, ...]:
    """The matrices' buffers as one numba type (read-only plain arrays: a GGUF memory map is
    read-only, a reordered copy is not), so that a kernel can index the tuple at run time."""
    views = []
    for m in mats:
        view = np.asarray(m.buf).view(np.ndarray)
        view.flags.writeable = False
        views.append(view)
    return tuple(views)


def _stored_in_order(m, packed_type) -> bool:
    """Whether the kernels can read m's rows at row * row bytes (no row or column order)."""
    return (
        isinstance(m, packed_type)
        and m.in_perm is None
        and np.array_equal(m.perm, np.arange(m.shape[0]))
    )


class FusedQwen35:
    """A Qwen3.5 decode step with one numba call per layer (gdn_layer or gated_attention_layer,
    then mlp_block) on the host HybridCache. Built by `fuse`; reads the same packed weights as
    the op path."""

    def __init__(self, model, layers: list[dict]):
        a = model.args
        self.model, self.layers = model, layers
        self.eps = float(a.rms_norm_eps)
        self.embed = model.w["model.embed_tokens.weight"]
        self.final_norm = _unit_offset(model.w["model.norm.weight"])
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        nv, dv, hd = a.linear_num_value_heads, a.linear_value_head_dim, a.head_dim
        nq, nk = a.num_attention_heads * hd, a.num_key_value_heads * hd
        widest = max(a.hidden_size, a.intermediate_size, nv * dv, nq)
        self.xn = np.empty(a.hidden_size, np.float32)
        self.xs = np.empty(widest // GROUP, np.float32)
        self.xq = np.empty(2 * widest, np.int8)
        self.xf = np.empty(widest // GROUP * XF, np.float32)
        self.act = np.empty(a.intermediate_size, np.float32)
        self.gdn_proj = np.empty(a.conv_channels + nv * dv + 2 * nv, np.float32)
        self.core = np.empty(nv * dv, np.float32)
        self.attn_proj = np.empty(2 * nq + 2 * nk, np.float32)
        self.qk = np.empty(nq + nk, np.float32)
        self.att = np.empty(nq, np.float32)
        self.scores = np.empty((a.num_attention_heads, 0), np.float32)
        # the kernels before the weights are first read, then the compiler's pages let go
        # (as cpu_fast.FusedDecoder)
        if not (cpu_decode.kernels_cached() and cpu_decode.kernels_cached(gdn_layer)):
            cpu_numba.compile_notice()
        cpu_decode.warm_up()
        warm_up()
        cpu_decode.release_compiler_memory()

    def decode(self, token: int, cache, pos: int) -> np.ndarray:
        """One token at position `pos`: updates `cache` (this position's K/V, every linear
        layer's state) and returns the final normed hidden state (1, H)."""
        from atlas_cli.backend.ops import cpu_fast

        int8 = cpu_fast.int8_activations()
        if self.scores.shape[1] < cache.capacity:
            self.scores = np.empty((self.scores.shape[0], cache.capacity), np.float32)
        angles = np.float32(pos) * self.inv_freq  # float32, as numpy_ref.rope
        cos, sin = np.cos(angles), np.sin(angles)
        x = cpu_fast.embedding(self.embed, np.array([token]))[0]
        scratch = (self.xn, self.xs, self.xq, self.xf, int8)
        for i, layer in enumerate(self.layers):
            if "conv_w" in layer:
                state = cache.linear[i]
                gdn_layer(
                    x, layer["norm"], self.eps, layer["descs"], layer["bufs"],
                    layer["out_perm"], layer["conv_w"], state.conv, state.recurrent,
                    layer["a_neg"], layer["dt_bias"], layer["gnorm"], layer["n_kh"],
                    self.gdn_proj, self.xn, self.core, *scratch[1:],
                )  # fmt: skip
            else:
                kv = cache.kv[i]
                gated_attention_layer(
                    x, layer["norm"], self.eps, layer["descs"], layer["bufs"],
                    layer["q_norm"], layer["k_norm"], cos, sin, pos, kv.k, kv.v,
                    self.attn_proj, self.qk, self.att, self.scores, *scratch,
                )  # fmt: skip
            mlp_block(layer["mlp_buf"], layer["mlp"], layer["post_norm"], self.eps, x,
                      self.xn, self.act, *scratch[1:])  # fmt: skip
        out = np.empty_like(x)
        rms_norm_into(x, self.final_norm, self.eps, out)
        return out[None, :]

    def logits_for(self, hidden):
        """The op path's lm_head (models/qwen3_5.py asks the fused step first)."""
        return None


def _unit_offset(w) -> np.ndarray:
    """A (1 + w) norm weight as the plain weight rms_norm_into multiplies by (float32, as
    numpy_ref.rms_norm computes it)."""
    return np.asarray(w, np.float32) + np.float32(1.0)


def fuse(model) -> FusedQwen35 | None:
    """A FusedQwen35 for `model` (a Qwen3_5Model on the fast CPU ops), or None when a weight or
    shape is outside what the kernels take; the model then runs op by op."""
    from atlas_cli.backend.ops.cpu_fast import PackedMatrix

    a, w = model.args, model.w
    hd, nh = a.head_dim, a.num_attention_heads
    widths = (a.hidden_size, a.intermediate_size, a.value_dim, nh * hd)
    if (
        any(n % GROUP for n in widths)
        or hd % 2
        or a.linear_num_value_heads % a.linear_num_key_heads
    ):
        return None
    if 2 * len(model.inv_freq) > hd:
        return None
    layers = []
    for i, kind in enumerate(a.layer_types):
        p = f"model.layers.{i}."
        mlp = [w.get(f"{p}mlp.{n}.weight") for n in _MLP]
        if not all(_stored_in_order(m, PackedMatrix) for m in mlp):
            return None
        if len({m.buf.__array_interface__["data"][0] for m in mlp}) != 1:
            return None  # mlp_block reads the three from one buffer
        table = np.zeros((7, 4), np.int64)  # cpu_decode's layout: rows GATE, UP, DOWN
        for row, m in zip((GATE, UP, DOWN), mlp, strict=True):
            table[row] = _desc(m)[:4]
        layer = {
            "norm": _unit_offset(w[p + "input_layernorm.weight"]),
            "post_norm": _unit_offset(w[p + "post_attention_layernorm.weight"]),
            "mlp": table,
            "mlp_buf": mlp[0].buf,
        }
        if kind == "linear_attention":
            q = p + "linear_attn."
            mats = [w.get(f"{q}{n}.weight") for n in _GDN]
            out = mats[-1]
            if not all(_stored_in_order(m, PackedMatrix) for m in mats[:-1]):
                return None
            if not isinstance(out, PackedMatrix) or not np.array_equal(
                out.perm, np.arange(out.shape[0])
            ):
                return None
            cols = out.shape[1]
            layer |= {
                "descs": np.array([_desc(m) for m in mats], np.int64),
                "bufs": _buffers(mats),
                "out_perm": np.arange(cols) if out.in_perm is None else out.in_perm,
                "conv_w": np.ascontiguousarray(w[q + "conv1d.weight"], np.float32),
                "a_neg": np.ascontiguousarray(w[q + "A"], np.float32),
                "dt_bias": np.ascontiguousarray(w[q + "dt_bias"], np.float32),
                "gnorm": np.ascontiguousarray(w[q + "norm.weight"], np.float32),
                "n_kh": a.linear_num_key_heads,
            }
        else:
            q = p + "self_attn."
            mats = [w.get(f"{q}{n}.weight") for n in _ATTN]
            if not all(_stored_in_order(m, PackedMatrix) for m in mats):
                return None
            if mats[0].shape[0] != 2 * nh * hd or any(
                w.get(f"{q}{n}.bias") is not None for n in _ATTN
            ):
                return None  # ungated or biased attention: the op path
            layer |= {
                "descs": np.array([_desc(m) for m in mats], np.int64),
                "bufs": _buffers(mats),
                "q_norm": _unit_offset(w[q + "q_norm.weight"]),
                "k_norm": _unit_offset(w[q + "k_norm.weight"]),
            }
        layers.append(layer)
    return FusedQwen35(model, layers)
