"""The fast CPU ops (`--device cpu`): GGUF weights stay in their quantized blocks.

The ops contract (ops/contract.py): every op not defined here is numpy_ref's; this module adds
products on the blocks and the fused decoder hook. Matrix products run on the blocks
(cpu/kernels.py):

- a few tokens (decode): each row's blocks are read once and dotted with every token's float32
  activations, dequantizing on the fly; rows are split across cores;
- many tokens (prefill): tiles of rows are dequantized to float32 (bit-exact with the
  reference) and multiplied with all tokens, so each block is decoded once per call.

`fuse_decoder` gives Llama-family models one numba call per decoded token for all layers,
which removes the Python overhead of ~15 ops per layer. Design notes: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numba
import numpy as np

import atlas_cli.backend.formats as formats
from atlas_cli.backend.cache import FAST_KV_DTYPE, HOST_KV_TYPES, HybridCache, StackedKVCache
from atlas_cli.backend.formats import QuantizedWeight, WeightFormat
from atlas_cli.backend.ops import numpy_ref as _ref
from atlas_cli.backend.ops.cpu import amx as _amx
from atlas_cli.backend.ops.cpu import decode as _d
from atlas_cli.backend.ops.cpu import gdn as _gdn
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu import kernels as _k
from atlas_cli.backend.ops.cpu import prefill as _prefill
from atlas_cli.backend.ops.cpu import qwen35 as _q35
from atlas_cli.backend.ops.cpu import rows as _rows
from atlas_cli.backend.ops.numpy_ref import *  # noqa: F403  (ops this backend does not override)

NAME = "cpu"
KEEP_QUANTIZED = True  # backend.load keeps GGUF blocks (QuantizedTensor) for this backend

# The prefill's elementwise ops: numba row kernels in place of numpy_ref's (after the * import)
causal_conv1d, l2norm, rms_norm, rms_norm_gated = (
    _rows.causal_conv1d,
    _rows.l2norm,
    _rows.rms_norm,
    _rows.rms_norm_gated,
)
rope, silu, silu_mul = _rows.rope, _rows.silu, _rows.silu_mul

GEMV_MAX_TOKENS = 4  # up to this many tokens, products dot each row's blocks directly
# Decode products on int8-rounded activations (docs/architecture.md): "int8" (the default) or
# "float32", the activations as they are (slower, closer to the reference).
ACTIVATIONS_ENV = "ATLAS_CPU_ACTIVATIONS"
ACTIVATIONS = ("int8", "float32")


def int8_activations() -> bool:
    """Whether decode products round x to int8 (ATLAS_CPU_ACTIVATIONS; read on every call, so
    a process can compare both)."""
    value = os.environ.get(ACTIVATIONS_ENV, "int8")
    if value not in ACTIVATIONS:
        from atlas_cli.errors import UsageError

        raise UsageError(f"{ACTIVATIONS_ENV} must be int8 or float32, got {value!r}")
    return value == "int8"


@dataclass(frozen=True)
class PackedMatrix(QuantizedWeight):
    """A (rows, cols) weight as GGUF blocks inside a flat uint8 buffer (usually the memory map
    of the whole file): logical row r is stored at byte `offset + perm[r] * row_bytes`. With
    `in_perm`, the stored columns are a permutation of the logical ones (qwen35's out_proj):
    products gather the input, `x[..., in_perm]`, instead of reordering any block."""

    type_id: int
    shape: tuple[int, int]
    buf: np.ndarray  # (n,) uint8
    offset: int
    row_bytes: int
    perm: np.ndarray  # (rows,) int64
    in_perm: np.ndarray | None = None  # (cols,) int64: stored column j is logical in_perm[j]

    @property
    def format(self) -> WeightFormat:
        return formats.GGML[self.type_id]

    @property
    def blocks_per_row(self) -> int:
        return self.shape[1] // _k.BLOCKS[self.type_id][0]

    @property
    def kernel_args(self) -> tuple:
        """(type, buffer, offset, row bytes, blocks per row): how the kernels address it."""
        return self.type_id, self.buf, self.offset, self.row_bytes, self.blocks_per_row

    def dequantize(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        _k.dequant_rows(*self.kernel_args, self.perm, 0, out)
        return out if self.in_perm is None else _logical_columns(out, self.in_perm)


def _logical_columns(stored: np.ndarray, in_perm: np.ndarray) -> np.ndarray:
    """(..., cols) in stored column order -> logical order."""
    out = np.empty_like(stored)
    out[..., in_perm] = stored
    return out


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (the file's memory map for weights from a GGUF)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def pack(qt: QuantizedWeight) -> PackedMatrix | None:
    """A GGUF-block weight as a PackedMatrix, or None when its format has no kernel here."""
    rows, cols = qt.shape
    type_id = qt.format.ggml_type
    if not qt.format.cpu or cols % _k.BLOCKS[type_id][0] != 0:
        return None
    stored = qt.stored()
    blocks = stored.data
    if not blocks.flags.c_contiguous:
        blocks = np.ascontiguousarray(blocks)
    root = _root(blocks)
    if not root.flags.c_contiguous:
        root = blocks
    buf = np.asarray(root).reshape(-1).view(np.uint8)  # no copy: the same memory
    offset = blocks.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    perm = stored.row_perm
    perm = np.arange(rows, dtype=np.int64) if perm is None else np.asarray(perm, np.int64)
    in_perm = None if stored.col_perm is None else np.argsort(stored.col_perm).astype(np.int64)
    return PackedMatrix(type_id, (rows, cols), buf, int(offset), blocks.shape[1], perm, in_perm)


def prepare_weight(w):
    """Quantized GGUF weights stay packed; anything else is numpy_ref's float32."""
    if isinstance(w, PackedMatrix):
        return w
    if isinstance(w, QuantizedWeight):
        packed = pack(w)
        if packed is not None:
            return packed
    return _ref.prepare_weight(w)


def embedding(table, ids: np.ndarray) -> np.ndarray:
    """table (V, H), ids (T,) -> (T, H) float32."""
    if not isinstance(table, PackedMatrix):
        return _ref.embedding(table, ids)
    out = np.empty((len(ids), table.shape[1]), np.float32)
    _k.gather_rows(*table.kernel_args, table.perm[np.asarray(ids, dtype=np.int64)], out)
    return out if table.in_perm is None else _logical_columns(out, table.in_perm)


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    """x (..., in) @ w (out, in)^T -> (..., out)."""
    if not isinstance(w, PackedMatrix):
        with single_blas_thread():
            return _ref.linear(x, w, bias)
    rows, cols = w.shape
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, cols)  # (T, in)
    if w.in_perm is not None:  # the input in the stored column order
        x2 = np.ascontiguousarray(x2[:, w.in_perm])
    out = np.empty((x2.shape[0], rows), np.float32)
    integer = int8_activations()
    if x2.shape[0] > GEMV_MAX_TOKENS:
        kernel = _k.gemm
        if integer and w.type_id in _prefill.INT16_TYPES:
            amx = w.type_id in _amx.AMX_TYPES and _amx.ready()
            kernel = _amx.gemm_amx if amx else _prefill.gemm_int16
    elif integer and w.type_id in _k.INT8_TYPES:
        kernel = _k.gemv_batch_int8
    else:
        kernel = _k.gemv_batch
    kernel(*w.kernel_args, w.perm, x2, out)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], rows)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, nsplit=None):
    """Causal GQA attention of new queries against the whole cache (numpy_ref.attention):
    q (T, nh, hd) at positions start..start+T-1; k, v (nkv, S, hd), S = start + T. One task per
    head and block of queries, whatever `nsplit` says."""
    out = np.empty(q.shape, np.float32)
    _k.attention(
        np.ascontiguousarray(q, np.float32),
        np.ascontiguousarray(_k.kv_bits(k)),  # one layout, one compiled kernel
        np.ascontiguousarray(_k.kv_bits(v)),
        start,
        out,
    )
    return out


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale: float | None = None, chunk=64):
    """numpy_ref's chunked gated delta rule on numba's pool (cpu/gdn.py)."""
    return _gdn.gated_delta_rule_chunked(q, k, v, g, beta, state, scale, chunk)


# ---------------------------------------------------------------------------------------------
# One thread pool: numba's. The numpy ops this path still calls (float32 weights) run BLAS on
# one thread while numba's pool has more: two pools of N threads on N cores preempt each other
# (issue: pp512 9.8 tok/s on 2 threads, 67.9 with one BLAS thread). With one numba thread,
# BLAS keeps whatever the user gave it (`-t`).


@functools.cache
def _blas_libraries() -> tuple:
    """threadpoolctl's handles on the BLAS libraries numpy loaded (found once: the search walks
    every loaded library); setting a count through one is a plain C call."""
    from threadpoolctl import ThreadpoolController

    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


@contextlib.contextmanager
def single_blas_thread():
    """BLAS on one thread inside the block, while numba's pool runs more than one."""
    if numba.get_num_threads() <= 1:
        yield
        return
    libs = _blas_libraries()
    before = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(libs, before, strict=True):
            lib.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Fused decode


_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _use_kv_type(decoder, name: str, *warm_ups) -> None:
    """Set `decoder.kv_dtype` to `name`'s; on a change, load the kernels for that type
    (`warm_ups`), then let go of the compiler's pages again."""
    dtype = np.dtype(HOST_KV_TYPES[name])
    if dtype != decoder.kv_dtype:
        decoder.kv_dtype = dtype
        for warm_up in warm_ups:
            warm_up(dtype)
        _d.release_compiler_memory()


class FusedDecoder:
    """All layers of a Llama-family decoder for one token per numba call (cpu.decode.decode_step).
    Built by `fuse_decoder`; it reads the same packed weights as the per-op path."""

    def __init__(self, model, buf: np.ndarray, packed: dict[str, PackedMatrix]):
        a, w = model.args, model.w
        n_layers, hd = a.num_hidden_layers, a.dim_per_head
        self.n_layers, self.n_kv, self.head_dim = n_layers, a.num_key_value_heads, hd
        self.n_heads = a.num_attention_heads
        nq, nk = self.n_heads * hd, self.n_kv * hd
        self.buf = buf
        self.mats = np.array(  # (L, 7, 4): type, offset, row bytes, blocks per row
            [
                [
                    (m.type_id, m.offset, m.row_bytes, m.blocks_per_row)
                    for m in (packed[_proj_key(i, n)] for n in _PROJ)
                ]
                for i in range(n_layers)
            ],
            np.int64,
        )
        self.perm_q = packed[_proj_key(0, "q_proj")].perm
        self.perm_k = packed[_proj_key(0, "k_proj")].perm
        e = packed["model.embed_tokens.weight"]
        self.embed = np.array([e.type_id, e.offset, e.row_bytes, e.blocks_per_row], np.int64)
        self.embed_perm = e.perm
        layer = [f"model.layers.{i}." for i in range(n_layers)]
        norms = ("input_layernorm.weight", "post_attention_layernorm.weight")
        self.norms = np.array([[w[p + n] for n in norms] for p in layer], np.float32)  # (L, 2, H)
        self.final_norm = np.asarray(w["model.norm.weight"], np.float32)
        # q/k/v biases (zeros when absent) and q/k norms (Qwen3), one row per layer
        self.bias = np.zeros((n_layers, nq + 2 * nk), np.float32)
        self.qk_norm = np.ones((n_layers, 2, hd), np.float32)
        spans = {"q_proj": (0, nq), "k_proj": (nq, nq + nk), "v_proj": (nq + nk, nq + 2 * nk)}
        for i, p in enumerate(layer):
            for name, (lo, hi) in spans.items():
                b = w.get(f"{p}self_attn.{name}.bias")
                if b is not None:
                    self.bias[i, lo:hi] = b
            if model.qk_norm:
                self.qk_norm[i] = (
                    w[p + "self_attn.q_norm.weight"],
                    w[p + "self_attn.k_norm.weight"],
                )
        self.use_qk_norm = bool(model.qk_norm)
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        self.eps = float(a.rms_norm_eps)
        # buffers reused by every step (scores grows with the cache)
        self.qkv = np.empty(nq + 2 * nk, np.float32)
        self.act = np.empty(packed[_proj_key(0, "gate_proj")].shape[0], np.float32)
        self.x = np.empty(a.hidden_size, np.float32)
        self.scores = np.empty((self.n_heads, 0), np.float32)
        # Load the kernels now, before the weights are first read, then let go of the JIT
        # compiler's pages: the two are never resident together (docs/performance.md).
        self.kv_dtype = FAST_KV_DTYPE
        self.workers = None  # iterations of the step's one parallel loop; None: the threads
        if not _d.kernels_cached():
            jit.compile_notice()
        _d.warm_up(self.kv_dtype)
        _d.release_compiler_memory()

    def use_kv_type(self, name: str) -> None:
        """Make the caches this decoder builds hold K/V as `name` (cache.HOST_KV_TYPES; f16
        by default, f32 with float32 activations is the path closest to the reference)."""
        _use_kv_type(self, name, _d.warm_up)

    def new_cache(self, max_len: int) -> StackedKVCache:
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


def _proj_key(layer: int, name: str) -> str:
    group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{group}.{name}.weight"


def fuse_decoder(model) -> FusedDecoder | None:
    """A FusedDecoder for `model` (a LlamaModel), or None when its weights or shape are outside
    what decode_step handles; the model then runs op by op. Qwen3.5 (hybrid) models get
    cpu.qwen35's step."""
    if hasattr(model.args, "layer_types"):
        return fuse_qwen35(model)
    a, w = model.args, model.w
    if a.hidden_size % _k.GROUP or a.dim_per_head % 2 or a.partial_rotary_factor != 1.0:
        return None
    names = [_proj_key(i, n) for i in range(a.num_hidden_layers) for n in _PROJ]
    names.append("model.embed_tokens.weight")
    packed = {n: w.get(n) for n in names}
    if not all(isinstance(m, PackedMatrix) and m.in_perm is None for m in packed.values()):
        return None
    buf = packed[names[0]].buf
    addr = buf.__array_interface__["data"][0]
    for m in packed.values():  # all weights must live in one buffer
        if m.buf.__array_interface__["data"][0] != addr or m.buf.size != buf.size:
            return None
    q0, k0 = packed[names[0]], packed[names[1]]
    for i in range(a.num_hidden_layers):
        for n in _PROJ:
            m = packed[_proj_key(i, n)]
            ref = {"q_proj": q0.perm, "k_proj": k0.perm}.get(n)
            if ref is None:  # decode_step reads these rows in stored order
                if not _stored_in_order(m):
                    return None
            elif not np.array_equal(m.perm, ref):
                return None
    inter = packed[_proj_key(0, "gate_proj")].shape[0]
    if inter % _k.GROUP or (a.num_attention_heads * a.dim_per_head) % _k.GROUP:
        return None
    return FusedDecoder(model, buf, packed)


# ---------------------------------------------------------------------------------------------
# Fused Qwen3.5 decode (the kernels: cpu/qwen35.py)

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


def _stored_in_order(m) -> bool:
    """Whether the kernels can read m's rows at row * row bytes (no row or column order)."""
    return (
        isinstance(m, PackedMatrix)
        and m.in_perm is None
        and np.array_equal(m.perm, np.arange(m.shape[0]))
    )


class FusedQwen35:
    """A Qwen3.5 decode step with one numba call per layer and its MLP (gdn_block or
    attention_block) on the host HybridCache. Built by `fuse_qwen35`; reads the same packed
    weights as the op path."""

    def __init__(self, model, layers: list[dict]):
        a = model.args
        self.layers = layers
        self.eps = float(a.rms_norm_eps)
        self.embed = model.w["model.embed_tokens.weight"]
        self.final_norm = _unit_offset(model.w["model.norm.weight"])
        self.inv_freq = np.ascontiguousarray(model.inv_freq, np.float32)
        nv, dv, hd = a.linear_num_value_heads, a.linear_value_head_dim, a.head_dim
        nq, nk = a.num_attention_heads * hd, a.num_key_value_heads * hd
        self.act = np.empty(a.intermediate_size, np.float32)
        self.gdn_proj = np.empty(a.conv_channels + nv * dv + 2 * nv, np.float32)
        self.core = np.empty(nv * dv, np.float32)
        self.attn_proj = np.empty(2 * nq + 2 * nk, np.float32)
        self.qk = np.empty(nq + nk, np.float32)
        self.att = np.empty(nq, np.float32)
        self.scores = np.empty((a.num_attention_heads, 0), np.float32)
        self.workers = None  # iterations of each layer's parallel loop; None: the threads
        # the kernels before the weights are first read, then the compiler's pages let go
        # (as cpu.fast.FusedDecoder)
        self.kv_dtype = FAST_KV_DTYPE
        if not (_d.kernels_cached() and _d.kernels_cached(_q35.gdn_block)):
            jit.compile_notice()
        _d.warm_up(self.kv_dtype)
        _q35.warm_up(self.kv_dtype)
        _d.release_compiler_memory()

    def use_kv_type(self, name: str) -> None:
        """As FusedDecoder.use_kv_type."""
        _use_kv_type(self, name, _d.warm_up, _q35.warm_up)

    def new_cache(self, *shape) -> HybridCache:
        """The model's host HybridCache (`shape` as its arguments), K/V as `kv_dtype`."""
        return HybridCache(*shape, kv_dtype=self.kv_dtype)

    def decode(self, token: int, cache, pos: int) -> np.ndarray:
        """One token at position `pos`: updates `cache` (this position's K/V, every linear
        layer's state) and returns the final normed hidden state (1, H)."""
        int8 = int8_activations()
        workers = self.workers or numba.get_num_threads()
        if self.scores.shape[1] < cache.capacity:
            self.scores = np.empty((self.scores.shape[0], cache.capacity), np.float32)
        angles = np.float32(pos) * self.inv_freq  # float32, as numpy_ref.rope
        cos, sin = np.cos(angles), np.sin(angles)
        x = embedding(self.embed, np.array([token]))[0]
        for i, layer in enumerate(self.layers):
            if "conv_w" in layer:
                state = cache.linear[i]
                _q35.gdn_block(
                    x, layer["norm"], layer["post_norm"], self.eps, layer["descs"],
                    layer["bufs"], layer["out_perm"], layer["conv_w"], state.conv,
                    state.recurrent, layer["a_neg"], layer["dt_bias"], layer["gnorm"],
                    layer["n_kh"], layer["mlp_buf"], layer["mlp"], self.gdn_proj, self.core,
                    self.act, int8, workers,
                )  # fmt: skip
            else:
                kv = cache.kv[i]
                _q35.attention_block(
                    x, layer["norm"], layer["post_norm"], self.eps, layer["descs"],
                    layer["bufs"], layer["q_norm"], layer["k_norm"], cos, sin, pos,
                    _k.kv_bits(kv.k), _k.kv_bits(kv.v), layer["mlp_buf"], layer["mlp"],
                    self.attn_proj, self.qk, self.att, self.scores, self.act, int8, workers,
                )  # fmt: skip
        out = np.empty_like(x)
        _d.rms_norm_into(x, self.final_norm, self.eps, out)
        return out[None, :]

    def logits_for(self, hidden):
        """The op path's lm_head (models/qwen3_5.py asks the fused step first)."""
        return None


def _unit_offset(w) -> np.ndarray:
    """A (1 + w) norm weight as the plain weight rms_norm_into multiplies by (float32, as
    numpy_ref.rms_norm computes it)."""
    return np.asarray(w, np.float32) + np.float32(1.0)


def fuse_qwen35(model) -> FusedQwen35 | None:
    """A FusedQwen35 for `model` (a Qwen3_5Model on the fast CPU ops), or None when a weight or
    shape is outside what the kernels take; the model then runs op by op."""
    a, w = model.args, model.w
    hd, nh = a.head_dim, a.num_attention_heads
    widths = (a.hidden_size, a.intermediate_size, a.value_dim, nh * hd)
    if (
        any(n % _k.GROUP for n in widths)
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
        if not all(_stored_in_order(m) for m in mlp):
            return None
        if len({m.buf.__array_interface__["data"][0] for m in mlp}) != 1:
            return None  # the MLP stages read the three from one buffer
        table = np.zeros((7, 4), np.int64)  # cpu.decode's layout: rows GATE, UP, DOWN
        for row, m in zip((_d.GATE, _d.UP, _d.DOWN), mlp, strict=True):
            table[row] = _desc(m)[:4]
        layer = {
            "norm": _unit_offset(w[p + "input_layernorm.weight"]),
            "post_norm": _unit_offset(w[p + "post_attention_layernorm.weight"]),
            "mlp": table,
            "mlp_buf": _buffers(mlp[:1])[0],
        }
        if kind == "linear_attention":
            q = p + "linear_attn."
            mats = [w.get(f"{q}{n}.weight") for n in _GDN]
            out = mats[-1]
            if not all(_stored_in_order(m) for m in mats[:-1]):
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
            if not all(_stored_in_order(m) for m in mats):
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
