"""Every kernel launcher, shared by the CUDA and HIP runtimes (and the CPU emulator).

`NativeOps(runtime)` has the op names and signatures of `numpy_ref`, so a model file runs on it
unchanged and tests can zip the two. Activations are float32 `DeviceArray`s; weights are
`DeviceWeight`s in their stored format (bf16, GGUF blocks, NVFP4), dequantized inside the
kernels. Every launch is preceded by asserts on dtype, shape and contiguity.

`DeviceArray` implements the small part of the numpy array protocol the model files use
(reshape, leading-axis views, last-axis slices, + - * / with broadcasting of a trailing row,
`np.asarray` to come back to the host) and nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend import formats
from atlas_cli.backend.cache import KVCacheBase, grown_capacity
from atlas_cli.backend.formats import QuantizedWeight, StoredRows, WeightFormat
from atlas_cli.backend.ops import runtime as rt
from atlas_cli.backend.ops.runtime import f32, i32, i64, ptr

KV_DTYPES = ("bf16", "fp8", "f32")
ATTN_HEAD_DIMS = (32, 64, 128, 256)
GEMV_MAX_T = 8  # gemv.cu GEMV_MAX_T
SAMPLE_KMAX = 256  # sample.cu SAMPLE_KMAX
_F32_NAN = 0x7FC00000


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; matches f32_to_bf16 in the
    kernels' common header."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _blocks(n: int, per: int = 256, cap: int = 8192) -> int:
    return max(1, min(cap, -(-n // per)))


class DeviceArray:
    """A contiguous device array (float32 or int32) owned by a NativeOps."""

    __array_ufunc__ = None  # numpy defers `ndarray * DeviceArray` to our __rmul__

    def __init__(self, ops: NativeOps, buf, shape: tuple[int, ...], dtype, offset: int = 0):
        self.ops = ops
        self.buf = buf
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.offset = offset

    # -- the array facts ------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        return self.buf.ptr + self.offset

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, runtime={self.ops.NAME})"

    # -- host transfer --------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if self.size:
            self.ops.rt.d2h(out, self.buf, self.offset)
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True):
        if np.dtype(dtype) == self.dtype:
            return self.copy() if copy else self
        return self.ops.asarray(self.numpy().astype(dtype))

    def copy(self) -> DeviceArray:
        out = self.ops.empty(self.shape, self.dtype)
        self.ops.rt.d2d(out.buf, out.offset, self.buf, self.offset, self.nbytes)
        return out

    # -- views and slices -----------------------------------------------------------------
    def reshape(self, *shape) -> DeviceArray:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        shape = list(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // known if known else 0
        assert math.prod(shape) == self.size, f"cannot reshape {self.shape} to {tuple(shape)}"
        return DeviceArray(self.ops, self.buf, tuple(shape), self.dtype, self.offset)

    def _row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def __getitem__(self, key) -> DeviceArray:
        if isinstance(key, int | np.integer):
            i = int(key) + (self.shape[0] if key < 0 else 0)
            assert 0 <= i < self.shape[0], f"index {key} out of range for {self.shape}"
            return DeviceArray(
                self.ops, self.buf, self.shape[1:], self.dtype, self.offset + i * self._row_bytes()
            )
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            assert step == 1, "only unit-step slices of device arrays"
            n = max(0, stop - start)
            return DeviceArray(
                self.ops,
                self.buf,
                (n, *self.shape[1:]),
                self.dtype,
                self.offset + start * self._row_bytes(),
            )
        if isinstance(key, tuple):
            # x[..., a:b] or x[:, a:b] (2-D): a slice of the last axis, made contiguous
            last = key[-1]
            lead = key[:-1]
            full = all(k is Ellipsis or k == slice(None) for k in lead)
            if full and isinstance(last, slice) and (Ellipsis in lead or len(key) == self.ndim):
                start, stop, step = last.indices(self.shape[-1])
                assert step == 1, "only unit-step slices of device arrays"
                return self.ops._copy_cols(self, start, stop - start)
        raise TypeError(f"unsupported device-array index {key!r}")

    def __setitem__(self, key, value) -> None:
        assert key == slice(None) or key is Ellipsis, "only x[:] = value on device arrays"
        if np.isscalar(value):
            self.ops.fill(self, float(value))
            return
        src = self.ops.asarray(value) if not isinstance(value, DeviceArray) else value
        assert src.shape == self.shape and src.dtype == self.dtype, "x[:] = y needs equal shapes"
        self.ops.rt.d2d(self.buf, self.offset, src.buf, src.offset, self.nbytes)

    # -- arithmetic -----------------------------------------------------------------------
    def __add__(self, other):
        return self.ops._binary(self, other, 0)

    def __radd__(self, other):
        return self.ops._binary(self, other, 0)

    def __sub__(self, other):
        return self.ops._binary(self, other, 1)

    def __rsub__(self, other):
        return self.ops._binary(self, other, 1, reverse=True)

    def __mul__(self, other):
        return self.ops._binary(self, other, 2)

    def __rmul__(self, other):
        return self.ops._binary(self, other, 2)

    def __truediv__(self, other):
        return self.ops._binary(self, other, 3)

    def __rtruediv__(self, other):
        return self.ops._binary(self, other, 3, reverse=True)

    def __neg__(self):
        return self.ops._unary(self, 4)


@dataclass(frozen=True)
class DeviceWeight:
    """A 2-D weight (rows, cols) on the device in its stored format."""

    fmt: str
    rows: int
    cols: int
    data: Any  # runtime buffer: rows x row_bytes
    row_bytes: int
    scales: Any  # NVFP4: rows x cols/16 E4M3 codes; else a 1-byte dummy
    srow_bytes: int
    gscale: float

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


@dataclass(frozen=True)
class KVView:
    """One layer's cached keys or values, (nkv, length, hd) inside a (nkv, cap, hd) buffer."""

    buf: Any
    nkv: int
    length: int
    hd: int
    cap: int
    dtype: str  # "bf16" | "fp8" | "f32"
    scale: float

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.nkv, self.length, self.hd)


class KVCache(KVCacheBase):
    """Device KV cache with the interface of cache.KVCache (a `cache.Cache`). Keys and values
    are stored as bf16, FP8 E4M3 (value / scale) or f32."""

    GROW_STEP = 256

    def __init__(
        self,
        ops: NativeOps,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: str = "bf16",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ):
        assert dtype in KV_DTYPES, f"KV dtype {dtype!r} not in {KV_DTYPES}"
        self.ops = ops
        self.nkv, self.hd, self.max_len = n_kv_heads, head_dim, max_len
        self.dtype, self.k_scale, self.v_scale = dtype, k_scale, v_scale
        self.esize = {"bf16": 2, "fp8": 1, "f32": 4}[dtype]
        self.length = 0
        self._cap = min(self.GROW_STEP, max_len)
        self.layers = [[self._alloc(self._cap), self._alloc(self._cap)] for _ in range(n_layers)]

    def _alloc(self, cap: int):
        return self.ops.rt.alloc(self.nkv * cap * self.hd * self.esize)

    @property
    def capacity(self) -> int:
        return self._cap

    def reserve(self, new_len: int) -> None:
        cap = grown_capacity(self._cap, new_len, self.max_len)
        if cap == self._cap:
            return
        head_old, head_new = self._cap * self.hd * self.esize, cap * self.hd * self.esize
        keep = self.length * self.hd * self.esize
        for pair in self.layers:
            for i, old in enumerate(pair):
                new = self._alloc(cap)
                for h in range(self.nkv):  # each head's slab moves to its new stride
                    if keep:
                        self.ops.rt.d2d(new, h * head_new, old, h * head_old, keep)
                pair[i] = new
        self._cap = cap

    def update(self, layer: int, start: int, k, v):
        """Write k, v (T, nkv, hd) at positions start.. and return KVViews of the filled cache."""
        t = k.shape[0]
        end = start + t
        assert end <= self._cap, f"reserve({end}) first (capacity {self._cap})"
        kb, vb = self.layers[layer]
        self.ops.kv_write(k, kb, self._cap, start, self.dtype, self.k_scale)
        self.ops.kv_write(v, vb, self._cap, start, self.dtype, self.v_scale)
        return (
            KVView(kb, self.nkv, end, self.hd, self._cap, self.dtype, self.k_scale),
            KVView(vb, self.nkv, end, self.hd, self._cap, self.dtype, self.v_scale),
        )

    def truncate(self, length: int) -> int:
        self.length = min(self.length, length)
        return self.length


class NativeOps:
    """The ops of numpy_ref, run as our kernels on `runtime`."""

    def __init__(self, runtime, kv_dtype: str = "bf16", weight_dtype: str = "bf16"):
        self.rt = runtime
        self.NAME = runtime.name
        self.kv_dtype = kv_dtype
        self.weight_dtype = weight_dtype
        self.poison = False  # tests: fill every new output with NaN to catch unwritten elements
        self._fns: dict[tuple[str, str], Any] = {}
        self._uploads: dict[str, tuple[np.ndarray, DeviceArray]] = {}
        self._dummy = runtime.alloc(16)

    # -- plumbing -------------------------------------------------------------------------
    def _fn(self, file: str, name: str):
        key = (file, name)
        if key not in self._fns:
            self._fns[key] = self.rt.compile(file).function(name)
        return self._fns[key]

    def _launch(self, file: str, name: str, grid, block, args) -> None:
        self.rt.launch(self._fn(file, name), grid, block, args)

    def warmup(self) -> dict[str, Any]:
        """Compile (or load from the cache) every kernel file; returns the runtime's info."""
        for file in rt.KERNEL_FILES:
            self.rt.compile(file)
        return self.rt.info()

    def empty(self, shape, dtype=np.float32) -> DeviceArray:
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        out = DeviceArray(self, self.rt.alloc(max(n, 4)), shape, dtype)
        if self.poison and n:
            self._fill32(out, _F32_NAN, n // 4)
        return out

    def zeros(self, shape, dtype=np.float32) -> DeviceArray:
        out = self.empty(shape, dtype)
        if out.size:
            self._fill32(out, 0, out.nbytes // 4)
        return out

    def asarray(self, x, dtype=None) -> DeviceArray:
        """Host array (or DeviceArray) -> DeviceArray; float arrays become float32."""
        if isinstance(x, DeviceArray):
            return x
        a = np.asarray(x)
        if dtype is not None:
            a = a.astype(dtype)
        elif a.dtype.kind == "f":
            a = a.astype(np.float32)
        elif a.dtype.kind in "iub":
            a = a.astype(np.int32)
        a = np.ascontiguousarray(a)
        out = DeviceArray(self, self.rt.alloc(max(a.nbytes, 4)), a.shape, a.dtype)
        if a.nbytes:
            self.rt.h2d(out.buf, a)
        return out

    def _small(self, slot: str, host: np.ndarray, dtype) -> DeviceArray:
        """Upload a small per-call host array (positions, inv_freq), reusing the last upload
        of this slot when the contents are unchanged."""
        host = np.ascontiguousarray(host, dtype)
        prev = self._uploads.get(slot)
        if prev is not None and prev[0].shape == host.shape and np.array_equal(prev[0], host):
            return prev[1]
        dev = self.asarray(host)
        self._uploads[slot] = (host.copy(), dev)
        return dev

    def _f32(self, x, what: str) -> DeviceArray:
        x = self.asarray(x) if not isinstance(x, DeviceArray) else x
        assert x.dtype == np.float32, f"{what}: float32 expected, got {x.dtype}"
        return x

    def _fill32(self, x: DeviceArray, bits: int, n: int) -> None:
        self._launch(
            "elementwise.cu",
            "fill32",
            (_blocks(n),),
            (256,),
            [ptr(x.ptr), Arg_u32(bits), i64(n)],
        )

    def fill(self, x: DeviceArray, value: float) -> None:
        assert x.dtype == np.float32
        bits = int(np.array(value, np.float32).view(np.uint32))
        self._fill32(x, bits, x.size)

    # -- weights --------------------------------------------------------------------------
    def prepare_weight(self, w) -> DeviceWeight:
        """A loader's weight -> DeviceWeight: formats the kernels decode as they are stored
        (GGUF blocks; NVFP4 codes + E4M3 scales + global scale), anything else as float32
        dequantized on the host, uploaded as bf16 (or f32 when the ops were made with
        weight_dtype="f32")."""
        if isinstance(w, DeviceWeight):
            return w
        if isinstance(w, QuantizedWeight) and w.format.native:
            return self._upload_stored(w.format, w.shape, w.stored())
        a = np.asarray(w, np.float32)
        if a.ndim == 1:
            a = a.reshape(1, -1)
        assert a.ndim == 2 and a.shape[1] % 32 == 0, f"weight {a.shape}: cols % 32 != 0"
        if self.weight_dtype == "f32":
            return DeviceWeight(
                "f32", *a.shape, self._upload_bytes(a), a.shape[1] * 4, self._dummy, 0, 1.0
            )
        bits = f32_to_bf16_bits(a)
        return DeviceWeight(
            "bf16", *a.shape, self._upload_bytes(bits), a.shape[1] * 2, self._dummy, 0, 1.0
        )

    def _upload_stored(self, fmt: WeightFormat, shape, s: StoredRows) -> DeviceWeight:
        rows, cols = (int(n) for n in shape)
        if fmt is formats.NVFP4:
            codes = np.ascontiguousarray(s.data, np.uint8)
            scales = np.ascontiguousarray(s.scales)
            assert cols % 32 == 0 and codes.shape == (rows, cols // 2), "bad NVFP4 shapes"
            assert scales.shape == (rows, cols // fmt.block_elems), "bad NVFP4 scale shape"
            return DeviceWeight(
                fmt.kernel,
                rows,
                cols,
                self._upload_bytes(codes),
                cols // 2,
                self._upload_bytes(scales),
                cols // fmt.block_elems,
                float(np.asarray(s.global_scale, np.float32).reshape(())),
            )
        data = s.data if s.row_perm is None else s.data[s.row_perm]
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
        assert cols % 32 == 0 and raw.shape[1] == cols // fmt.block_elems * fmt.block_bytes, (
            f"{fmt.kernel} weight {shape}: {raw.shape[1]} bytes per row"
        )
        return DeviceWeight(
            fmt.kernel, rows, cols, self._upload_bytes(raw), raw.shape[1], self._dummy, 0, 1.0
        )

    def _upload_bytes(self, a: np.ndarray):
        buf = self.rt.alloc(max(a.nbytes, 4))
        self.rt.h2d(buf, np.ascontiguousarray(a))
        return buf

    def _wargs(self, w: DeviceWeight) -> list:
        return [ptr(w.data.ptr), ptr(w.scales.ptr), f32(w.gscale)]

    def dequantize(self, w: DeviceWeight) -> DeviceArray:
        """The whole weight as float32 (rows, cols), bit-exact with the numpy dequantizers."""
        assert isinstance(w, DeviceWeight)
        out = self.empty((w.rows, w.cols))
        units = w.cols // 32
        self._launch(
            "dequant.cu",
            f"dequant_{w.fmt}",
            (-(-units // 256), w.rows),
            (256,),
            [
                *self._wargs(w),
                ptr(out.ptr),
                i32(w.rows),
                i32(w.cols),
                i64(w.row_bytes),
                i64(w.srow_bytes),
            ],
        )
        return out

    # -- the ops of numpy_ref -------------------------------------------------------------
    def embedding(self, table, ids) -> DeviceArray:
        """table (V, H) weight, ids (T,) -> (T, H) float32."""
        w = table if isinstance(table, DeviceWeight) else self.prepare_weight(table)
        ids_h = np.asarray(ids).reshape(-1)
        assert ids_h.size == 0 or (ids_h.min() >= 0 and ids_h.max() < w.rows), "id out of range"
        dev_ids = self.asarray(ids_h.astype(np.int32))
        t = ids_h.size
        out = self.empty((t, w.cols))
        if t:
            self._launch(
                "embedding.cu",
                f"embedding_{w.fmt}",
                (t,),
                (128,),
                [
                    *self._wargs(w),
                    ptr(dev_ids.ptr),
                    ptr(out.ptr),
                    i32(w.cols),
                    i64(w.row_bytes),
                    i64(w.srow_bytes),
                ],
            )
        return out

    def rms_norm(self, x, weight, eps: float, unit_offset: bool = False) -> DeviceArray:
        """x (..., n): x / rms(x) * w (or * (1 + w))."""
        x = self._f32(x, "rms_norm x")
        w = self._f32(weight, "rms_norm weight")
        n = x.shape[-1]
        assert w.size == n, f"rms_norm: weight {w.shape} for rows of {n}"
        out = self.empty(x.shape)
        rows = x.size // n
        if rows:
            self._launch(
                "norm.cu",
                "rms_norm",
                (rows,),
                (256,),
                [ptr(x.ptr), ptr(w.ptr), ptr(out.ptr), i32(n), f32(eps), i32(int(unit_offset))],
            )
        return out

    def add_rms_norm(self, x, residual, weight, eps: float, unit_offset: bool = False):
        """(x + residual, rms_norm(x + residual)): the residual add fused into the norm."""
        x = self._f32(x, "add_rms_norm x")
        r = self._f32(residual, "add_rms_norm residual")
        w = self._f32(weight, "add_rms_norm weight")
        assert x.shape == r.shape, f"add_rms_norm: {x.shape} vs {r.shape}"
        n = x.shape[-1]
        assert w.size == n
        s, out = self.empty(x.shape), self.empty(x.shape)
        self._launch(
            "norm.cu",
            "add_rms_norm",
            (x.size // n,),
            (256,),
            [
                ptr(x.ptr),
                ptr(r.ptr),
                ptr(w.ptr),
                ptr(s.ptr),
                ptr(out.ptr),
                i32(n),
                f32(eps),
                i32(int(unit_offset)),
            ],
        )
        return s, out

    def linear(self, x, w, bias=None) -> DeviceArray:
        """x (T, in) @ w (out, in)^T (+ bias) -> (T, out): gemv for T <= 8, tiled gemm above."""
        x = self._f32(x, "linear x")
        w = w if isinstance(w, DeviceWeight) else self.prepare_weight(w)
        assert x.ndim == 2 and x.shape[1] == w.cols, f"linear: x {x.shape} vs weight {w.shape}"
        b = self._f32(bias, "linear bias") if bias is not None else None
        assert b is None or b.size == w.rows
        t = x.shape[0]
        out = self.empty((t, w.rows))
        if t == 0:
            return out
        args = [
            *self._wargs(w),
            ptr(x.ptr),
            ptr(b.ptr if b is not None else 0),
            ptr(out.ptr),
            i32(t),
            i32(w.rows),
            i32(w.cols),
            i64(w.row_bytes),
            i64(w.srow_bytes),
        ]
        if t <= GEMV_MAX_T:
            self._launch("gemv.cu", f"gemv_{w.fmt}", (-(-w.rows // 8),), (256,), args)
        else:
            self._launch("gemm.cu", f"gemm_{w.fmt}", (-(-w.rows // 64), -(-t // 64)), (256,), args)
        return out

    def silu_mul(self, gate, up) -> DeviceArray:
        gate, up = self._f32(gate, "silu_mul gate"), self._f32(up, "silu_mul up")
        assert gate.shape == up.shape, f"silu_mul: {gate.shape} vs {up.shape}"
        out = self.empty(gate.shape)
        self._launch(
            "elementwise.cu",
            "silu_mul",
            (_blocks(gate.size),),
            (256,),
            [ptr(gate.ptr), ptr(up.ptr), ptr(out.ptr), i64(gate.size)],
        )
        return out

    def sigmoid_mul(self, x, gate) -> DeviceArray:
        """x * sigmoid(gate): the gated-attention output gate."""
        x, gate = self._f32(x, "sigmoid_mul x"), self._f32(gate, "sigmoid_mul gate")
        assert x.shape == gate.shape
        out = self.empty(x.shape)
        self._launch(
            "elementwise.cu",
            "sigmoid_mul",
            (_blocks(x.size),),
            (256,),
            [ptr(x.ptr), ptr(gate.ptr), ptr(out.ptr), i64(x.size)],
        )
        return out

    def _unary(self, x, op: int) -> DeviceArray:
        x = self._f32(x, "unary x")
        out = self.empty(x.shape)
        if x.size:
            self._launch(
                "elementwise.cu",
                "unary",
                (_blocks(x.size),),
                (256,),
                [ptr(x.ptr), ptr(out.ptr), i64(x.size), i32(op)],
            )
        return out

    def sigmoid(self, x) -> DeviceArray:
        return self._unary(x, 0)

    def silu(self, x) -> DeviceArray:
        return self._unary(x, 1)

    def softplus(self, x) -> DeviceArray:
        return self._unary(x, 2)

    def _binary(self, a: DeviceArray, b, op: int, reverse: bool = False) -> DeviceArray:
        a = self._f32(a, "binary a")
        if np.isscalar(b):
            out = self.empty(a.shape)
            self._launch(
                "elementwise.cu",
                "scalar_op",
                (_blocks(a.size),),
                (256,),
                [ptr(a.ptr), f32(b), ptr(out.ptr), i64(a.size), i32(op), i32(int(reverse))],
            )
            return out
        b = self._f32(b, "binary b")
        if b.size > a.size:  # broadcasting a smaller left operand: swap and flip
            return self._binary(b, a, op, reverse=not reverse)
        nb = b.size
        ok = (
            b.shape == a.shape
            or nb == 1
            or (b.shape == a.shape[a.ndim - b.ndim :] if b.ndim <= a.ndim else False)
        )
        assert ok, f"cannot broadcast {b.shape} onto {a.shape} on the device"
        out = self.empty(a.shape)
        self._launch(
            "elementwise.cu",
            "binary",
            (_blocks(a.size),),
            (256,),
            [
                ptr(a.ptr),
                ptr(b.ptr),
                ptr(out.ptr),
                i64(a.size),
                i64(max(nb, 1)),
                i32(op),
                i32(int(reverse)),
            ],
        )
        return out

    def _copy_cols(self, x: DeviceArray, c0: int, width: int) -> DeviceArray:
        assert x.dtype == np.float32
        ld = x.shape[-1]
        rows = x.size // ld
        out = self.empty((*x.shape[:-1], width))
        if out.size:
            self._launch(
                "elementwise.cu",
                "copy_cols",
                (_blocks(out.size),),
                (256,),
                [ptr(x.ptr), ptr(out.ptr), i64(rows), i32(ld), i32(c0), i32(width)],
            )
        return out

    def rope(self, x, positions, inv_freq) -> DeviceArray:
        """Neox RoPE on the first 2*len(inv_freq) dims of x (T, n, hd); returns a new array."""
        x = self._f32(x, "rope x")
        assert x.ndim == 3, f"rope: (T, n, hd) expected, got {x.shape}"
        t, n, hd = x.shape
        inv = np.asarray(inv_freq, np.float32)
        rot = 2 * inv.shape[0]
        assert rot <= hd and len(positions) == t
        out = x.copy()
        if t:
            pos = self._small("positions", np.asarray(positions), np.int32)
            freq = self._small("inv_freq", inv, np.float32)
            self._launch(
                "rope.cu",
                "rope",
                (t, n),
                (64,),
                [ptr(out.ptr), ptr(pos.ptr), ptr(freq.ptr), i32(n), i32(hd), i32(rot)],
            )
        return out

    def kv_write(self, k, cache_buf, cap: int, start: int, dtype: str, scale: float) -> None:
        """cache (nkv, cap, hd)[:, start:start+T] = encode(k (T, nkv, hd) / scale)."""
        k = self._f32(k, "kv_write k")
        assert k.ndim == 3 and dtype in KV_DTYPES
        t, nkv, hd = k.shape
        assert start + t <= cap
        self._launch(
            "attention.cu",
            f"kv_write_{dtype}",
            (t, nkv),
            (128,),
            [
                ptr(k.ptr),
                ptr(cache_buf.ptr),
                i32(t),
                i32(nkv),
                i32(hd),
                i32(cap),
                i32(start),
                ptr(0),
                f32(scale),
            ],
        )

    def attention(self, q, k, v, start: int, nsplit: int | None = None) -> DeviceArray:
        """Causal GQA attention: q (T, nh, hd) at positions start..; k, v the whole cache
        (nkv, start+T, hd), as KVViews of a device KVCache or float32 arrays."""
        q = self._f32(q, "attention q")
        assert q.ndim == 3
        t, nh, hd = q.shape
        k, v = self._as_kv(k), self._as_kv(v)
        assert k.shape == v.shape and k.dtype == v.dtype and k.cap == v.cap
        nkv, s, khd = k.shape
        assert khd == hd and nh % nkv == 0, f"attention: q {q.shape} vs kv {k.shape}"
        assert s == start + t, f"attention: cache length {s} != start {start} + T {t}"
        assert hd in ATTN_HEAD_DIMS, f"no attention kernel for head_dim {hd}"
        out = self.empty((t, nh, hd))
        if t == 0:
            return out
        g = nh // nkv
        if nsplit is None:
            # split the keys only when there are few query rows to spread over the GPU
            nsplit = 1 if t * g * nkv >= 256 else max(1, min(32, s // 512))
        split_len = -(-s // nsplit)
        split_len = -(-split_len // 32) * 32
        nsplit = -(-s // split_len)
        if nsplit > 1:
            part_o = self.empty((nsplit, t, nh, hd))
            part_ml = self.empty((nsplit, t, nh, 2))
        else:
            part_o = part_ml = out
        grid = (-(-(t * g) // 4), nkv, nsplit)
        self._launch(
            "attention.cu",
            f"attn_{k.dtype}_hd{hd}",
            grid,
            (128,),
            [
                ptr(q.ptr),
                ptr(k.buf.ptr),
                ptr(v.buf.ptr),
                f32(k.scale),
                f32(v.scale),
                ptr(out.ptr),
                ptr(part_o.ptr),
                ptr(part_ml.ptr),
                i32(t),
                i32(nh),
                i32(nkv),
                i32(k.cap),
                i32(start),
                ptr(0),
                i32(split_len),
            ],
        )
        if nsplit > 1:
            self._launch(
                "attention.cu",
                "attn_combine",
                (t * nh,),
                (128,),
                [
                    ptr(part_o.ptr),
                    ptr(part_ml.ptr),
                    ptr(out.ptr),
                    i32(nsplit),
                    i32(t * nh),
                    i32(hd),
                ],
            )
        return out

    def _as_kv(self, x) -> KVView:
        if isinstance(x, KVView):
            return x
        a = self._f32(x, "attention k/v")
        assert a.ndim == 3
        nkv, s, hd = a.shape
        return KVView(a.buf if a.offset == 0 else self._rebase(a), nkv, s, hd, s, "f32", 1.0)

    def _rebase(self, a: DeviceArray):
        return a.copy().buf

    def device_kv_cache(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int
    ) -> KVCache:
        """The device cache the model files ask for (contract.Ops.device_kv_cache)."""
        return KVCache(self, n_layers, n_kv_heads, head_dim, max_len, self.kv_dtype)

    def fuse_decoder(self, model) -> None:
        """No fused decode step on the device yet: models run op by op."""
        return None

    # -- Gated DeltaNet -------------------------------------------------------------------
    def l2norm(self, x, eps: float = 1e-6) -> DeviceArray:
        x = self._f32(x, "l2norm x")
        n = x.shape[-1]
        out = self.empty(x.shape)
        if x.size:
            self._launch(
                "norm.cu",
                "l2norm",
                (x.size // n,),
                (128,),
                [ptr(x.ptr), ptr(out.ptr), i32(n), f32(eps)],
            )
        return out

    def rms_norm_gated(self, x, gate, weight, eps: float) -> DeviceArray:
        x, z = self._f32(x, "rms_norm_gated x"), self._f32(gate, "rms_norm_gated gate")
        w = self._f32(weight, "rms_norm_gated weight")
        assert x.shape == z.shape and w.size == x.shape[-1]
        n = x.shape[-1]
        out = self.empty(x.shape)
        if x.size:
            self._launch(
                "norm.cu",
                "rms_norm_gated",
                (x.size // n,),
                (128,),
                [ptr(x.ptr), ptr(z.ptr), ptr(w.ptr), ptr(out.ptr), i32(n), f32(eps)],
            )
        return out

    def causal_conv1d(self, x, weight, state, all_states: bool = False, act: bool = False):
        """x (T, C), weight (C, K), state (K-1, C) -> (out (T, C), new_state (K-1, C)), or the
        state after every token (T, K-1, C) with `all_states`; SiLU fused with `act`."""
        x, w = self._f32(x, "conv x"), self._f32(weight, "conv weight")
        st = self._f32(state, "conv state")
        t, c = x.shape
        kk = w.shape[-1]
        assert w.size == c * kk and st.shape == (kk - 1, c) and 1 <= kk <= 8
        out, new_state = self.empty((t, c)), self.empty((kk - 1, c))
        self._launch(
            "gdn.cu",
            "causal_conv1d",
            (-(-c // 256),),
            (256,),
            [
                ptr(x.ptr),
                ptr(w.ptr),
                ptr(st.ptr),
                ptr(out.ptr),
                ptr(new_state.ptr),
                i32(t),
                i32(c),
                i32(kk),
                i32(int(act)),
            ],
        )
        return out, (self._conv_windows(x, st) if all_states else new_state)

    def _conv_windows(self, x: DeviceArray, state: DeviceArray) -> DeviceArray:
        """The conv state after each token: windows (T, K-1, C) of the last K-1 inputs of
        [state; x], copied on the device (exact, as numpy_ref's sliding windows)."""
        t, c = x.shape
        k1 = state.shape[0]
        full = self.empty((k1 + t, c))  # (K-1+T, C)
        full[:k1][:] = state
        full[k1:][:] = x
        states = self.empty((t, k1, c))
        for i in range(t):
            states[i][:] = full[i + 1 : i + 1 + k1]
        return states

    def gated_delta_rule(
        self, q, k, v, g, beta, state, scale: float | None = None, all_states: bool = False
    ):
        """q, k (T, nk, dk); v (T, nv, dv); g, beta (T, nv); state (nv, dk, dv) ->
        (out (T, nv, dv), new_state), or the state after every token (T, nv, dk, dv) with
        `all_states` (one launch per token). The input state is not modified."""
        q, k, v = (self._f32(a, "gdn q/k/v") for a in (q, k, v))
        g, beta = self._f32(g, "gdn g"), self._f32(beta, "gdn beta")
        st = self._f32(state, "gdn state").copy()
        t, nk, dk = q.shape
        _, nv, dv = v.shape
        assert k.shape == q.shape and v.shape[0] == t and g.shape == (t, nv) == beta.shape
        assert st.shape == (nv, dk, dv) and nv % nk == 0
        assert 256 % dv == 0 and dk % (256 // dv) == 0 and dk * dv <= 64 * 256 and dk <= 256, (
            f"gdn kernel limits: dv | 256, dk*dv <= 16384 (dk {dk}, dv {dv})"
        )
        scale = scale if scale is not None else dk**-0.5
        out = self.empty((t, nv, dv))
        if not all_states:
            self._gdn_recurrent(q, k, v, g, beta, st, out, scale)
            return out, st
        states = self.empty((t, nv, dk, dv))
        for i in range(t):  # the kernel keeps S in registers: one launch per kept state
            one = slice(i, i + 1)
            self._gdn_recurrent(q[one], k[one], v[one], g[one], beta[one], st, out[one], scale)
            states[i][:] = st
        return out, states

    def _gdn_recurrent(self, q, k, v, g, beta, st, out, scale: float) -> None:
        """gdn.cu's gdn_recurrent over q's T tokens, updating `st` in place."""
        t, nk, dk = q.shape
        _, nv, dv = v.shape
        self._launch(
            "gdn.cu",
            "gdn_recurrent",
            (nv,),
            (256,),
            [
                ptr(q.ptr),
                ptr(k.ptr),
                ptr(v.ptr),
                ptr(g.ptr),
                ptr(beta.ptr),
                ptr(st.ptr),
                ptr(out.ptr),
                i32(t),
                i32(nk),
                i32(nv),
                i32(dk),
                i32(dv),
                f32(scale),
            ],
        )

    def gated_delta_rule_chunked(self, q, k, v, g, beta, state, scale=None, chunk: int = 64):
        """Same result as gated_delta_rule. The chunked (UT-transform) prefill kernel is not
        written yet: this runs the recurrent kernel over all T tokens in one launch."""
        return self.gated_delta_rule(q, k, v, g, beta, state, scale)

    # -- token selection ------------------------------------------------------------------
    def argmax(self, logits) -> int:
        x = self._f32(logits, "argmax logits")
        out = self.empty((1,), np.int32)
        self._launch("sample.cu", "argmax", (1,), (1024,), [ptr(x.ptr), i32(x.size), ptr(out.ptr)])
        return int(out.numpy()[0])

    def sample(
        self, logits, top_k: int, top_p: float, min_p: float, temperature: float, u: float
    ) -> int:
        """sample.py's chain (top-k, top-p, min-p, temperature) with the uniform draw `u`;
        temperature 0 is argmax. top_k must be 1..256 (sample.cu SAMPLE_KMAX)."""
        if temperature == 0:
            return self.argmax(logits)
        x = self._f32(logits, "sample logits")
        assert 1 <= top_k <= SAMPLE_KMAX, f"device sampling needs 1 <= top_k <= {SAMPLE_KMAX}"
        out = self.empty((1,), np.int32)
        self._launch(
            "sample.cu",
            "sample_topk_topp",
            (1,),
            (1024,),
            [
                ptr(x.ptr),
                i32(x.size),
                i32(top_k),
                f32(top_p),
                f32(min_p),
                f32(temperature),
                f32(u),
                ptr(out.ptr),
            ],
        )
        return int(out.numpy()[0])

    # -- FP8 / bf16 conversions (KV cache and scales), exposed for tests ------------------
    def fp8_decode(self, codes: np.ndarray) -> np.ndarray:
        raw = self._upload_bytes(np.ascontiguousarray(codes, np.uint8))
        n = int(np.asarray(codes).size)
        out = self.empty((n,))
        self._launch(
            "dequant.cu", "fp8_decode", (_blocks(n),), (256,), [ptr(raw.ptr), ptr(out.ptr), i32(n)]
        )
        return out.numpy()

    def fp8_encode(self, x: np.ndarray) -> np.ndarray:
        d = self._f32(np.asarray(x, np.float32).reshape(-1), "fp8_encode x")
        buf = self.rt.alloc(max(d.size, 4))
        self._launch(
            "dequant.cu",
            "fp8_encode",
            (_blocks(d.size),),
            (256,),
            [ptr(d.ptr), ptr(buf.ptr), i32(d.size)],
        )
        out = np.empty(d.size, np.uint8)
        self.rt.d2h(out, buf)
        return out


def Arg_u32(bits: int) -> rt.Arg:  # noqa: N802 (reads like the other Arg constructors)
    """A 32-bit unsigned argument: passed as int32 with the same bits."""
    return i32(int(np.array(bits, np.uint32).view(np.int32)))


# -- opening a device ----------------------------------------------------------------------


def open_device(device: str, kv_dtype: str = "bf16") -> NativeOps:
    """NativeOps on "cuda", "hip" or "emu"; a DeviceError (one line, what to install) when the
    runtime cannot start."""
    from atlas_cli.errors import DeviceError

    if device == "cuda":
        from atlas_cli.backend.ops import runtime_cuda as mod

        unavailable = mod.CudaUnavailable
        make = mod.CudaRuntime
    elif device == "hip":
        from atlas_cli.backend.ops import runtime_hip as mod

        unavailable = mod.HipUnavailable
        make = mod.HipRuntime
    elif device == "emu":
        from atlas_cli.backend.ops.runtime_emu import EmuRuntime as make

        unavailable = RuntimeError
    else:
        raise DeviceError(f"unknown native device {device!r} (cuda, hip)")
    try:
        return NativeOps(make(), kv_dtype=kv_dtype)
    except unavailable as exc:
        raise DeviceError(f"--device {device}: {exc}") from None


def kernel_report(device: str) -> dict[str, Any]:
    """For `atlas hw`: compile (or load from the on-disk cache) every kernel file for this
    device and say, per file, how long it took and whether the cache was hit. Raises
    DeviceError when the device's runtime is unavailable."""
    return open_device(device).warmup()


def probe(device: str) -> dict[str, Any]:
    """For `atlas hw`: whether the runtime for "cuda" / "hip" is usable here, without compiling
    anything; never raises."""
    if device == "cuda":
        from atlas_cli.backend.ops import runtime_cuda

        return runtime_cuda.probe()
    if device == "hip":
        from atlas_cli.backend.ops import runtime_hip

        return runtime_hip.probe()
    return {"runtime": device, "available": False, "reason": "unknown device"}
