"""The fast CPU path's fused decode steps, built from a model's declaration (layers.py).

Which step a model gets follows from what its layers are, never from its name:

- every layer plain attention (no output gate): `FusedDecoder`, all layers of a token in one
  numba call (decode.decode_step), q/k/v biases and per-head q/k norms as declared;
- otherwise `FusedLayers`, one numba call per layer and its MLP: blocks.gdn_block for a Gated
  DeltaNet layer, blocks.attention_block for a gated attention layer with q/k norms.

Norm weights go in as the multiplier the declaration states (w, or 1 + w). A weight the
kernels cannot read (a format without a kernel, rows stored out of order, matrices in several
buffers) or a layer neither step takes returns None: the model then runs op by op.
"""

from __future__ import annotations

import numba
import numpy as np

from atlas_cli.backend.cache import FAST_KV_DTYPE, HOST_KV_TYPES, HybridCache, StackedKVCache
from atlas_cli.backend.layers import Attention, CacheLayout, Declaration, LayerKind
from atlas_cli.backend.ops import numpy_ref as _ref
from atlas_cli.backend.ops.cpu import blocks as _blocks
from atlas_cli.backend.ops.cpu import decode as _d
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu import kernels as _k
from atlas_cli.backend.ops.cpu.packed import (
    PackedMatrix,
    address,
    gather,
    int8_activations,
    stored_in_order,
)


def fuse_decoder(model) -> FusedDecoder | FusedLayers | None:
    """The fused decode step for `model`'s declared layers, or None (op by op)."""
    d: Declaration = model.declaration
    if all(lay.kind is LayerKind.ATTENTION and not lay.mixer.output_gate for lay in d.layers):
        return _fuse_all_layers(model)
    return _fuse_layer_by_layer(model)


class _HostStep:
    """What both steps share: the kernels loaded before the weights are first read, then the
    JIT compiler's pages let go, so the two are never resident together (docs/performance.md);
    the K/V type of the caches it builds; how many workers its parallel loops take."""

    warm_ups: tuple = (_d.warm_up,)
    TOKEN_ON_DEVICE = False  # the host's step: every token comes as an int

    def _load_kernels(self, *others) -> None:
        """Load decode.py's kernels and `others` (from numba's disk cache, or compiled with a
        notice)."""
        self.kv_dtype = FAST_KV_DTYPE
        self.workers = None  # iterations of each parallel loop; None: the threads
        if not (_d.kernels_cached() and all(_d.kernels_cached(k) for k in others)):
            jit.compile_notice()
        for warm_up in self.warm_ups:
            warm_up(self.kv_dtype)
        _d.release_compiler_memory()

    def use_kv_type(self, name: str) -> None:
        """Make the caches this step builds hold K/V as `name` (cache.HOST_KV_TYPES; f16 by
        default, f32 with float32 activations is the path closest to the reference); on a
        change, load the kernels for that type, then let go of the compiler's pages again."""
        dtype = np.dtype(HOST_KV_TYPES[name])
        if dtype != self.kv_dtype:
            self.kv_dtype = dtype
            for warm_up in self.warm_ups:
                warm_up(dtype)
            _d.release_compiler_memory()

    def logits_for(self, hidden):
        """The op path's lm_head computes the logits (models/base.py asks the fused step)."""
        return None


# -- every layer attention: one call per token -------------------------------------------------


class FusedDecoder(_HostStep):
    """All layers of an attention-only decoder for one token per numba call
    (decode.decode_step). Reads the same packed weights as the op path."""

    def __init__(self, model, buf: np.ndarray, mats: list[list[PackedMatrix]]):
        d: Declaration = model.declaration
        w, att = model.w, d.attention()
        n_layers, hd = len(d.layers), att.head_dim
        self.n_layers, self.n_kv, self.head_dim = n_layers, att.n_kv_heads, hd
        self.n_heads = att.n_heads
        nq, nk = self.n_heads * hd, self.n_kv * hd
        self.buf = buf
        # (L, 7, 4): q, k, v, o, gate, up, down as [type, offset, row bytes, blocks per row]
        self.mats = np.array(
            [[(m.type_id, m.offset, m.row_bytes, m.blocks_per_row) for m in row] for row in mats],
            np.int64,
        )
        self.perm_q, self.perm_k = mats[0][_d.Q].perm, mats[0][_d.K].perm
        e = w[d.embedding]
        self.embed = np.array([e.type_id, e.offset, e.row_bytes, e.blocks_per_row], np.int64)
        self.embed_perm = e.perm
        norms = [[d.norm_multiplier(w[lay.input_norm]), d.norm_multiplier(w[lay.post_norm])]
                 for lay in d.layers]  # fmt: skip
        self.norms = np.array(norms, np.float32)  # (L, 2, H)
        self.final_norm = d.norm_multiplier(w[d.final_norm])
        # q/k/v biases (zeros when absent) and q/k norms, one row per layer
        self.bias = np.zeros((n_layers, nq + 2 * nk), np.float32)
        self.qk_norm = np.ones((n_layers, 2, hd), np.float32)
        spans = ((0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk))
        for i, layer in enumerate(d.layers):
            m: Attention = layer.mixer
            for name, (lo, hi) in zip(m.biases, spans, strict=True):
                if w.get(name) is not None:
                    self.bias[i, lo:hi] = w[name]
            if m.q_norm is not None:
                self.qk_norm[i] = (d.norm_multiplier(w[m.q_norm]), d.norm_multiplier(w[m.k_norm]))
        self.use_qk_norm = att.q_norm is not None
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        self.eps = float(d.eps)
        # buffers reused by every step (scores grows with the cache)
        self.qkv = np.empty(nq + 2 * nk, np.float32)
        self.act = np.empty(mats[0][_d.GATE].shape[0], np.float32)
        self.x = np.empty(e.shape[1], np.float32)
        self.scores = np.empty((self.n_heads, 0), np.float32)
        self._load_kernels()

    def new_cache(self, layout: CacheLayout, max_len: int) -> StackedKVCache:
        return StackedKVCache(self.n_layers, self.n_kv, self.head_dim, max_len, self.kv_dtype)

    def decode(self, token: int, cache: StackedKVCache, pos: int) -> np.ndarray:
        """Run one token at position `pos` (its K/V land in `cache`); returns the final normed
        hidden state (1, H)."""
        if self.scores.shape[1] < cache.capacity:
            self.scores = np.empty((self.n_heads, cache.capacity), np.float32)
        out = np.empty(self.x.shape[0], np.float32)
        _d.decode_step(
            self.buf, self.mats, self.perm_q, self.perm_k, self.embed,
            int(self.embed_perm[token]), pos, self.norms, self.final_norm, self.bias,
            self.qk_norm, self.use_qk_norm, self.inv_freq, self.eps, _k.kv_bits(cache.k),
            _k.kv_bits(cache.v),
            self.qkv, self.act, self.scores, self.x, out, int8_activations(),
            self.workers or numba.get_num_threads(),
        )  # fmt: skip
        return out[None, :]


def _fuse_all_layers(model) -> FusedDecoder | None:
    d: Declaration = model.declaration
    att = d.attention()
    hd = att.head_dim
    e = model.w.get(d.embedding)
    if not isinstance(e, PackedMatrix) or e.in_perm is not None:
        return None
    if e.shape[1] % _k.GROUP or hd % 2 or 2 * len(model.inv_freq) != hd:
        return None
    names = [[*lay.mixer.inputs, lay.mixer.output, *lay.mlp] for lay in d.layers]
    mats = [[model.w.get(n) for n in row] for row in names]
    flat = [m for row in mats for m in row]
    if not all(isinstance(m, PackedMatrix) and m.in_perm is None for m in flat):
        return None
    buf = e.buf
    if any(address(m.buf) != address(buf) or m.buf.size != buf.size for m in flat):
        return None  # decode_step reads every weight from one buffer
    for row in mats:
        for j, m in enumerate(row):
            # q and k rows may be permuted (the same way in every layer); decode_step reads
            # the rest in stored order
            ref = {_d.Q: mats[0][_d.Q].perm, _d.K: mats[0][_d.K].perm}.get(j)
            if not (stored_in_order(m) if ref is None else np.array_equal(m.perm, ref)):
                return None
    inter = mats[0][_d.GATE].shape[0]
    if inter % _k.GROUP or (att.n_heads * hd) % _k.GROUP:
        return None
    return FusedDecoder(model, buf, mats)


# -- one call per layer: Gated DeltaNet and gated attention layers -----------------------------


class FusedLayers(_HostStep):
    """A decode step of one numba call per layer and its MLP (blocks.gdn_block or
    blocks.attention_block) on the host HybridCache. Reads the same packed weights as the op
    path."""

    warm_ups = (_d.warm_up, _blocks.warm_up)

    def __init__(self, model, layers: list[dict]):
        d: Declaration = model.declaration
        self.layers = layers
        self.eps = float(d.eps)
        self.embed = model.w[d.embedding]
        self.final_norm = d.norm_multiplier(model.w[d.final_norm])
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        self.gdn_proj = np.empty(max(lay.get("proj_rows", 0) for lay in layers), np.float32)
        self.core = np.empty(max(lay.get("core", 0) for lay in layers), np.float32)
        att = d.attention()
        nh, nq, nk = att.n_heads, att.n_heads * att.head_dim, att.n_kv_heads * att.head_dim
        self.attn_proj = np.empty(2 * nq + 2 * nk, np.float32)
        self.qk = np.empty(nq + nk, np.float32)
        self.att = np.empty(nq, np.float32)
        self.scores = np.empty((nh, 0), np.float32)
        self.act = np.empty(layers[0]["act"], np.float32)
        self._load_kernels(_blocks.gdn_block)

    def new_cache(self, layout: CacheLayout, max_len: int) -> HybridCache:
        """The host HybridCache of `layout`, K/V as `kv_dtype`."""
        return HybridCache(layout, max_len, kv_dtype=self.kv_dtype)

    def decode(self, token: int, cache, pos: int) -> np.ndarray:
        """One token at position `pos`: updates `cache` (this position's K/V, every linear
        layer's state) and returns the final normed hidden state (1, H)."""
        int8 = int8_activations()
        workers = self.workers or numba.get_num_threads()
        if self.scores.shape[1] < cache.capacity:
            self.scores = np.empty((self.scores.shape[0], cache.capacity), np.float32)
        angles = np.float32(pos) * self.inv_freq  # float32, as numpy_ref.rope
        cos, sin = np.cos(angles), np.sin(angles)
        ids, table = np.array([token]), self.embed
        x = (gather(table, ids) if isinstance(table, PackedMatrix) else _ref.embedding(table, ids))[
            0
        ]
        for i, layer in enumerate(self.layers):
            if layer["kind"] is LayerKind.GATED_DELTANET:
                state = cache.linear[i]
                _blocks.gdn_block(
                    x, layer["norm"], layer["post_norm"], self.eps, layer["descs"],
                    layer["bufs"], layer["out_perm"], layer["conv_w"], state.conv,
                    state.recurrent, layer["a_neg"], layer["dt_bias"], layer["gnorm"],
                    layer["n_kh"], layer["mlp_buf"], layer["mlp"], self.gdn_proj, self.core,
                    self.act, int8, workers,
                )  # fmt: skip
            else:
                kv = cache.kv[i]
                _blocks.attention_block(
                    x, layer["norm"], layer["post_norm"], self.eps, layer["descs"],
                    layer["bufs"], layer["q_norm"], layer["k_norm"], cos, sin, pos,
                    _k.kv_bits(kv.k), _k.kv_bits(kv.v), layer["mlp_buf"], layer["mlp"],
                    self.attn_proj, self.qk, self.att, self.scores, self.act, int8, workers,
                )  # fmt: skip
        out = np.empty_like(x)
        _d.rms_norm_into(x, self.final_norm, self.eps, out)
        return out[None, :]


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


def _f32(w) -> np.ndarray:
    return np.ascontiguousarray(w, np.float32)


def _fuse_layer_by_layer(model) -> FusedLayers | None:
    d: Declaration = model.declaration
    if model.w[d.embedding].shape[1] % _k.GROUP:
        return None
    layers = []
    for layer in d.layers:
        fused = _fused_layer(model, layer)
        if fused is None:
            return None
        layers.append(fused)
    return FusedLayers(model, layers)


def _fused_layer(model, layer) -> dict | None:
    """What gdn_block or attention_block reads of `layer`, or None when it takes no such
    layer: its norms, its MLP's table and buffer, and its mixer's weights."""
    d, w = model.declaration, model.w
    mlp = [w.get(n) for n in layer.mlp]
    if not all(stored_in_order(m) for m in mlp) or len({address(m.buf) for m in mlp}) != 1:
        return None  # the MLP stages read the three from one buffer, in stored order
    if mlp[0].shape[0] % _k.GROUP:
        return None
    table = np.zeros((7, 4), np.int64)  # decode.py's layout: rows GATE, UP, DOWN
    for row, m in zip((_d.GATE, _d.UP, _d.DOWN), mlp, strict=True):
        table[row] = _desc(m)[:4]
    out = {
        "kind": layer.kind,
        "norm": d.norm_multiplier(w[layer.input_norm]),
        "post_norm": d.norm_multiplier(w[layer.post_norm]),
        "mlp": table,
        "mlp_buf": _buffers(mlp[:1])[0],
        "act": mlp[0].shape[0],
    }
    mixer = layer.mixer
    if layer.kind is LayerKind.GATED_DELTANET:
        return _gdn_weights(mixer, w, out)
    return _gated_attention_weights(model, mixer, out)


def _gdn_weights(m, w, out: dict) -> dict | None:
    mats = [w.get(n) for n in (*m.inputs, m.output)]
    proj = mats[-1]
    if not all(stored_in_order(x) for x in mats[:-1]) or m.n_v_heads % m.n_k_heads:
        return None
    if not isinstance(proj, PackedMatrix) or not np.array_equal(
        proj.perm, np.arange(proj.shape[0])
    ):
        return None  # out_proj's columns may be permuted (gdn_block gathers its input)
    value_dim = m.n_v_heads * m.v_head_dim
    if value_dim % _k.GROUP:
        return None
    cols = proj.shape[1]
    return out | {
        "descs": np.array([_desc(x) for x in mats], np.int64),
        "bufs": _buffers(mats),
        "out_perm": np.arange(cols) if proj.in_perm is None else proj.in_perm,
        "conv_w": _f32(w[m.conv]),
        "a_neg": _f32(w[m.decay]),
        "dt_bias": _f32(w[m.dt_bias]),
        "gnorm": _f32(w[m.norm]),
        "n_kh": m.n_k_heads,
        "proj_rows": m.conv_channels + value_dim + 2 * m.n_v_heads,
        "core": value_dim,
    }


def _gated_attention_weights(model, m: Attention, out: dict) -> dict | None:
    """attention_block's weights: it takes gated attention with q/k norms and no biases."""
    d, w = model.declaration, model.w
    hd, nh = m.head_dim, m.n_heads
    mats = [w.get(n) for n in (*m.inputs, m.output)]
    if not all(stored_in_order(x) for x in mats) or m.q_norm is None:
        return None
    if mats[0].shape[0] != 2 * nh * hd or any(w.get(b) is not None for b in m.biases):
        return None  # ungated or biased attention: the op path
    if hd % 2 or 2 * len(model.inv_freq) > hd or (nh * hd) % _k.GROUP:
        return None
    return out | {
        "descs": np.array([_desc(x) for x in mats], np.int64),
        "bufs": _buffers(mats),
        "q_norm": d.norm_multiplier(w[m.q_norm]),
        "k_norm": d.norm_multiplier(w[m.k_norm]),
    }
