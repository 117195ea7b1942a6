"""The fast CPU ops (`--device cpu`): GGUF weights stay in their quantized blocks.

The ops contract (ops/contract.py): every op not defined here is numpy_ref's; this module adds
products on the blocks and the fused decoder hook. Matrix products run on the blocks
(kernels.py):

- a few tokens (decode): each row's blocks are read once and dotted with every token's float32
  activations, dequantizing on the fly; rows are split across cores;
- many tokens (prefill): tiles of rows are dequantized to float32 (bit-exact with the
  reference) and multiplied with all tokens, so each block is decoded once per call.

`fuse_decoder` (fused.py) builds a model's fused decode step from its declaration: one numba
call per token (or per layer), which removes the Python overhead of ~15 ops per layer. Design
notes: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools

import numba
import numpy as np

from atlas_cli.backend.cache import HOST_KV_TYPES
from atlas_cli.backend.formats import QuantizedWeight
from atlas_cli.backend.ops import numpy_ref as _ref
from atlas_cli.backend.ops.cpu import amx as _amx
from atlas_cli.backend.ops.cpu import fused as _fused
from atlas_cli.backend.ops.cpu import gdn as _gdn
from atlas_cli.backend.ops.cpu import gemv_int8 as _gemv_int8
from atlas_cli.backend.ops.cpu import kernels as _k
from atlas_cli.backend.ops.cpu import prefill as _prefill
from atlas_cli.backend.ops.cpu import rows as _rows
from atlas_cli.backend.ops.cpu.packed import (  # noqa: F401  (ACTIVATIONS_ENV: this path's setting)
    ACTIVATIONS_ENV,
    PackedMatrix,
    gather,
    int8_activations,
    pack,
)
from atlas_cli.backend.ops.numpy_ref import *  # noqa: F403  (ops this backend does not override)

NAME = "cpu"
KEEP_QUANTIZED = True  # backend.load keeps GGUF blocks (QuantizedTensor) for this backend
KV_TYPES = tuple(HOST_KV_TYPES)  # float16 (the default) or float32, on the fused step

# The prefill's elementwise ops: numba row kernels in place of numpy_ref's (after the * import)
causal_conv1d, l2norm, rms_norm, rms_norm_gated = (
    _rows.causal_conv1d,
    _rows.l2norm,
    _rows.rms_norm,
    _rows.rms_norm_gated,
)
rope, silu, silu_mul = _rows.rope, _rows.silu, _rows.silu_mul
fuse_decoder = _fused.fuse_decoder  # the fused decode step built from the model's declaration

GEMV_MAX_TOKENS = 4  # up to this many tokens, products dot each row's blocks directly


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
    return gather(table, ids)


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
        kernel = _gemv_int8.gemv_batch_int8
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
    """numpy_ref's chunked gated delta rule on numba's pool (cpu_gdn.py)."""
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
