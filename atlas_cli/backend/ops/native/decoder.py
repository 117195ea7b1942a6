"""The fused decode step of the native backend: one token through every layer in a few fat
launches (kernels/decode.cu), built once per model by `NativeOps.fuse_decoder`.

A `DeviceDecoder` preallocates every activation buffer, reads the token id and the position
from device int32 buffers (`token`, `pos`) and writes into the device cache the op path uses
(native.cache.HybridCache / native.attention.KVCache), so prefix reuse, checkpoints and
truncate keep working. Because no launch takes the position as a number, the launch list of a
cache stays the same from step to step: it is built once, captured as a graph and replayed,
and rebuilt (recaptured) only when the cache's buffers move (a new cache, `reserve` growing
the KV, a state restored from a checkpoint). The per-layer launch list and why: "The fused
decode step" in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.layers import Attention, Declaration, GatedDeltaNet, Layer, LayerKind
from atlas_cli.backend.ops.native.array import DeviceArray, DeviceWeight
from atlas_cli.backend.ops.native.attention import ATTN_HEAD_DIMS, row_kernel_rows
from atlas_cli.backend.ops.native.cache import HybridCache
from atlas_cli.backend.ops.native.runtime import f32, i32, i64, ptr

PRO_NONE, PRO_NORM, PRO_MUL = 0, 1, 2  # decode.cu DG_NONE, DG_NORM, DG_MUL
EPI_STORE, EPI_ADD, EPI_SWIGLU = 0, 1, 2  # decode.cu DG_STORE, DG_ADD, DG_SWIGLU
SEGS_MAX = 4  # decode.cu DG_SEGS
BLOCK_ROWS = 16  # decode.cu DG_BLOCK_ROWS: output rows per dgemv block
MAX_SPLITS = 32  # decode attention's key splits at most (part_o / part_ml hold as many)
ATTN_SPLIT_MIN = 64  # attention.cu ATTN_SPLIT_MIN: fewest keys per split
GDN_DECODE_THREADS = 512  # decode.cu GDN_DEC_THREADS
GDN_DECODE_ROWS = 32  # decode.cu GDN_DEC_RMAX: state rows per thread


@dataclass(frozen=True)
class Launch:
    file: str
    name: str
    grid: tuple
    block: tuple
    args: list


@dataclass(frozen=True)
class Group:
    """Consecutive matrices of one format that one dgemv launch reads as stacked rows."""

    fmt: str
    table: Any  # device int64 (nseg, 6): decode.cu's segment table
    nseg: int
    rows: int
    offset: int  # first output row


def stack(ops, mats: list[DeviceWeight]) -> list[Group]:
    """Matrices of one width stacked by rows, as runs of one format (one dgemv launch each)
    with their device segment tables."""
    assert all(m.cols == mats[0].cols for m in mats)
    runs: list[list[DeviceWeight]] = []
    for m in mats:
        if runs and runs[-1][0].fmt == m.fmt and len(runs[-1]) < SEGS_MAX:
            runs[-1].append(m)
        else:
            runs.append([m])
    out, offset = [], 0
    for run in runs:
        table, end = [], 0
        for m in run:
            end += m.rows
            gs = int(np.array(m.gscale, np.float32).view(np.int32))
            table.append([m.data.ptr, m.scales.ptr, m.row_bytes, m.srow_bytes, end, gs])
        dev = ops.asarray(np.asarray(table, np.int64), np.int64)
        out.append(Group(run[0].fmt, dev, len(run), end, offset))
        offset += end
    return out


def dgemv(
    groups: list[Group],
    rows0: int,
    cols: int,
    x: DeviceArray,
    y: DeviceArray,
    pro: int = PRO_NONE,
    pw: DeviceArray | None = None,
    epi: int = EPI_STORE,
    conv: tuple | None = None,
    xn: DeviceArray | None = None,
    bump: DeviceArray | None = None,
    eps: float = 0.0,
    bias: DeviceArray | None = None,
) -> list[Launch]:
    """The launches of y = W x (W: the stacked `groups`, `cols` wide; `rows0`: the first
    matrix's rows) with the prologue `pro` (x times `pw`: the norm weight, or the sigmoid of
    the gate; PRO_NORM also scales by rsqrt(mean(x^2) + eps)) and epilogue `epi` (EPI_SWIGLU:
    silu(matrix 0) * matrix 1, rows0 rows); `conv` = (weight (C, K), state (K-1, C)) runs the
    Gated DeltaNet conv on the first C rows; `xn` receives the normed x, `bump` is the
    position counter to advance; `bias` (one per stacked row) is added to stored rows
    (decode.cu dgemv_<fmt>)."""
    assert epi != EPI_SWIGLU or pro == PRO_NORM  # decode.cu's one SwiGLU body
    out = []
    for g in groups:
        rows = g.rows if epi != EPI_SWIGLU else rows0
        cw, cs = conv if conv is not None and g.offset == 0 else (None, None)
        crows = cs.shape[1] if cs is not None else 0
        assert crows <= rows and (cs is None or cw.shape[1] - 1 == cs.shape[0])
        args = [ptr(g.table.ptr), i32(g.nseg), ptr(x.ptr), ptr(pw.ptr if pw is not None else 0)]
        args += [i32(pro), f32(eps), i32(epi)]
        args += [ptr(y.ptr + 4 * g.offset), i32(rows), i32(cols)]
        args += [ptr(xn.ptr if xn is not None else 0), ptr(bump.ptr if bump is not None else 0)]
        args += [ptr(cw.ptr if cw is not None else 0), ptr(cs.ptr if cs is not None else 0)]
        args += [i32(crows), i32(cw.shape[1] if cw is not None else 0)]
        args += [ptr(bias.ptr + 4 * g.offset if bias is not None else 0)]
        grid = (-(-rows // BLOCK_ROWS),)
        out.append(Launch("decode.cu", f"dgemv_{g.fmt}", grid, (256,), args))
    return out


def run(ops, launches: list[Launch]) -> None:
    """Launch `launches` in order, directly (no graph)."""
    for launch in launches:
        ops._launch(launch.file, launch.name, launch.grid, launch.block, launch.args)


class DeviceDecoder:
    """One decoded token of a model per `decode` call, its launches built from the model's
    declaration (layers.py): attention and Gated DeltaNet layers, plain or unit-offset
    norms, per-head q/k norms and an output gate as declared."""

    TOKEN_ON_DEVICE = True  # the device sampler writes the next id into `token`

    def __init__(self, ops, model, graph: bool = True):
        d: Declaration = model.declaration
        self.ops, self.model, self.graph, self.decl = ops, model, graph, d
        self.eps = float(d.eps)
        att = d.attention()
        self.h, self.hd = model.w[d.embedding].cols, att.head_dim
        self.nh, self.nkv = att.n_heads, att.n_kv_heads
        # the norm multipliers (w, or 1 + w) and the other vectors on the device, float32
        norms = {d.final_norm} | {n for lay in d.layers for n in _norm_names(lay)}
        self.w = {k: self._vec(v, k in norms) for k, v in model.w.items()
                  if not isinstance(v, DeviceWeight)}  # fmt: skip
        self.biases = {i: self._stacked_bias(lay.mixer) for i, lay in enumerate(d.layers)
                       if isinstance(lay.mixer, Attention)}  # fmt: skip
        self.inv_freq = ops.asarray(np.asarray(model.inv_freq, np.float32))
        self.rot = 2 * int(model.inv_freq.shape[0])
        self._alloc_buffers(d, model.w)
        self._groups: dict[tuple, list[Group]] = {}
        self._key: tuple | None = None
        self._body: list[Launch] = []
        self._graph = None
        self._pos_on_device: int | None = None
        self._token_on_device: int | None = None  # the id `token` holds, when known
        self._slot = 0
        self._last: tuple | None = None
        self.final = [self._final_launch(s) for s in (0, 1)]

    def _vec(self, v, norm: bool) -> DeviceArray:
        """A vector on the device, float32; a norm weight as the multiplier dgemv's prologue
        takes (the declaration's: 1 + w for unit-offset norms). Formed here, at load: read
        back during a decode step it would be a copy to the host the step must not make."""
        if not norm or not self.decl.unit_offset_norms:
            return v if isinstance(v, DeviceArray) else self.ops.asarray(np.asarray(v, np.float32))
        return self.ops.asarray(self.decl.norm_multiplier(_on_host(v)))

    def _stacked_bias(self, m: Attention) -> DeviceArray | None:
        """The q | k | v biases as one device vector beside the stacked rows (zeros for a
        matrix without one), or None when the layer has none: dgemv adds it to the rows."""
        w = self.model.w
        if all(w.get(b) is None for b in m.biases):
            return None
        parts = []
        for name, mat in zip(m.biases, m.inputs, strict=True):
            b = w.get(name)
            if b is None:
                parts.append(np.zeros(w[mat].rows, np.float32))
            else:
                parts.append(_on_host(b))
        return self.ops.asarray(np.concatenate(parts).astype(np.float32))

    def _alloc_buffers(self, d: Declaration, w) -> None:
        ops = self.ops
        self.token = ops.zeros((1,), np.int32)  # the id to decode; device sampling writes here
        self.pos = ops.zeros((1,), np.int32)  # its position = cache length before it
        self.x = ops.zeros((self.h,))  # the residual stream
        self.proj = ops.zeros((max(sum(w[n].rows for n in lay.mixer.inputs) for lay in d.layers),))
        ff = w[d.layers[0].mlp[0]].rows
        self.act, self.gate_tmp, self.up_tmp = (ops.zeros((ff,)) for _ in range(3))
        nq = self.nh * self.hd
        self.q, self.gate, self.attn_out = (ops.zeros((nq,)) for _ in range(3))
        self.part_o = ops.zeros((MAX_SPLITS, nq))  # attention split-K partials (attention.cu)
        self.part_ml = ops.zeros((MAX_SPLITS, self.nh, 2))
        gdn = [lay.mixer for lay in d.layers if lay.kind is LayerKind.GATED_DELTANET]
        if gdn:
            self.gdn_out = ops.zeros((gdn[0].n_v_heads * gdn[0].v_head_dim,))
        vocab = w[d.lm_head].rows
        self.hidden = [ops.zeros((1, self.h)) for _ in range(2)]
        self.logits = [ops.zeros((1, vocab)) for _ in range(2)]

    # -- the step ------------------------------------------------------------------------------

    def decode(self, token: int | None, cache, pos: int) -> DeviceArray:
        """Run the token at position `pos` (an int is uploaded; None: the id already in
        `token`, e.g. sampled on the device) through every layer, writing its K/V and state
        into `cache`; returns the final normed hidden state (1, H). Its logits are computed in
        the same step (`logits_for`). The position is uploaded only when it is not the one
        after the previous step's (the device counter advances itself)."""
        assert 0 <= pos < cache.capacity, f"reserve({pos + 1}) first (capacity {cache.capacity})"
        rt = self.ops.rt
        if token is not None and token != self._token_on_device:
            rt.h2d(self.token.buf, np.asarray([token], np.int32))
            self._token_on_device = token
        if pos != self._pos_on_device:
            rt.h2d(self.pos.buf, np.asarray([pos], np.int32))
        self._pos_on_device = pos + 1
        self._run_body(cache)
        self._slot ^= 1  # two output slots: the previous step's hidden state stays valid
        run(self.ops, [self.final[self._slot]])
        self._last = (self.hidden[self._slot], self.logits[self._slot])
        return self._last[0]

    def new_cache(self, layout, max_len: int) -> None:
        """None: the step reads the ops' device cache (NativeOps.device_cache)."""
        return None

    def use_kv_type(self, name: str) -> None:
        """The device cache's K/V type is the ops' (`NativeOps.with_kv_dtype` chose it before
        the model was built): check that it is `name`."""
        if name != self.ops.kv_dtype:
            raise ValueError(f"the fused step's ops keep K/V as {self.ops.kv_dtype}, not {name}")

    def token_from_device(self, token: int) -> None:
        """The device sampler has copied `token` into `self.token`: the next decode of it needs
        no upload."""
        self._token_on_device = token

    def logits_for(self, hidden) -> DeviceArray | None:
        """The logits computed with `hidden` when it is the last step's output, else None."""
        if self._last is not None and hidden is self._last[0]:
            return self._last[1]
        return None

    def _run_body(self, cache) -> None:
        key = self._cache_key(cache)
        if key != self._key:
            self._body, self._key, self._graph = self._build_body(cache), key, None
        if not self.graph:
            run(self.ops, self._body)
            return
        if self._graph is None:
            fns = [self.ops._fn(launch.file, launch.name) for launch in self._body]
            with self.ops.rt.capture() as graph:
                for fn, launch in zip(fns, self._body, strict=True):
                    self.ops.rt.launch(fn, launch.grid, launch.block, launch.args)
            self._graph = graph
        self._graph.replay()

    def _cache_key(self, cache) -> tuple:
        """What the launch list depends on: the cache's buffers and capacity."""
        kv = device_kv(cache)
        bufs = [b.ptr for pair in kv.layers for b in pair]
        linear = sorted(cache.linear.items()) if isinstance(cache, HybridCache) else []
        states = [(s.conv.ptr, s.recurrent.ptr) for _, s in linear]
        return (id(cache), kv.capacity, tuple(bufs), tuple(states))

    def _build_body(self, cache) -> list[Launch]:
        e = self.model.w[self.decl.embedding]
        out = [
            Launch(
                "embedding.cu",
                f"embedding_{e.fmt}",
                (1,),
                (128,),
                [*self._wargs(e), ptr(self.token.ptr), ptr(self.x.ptr), i32(e.cols)]
                + [i64(e.row_bytes), i64(e.srow_bytes)],
            )
        ]
        for i, layer in enumerate(self.decl.layers):
            if layer.kind is LayerKind.GATED_DELTANET:
                out += self._gdn_layer(i, layer, cache)
            else:
                out += self._attn_layer(i, layer, cache)
            out += self._mlp(layer)
        return out

    def _wargs(self, w: DeviceWeight) -> list:
        return [ptr(w.data.ptr), ptr(w.scales.ptr), f32(w.gscale)]

    # -- the GEMV with its prologue and epilogue (decode.cu dgemv_<fmt>) -----------------------

    def groups(self, names: tuple[str, ...]) -> list[Group]:
        """The matrices `names`, stacked by rows, as runs of one format (one launch each)."""
        if names not in self._groups:
            self._groups[names] = stack(self.ops, [self.model.w[n] for n in names])
        return self._groups[names]

    def gemv(self, names: tuple[str, ...], x: DeviceArray, y: DeviceArray, *args, **kw):
        """dgemv (below) of the matrices `names` stacked by rows."""
        w = self.model.w[names[0]]
        return dgemv(self.groups(names), w.rows, w.cols, x, y, *args, eps=self.eps, **kw)

    def _mlp(self, layer: Layer) -> list[Launch]:
        norm = self.w[layer.post_norm]
        gate, up, down = layer.mlp
        out = []
        if len(self.groups((gate, up))) == 1:  # one format: silu(gate) * up in the epilogue
            out += self.gemv((gate, up), self.x, self.act, PRO_NORM, norm, EPI_SWIGLU)
        else:
            out += self.gemv((gate,), self.x, self.gate_tmp, PRO_NORM, norm)
            out += self.gemv((up,), self.x, self.up_tmp, PRO_NORM, norm)
            n = self.act.size
            args = [ptr(self.gate_tmp.ptr), ptr(self.up_tmp.ptr), ptr(self.act.ptr), i64(n)]
            out.append(Launch("elementwise.cu", "silu_mul", (-(-n // 256),), (256,), args))
        return out + self.gemv((down,), self.act, self.x, epi=EPI_ADD)

    # -- the mixers ---------------------------------------------------------------------------

    def _gdn_layer(self, i: int, layer: Layer, cache) -> list[Launch]:
        m: GatedDeltaNet = layer.mixer
        state = cache.linear[i]
        norm = self.w[layer.input_norm]
        conv = (self.w[m.conv], state.conv)
        out = self.gemv(m.inputs, self.x, self.proj, PRO_NORM, norm, conv=conv)
        weights = (self.w[m.decay], self.w[m.dt_bias], self.w[m.norm])
        out.append(gdn_decode(self.proj, *weights, state.recurrent, self.gdn_out, m, self.eps))
        return out + self.gemv((m.output,), self.gdn_out, self.x, epi=EPI_ADD)

    def _attn_layer(self, i: int, layer: Layer, cache) -> list[Launch]:
        m: Attention = layer.mixer
        nh, nkv, hd = self.nh, self.nkv, self.hd
        kv = device_kv(cache)
        kb, vb = kv.layers[kv_slot(cache, i)]
        gated = m.output_gate and self.model.w[m.inputs[0]].rows == 2 * nh * hd
        norm = self.w[layer.input_norm]
        out = self.gemv(m.inputs, self.x, self.proj, PRO_NORM, norm, bias=self.biases[i])
        qn = self.w[m.q_norm].ptr if m.q_norm is not None else 0
        kn = self.w[m.k_norm].ptr if m.k_norm is not None else 0
        unit = int(self.decl.unit_offset_norms)  # the kernel forms the q/k norms' 1 + w
        args = [ptr(self.proj.ptr), ptr(qn), ptr(kn)]
        args += [i32(unit), f32(self.eps), ptr(self.inv_freq.ptr), i32(self.rot)]
        args += [ptr(self.pos.ptr), ptr(self.q.ptr), ptr(self.gate.ptr)]
        args += [ptr(kb.ptr), ptr(vb.ptr), f32(kv.k_scale), f32(kv.v_scale)]
        args += [i32(nh), i32(nkv), i32(hd), i32(kv.capacity), i32(int(gated))]
        out.append(Launch("decode.cu", f"qk_rope_kv_{kv.dtype}", (nh + 2 * nkv,), (128,), args))
        out += self._attention(kv, kb, vb)
        gate = (PRO_MUL, self.gate) if gated else (PRO_NONE, None)  # x * sigmoid(gate)
        return out + self.gemv((m.output,), self.attn_out, self.x, *gate, EPI_ADD)

    def _attention(self, kv, kb, vb) -> list[Launch]:
        parts = (self.part_o, self.part_ml)
        return decode_attention(self.q, kb, vb, kv, self.pos, self.attn_out, parts, self.nh)

    def _final_launch(self, slot: int) -> Launch:
        """The final norm fused into the lm_head GEMV, which also writes the normed hidden
        state and advances the position counter."""
        (launch,) = self.gemv(
            (self.decl.lm_head,),
            self.x,
            self.logits[slot],
            PRO_NORM,
            self.w[self.decl.final_norm],
            xn=self.hidden[slot],
            bump=self.pos,
        )
        return launch


def supports(model) -> bool:
    """Whether `DeviceDecoder` runs `model` (a model with a declaration whose matrices are on
    the device in shapes the kernels take); otherwise the model runs op by op."""
    d: Declaration | None = getattr(model, "declaration", None)  # anything else: op by op
    if d is None:
        return False
    w = model.w
    mats = [d.embedding, d.lm_head]
    mats += [n for lay in d.layers for n in (*lay.mixer.inputs, lay.mixer.output, *lay.mlp)]
    if not all(isinstance(w.get(n), DeviceWeight) for n in mats):
        return False
    for layer in d.layers:
        m = layer.mixer
        if isinstance(m, Attention):
            if m.head_dim not in ATTN_HEAD_DIMS or m.head_dim > 256:
                return False
        elif not _gdn_fits(m):
            return False
    return True


def decode_attention(q, kb, vb, kv, pos, out, parts, nh: int) -> list[Launch]:
    """attention.cu's decode attention of q (nh, hd) over the cache buffers kb, vb of KVCache
    `kv`, its length read from `pos` on the device. The splits of the keys follow that length
    (split_len 0: up to MAX_SPLITS of at least 64 keys), so a list captured for the cache's
    capacity spreads a short context over every split. parts: (part_o, part_ml) buffers for
    MAX_SPLITS partials."""
    nkv, hd, cap = kv.nkv, kv.hd, kv.capacity
    nsplit = 1 if nh >= 256 else max(1, min(MAX_SPLITS, cap // ATTN_SPLIT_MIN))
    part_o, part_ml = parts if nsplit > 1 else (out, out)
    args = [ptr(q.ptr), ptr(kb.ptr), ptr(vb.ptr), f32(kv.k_scale), f32(kv.v_scale)]
    args += [ptr(out.ptr), ptr(part_o.ptr), ptr(part_ml.ptr), i32(1), i32(nh), i32(nkv)]
    args += [i32(cap), i32(0), ptr(pos.ptr), i32(0 if nsplit > 1 else cap)]
    g = nh // nkv
    rows = row_kernel_rows(1, g)
    grid = (-(-g // rows), nkv, nsplit)
    launches = [Launch("attention.cu", f"attn_{kv.dtype}_hd{hd}", grid, (32 * rows,), args)]
    if nsplit > 1:
        args = [ptr(part_o.ptr), ptr(part_ml.ptr), ptr(out.ptr), i32(nsplit), i32(nh)]
        launches.append(Launch("attention.cu", "attn_combine", (nh,), (128,), [*args, i32(hd)]))
    return launches


def gdn_decode(proj, decay, dt_bias, norm, state, out, m: GatedDeltaNet, eps: float) -> Launch:
    """decode.cu gdn_decode for layer mixer `m`: proj (the conv'd q|k|v, z, b, a) and the
    recurrent state (in place) -> out (nv * dv)."""
    nk, dk, nv, dv = m.n_k_heads, m.k_head_dim, m.n_v_heads, m.v_head_dim
    args = [ptr(proj.ptr), ptr(decay.ptr), ptr(dt_bias.ptr), ptr(state.ptr), ptr(norm.ptr)]
    args += [ptr(out.ptr), i32(nk), i32(nv), i32(dk), i32(dv), f32(dk**-0.5), f32(eps)]
    return Launch("decode.cu", "gdn_decode", (nv,), (GDN_DECODE_THREADS,), args)


def _gdn_fits(m: GatedDeltaNet) -> bool:
    """decode.cu gdn_decode's limits: a value head's columns times its parts of
    GDN_DECODE_ROWS state rows within one block, dk and dv <= 256, conv taps <= 8."""
    dk, dv = m.k_head_dim, m.v_head_dim
    parts = -(-dk // GDN_DECODE_ROWS)
    return dk <= 256 and dv <= 256 and parts * dv <= GDN_DECODE_THREADS and m.conv_kernel <= 8


def _on_host(v) -> np.ndarray:
    """A weight vector as a host array (read back from the device at load, never in a step)."""
    return v.numpy() if isinstance(v, DeviceArray) else np.asarray(v)


def device_kv(cache):
    """The device KVCache of a native KVCache or HybridCache."""
    return cache.device_kv if isinstance(cache, HybridCache) else cache


def kv_slot(cache, layer: int) -> int:
    """Where attention layer `layer` lives in `device_kv(cache)`."""
    return cache.slot[layer] if isinstance(cache, HybridCache) else layer


def _norm_names(layer: Layer) -> tuple[str, str]:
    """The norms dgemv's prologue multiplies by (the q/k norms go raw to qk_rope_kv, which
    forms 1 + w itself)."""
    return layer.input_norm, layer.post_norm
