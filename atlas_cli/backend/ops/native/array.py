"""Device memory for the native ops: `DeviceArray`, `DeviceWeight`, and `DeviceOpsBase`, the
plumbing every launcher family (native/*.py) builds on: allocation, uploads, kernel compilation
and launch.

`DeviceArray` implements the small part of the numpy array protocol the model files use
(reshape, leading-axis views, last-axis slices, + - * / with broadcasting of a trailing row,
`np.asarray` to come back to the host) and nothing more; its arithmetic runs on the launchers
of the `NativeOps` that owns it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.ops.native import runtime as rt
from atlas_cli.backend.ops.native.runtime import i32, i64, ptr

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


def blocks_for(n: int, per: int = 256, cap: int = 8192) -> int:
    """Thread blocks of `per` threads for `n` elements: at least 1, at most `cap` (the
    grid-stride kernels loop over the rest)."""
    return max(1, min(cap, -(-n // per)))


def Arg_u32(bits: int) -> rt.Arg:  # noqa: N802 (reads like the other Arg constructors)
    """A 32-bit unsigned argument: passed as int32 with the same bits."""
    return i32(int(np.array(bits, np.uint32).view(np.int32)))


class DeviceArray:
    """A contiguous device array (float32 or int32) owned by a NativeOps (`ops`)."""

    __array_ufunc__ = None  # numpy defers `ndarray * DeviceArray` to our __rmul__

    def __init__(self, ops: Any, buf, shape: tuple[int, ...], dtype, offset: int = 0):
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

    def __iter__(self):
        """The rows along the leading axis, as views (`zip(drafts, logits[1:])`)."""
        return (self[i] for i in range(self.shape[0]))

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
        if key is None:  # x[None]: a new leading axis of 1
            return self.reshape(1, *self.shape)
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
    scales: Any  # NVFP4: rows x cols/16 E4M3 codes; GGUF blocks with device_split: the blocks'
    # scales (and Q5_0's, Q5_1's qh word: formats.split_blocks); else a 1-byte dummy
    srow_bytes: int
    gscale: float

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


class DeviceOpsBase:
    """What every launcher family shares: the runtime, allocation and uploads, compiled
    kernels by (file, name), and the asserts' float32 check."""

    def __init__(
        self,
        runtime,
        kv_dtype: str = "bf16",
        weight_dtype: str = "stored",
        prefill: str = "fast",
        lm_head: str = "stored",
    ):
        self.rt = runtime
        self.NAME = runtime.name
        self.kv_dtype = kv_dtype
        assert weight_dtype in ("stored", "bf16", "f32"), f"weight dtype {weight_dtype!r}"
        self.weight_dtype = weight_dtype  # float weights: as stored, or forced (prepare_weight)
        assert prefill in ("fast", "exact", "fp4"), f"prefill {prefill!r}"
        self.prefill = prefill  # the prefill GEMM's kind (weights.gemm)
        self.lm_head = lm_head  # or a format an untied float lm_head is requantized to (placement)
        self.poison = False  # tests: fill every new output with NaN to catch unwritten elements
        self._fns: dict[tuple, Any] = {}
        self._uploads: dict[str, tuple[np.ndarray, DeviceArray]] = {}
        self._dummy = runtime.alloc(16)

    def with_kv_dtype(self, kv_dtype: str):
        """These ops (same runtime, same compiled kernels) making caches of `kv_dtype`: a model
        loaded with its own --kv-type leaves other models' caches as they were."""
        if kv_dtype == self.kv_dtype:
            return self
        other = copy.copy(self)
        other.kv_dtype = kv_dtype
        return other

    def _fn(self, file: str, name: str, defines: dict | None = None):
        """Entry point `name` of `file` compiled with `defines`, compiled once."""
        key = (file, name, *sorted((defines or {}).items()))
        if key not in self._fns:
            self._fns[key] = self.rt.compile(file, defines).function(name)
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

    def _upload_bytes(self, a: np.ndarray):
        buf = self.rt.alloc(max(a.nbytes, 4))
        self.rt.h2d(buf, np.ascontiguousarray(a))
        return buf

    def _f32(self, x, what: str) -> DeviceArray:
        x = self.asarray(x) if not isinstance(x, DeviceArray) else x
        assert x.dtype == np.float32, f"{what}: float32 expected, got {x.dtype}"
        return x

    def _fill32(self, x: DeviceArray, bits: int, n: int) -> None:
        self._launch(
            "elementwise.cu",
            "fill32",
            (blocks_for(n),),
            (256,),
            [ptr(x.ptr), Arg_u32(bits), i64(n)],
        )

    def fill(self, x: DeviceArray, value: float) -> None:
        assert x.dtype == np.float32
        bits = int(np.array(value, np.float32).view(np.uint32))
        self._fill32(x, bits, x.size)
