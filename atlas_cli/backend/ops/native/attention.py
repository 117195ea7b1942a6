"""The device KV cache and the attention launchers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.cache import GROW_STEP, KVCacheBase, grown_capacity, saved_length
from atlas_cli.backend.ops.native.array import DeviceArray, DeviceOpsBase
from atlas_cli.backend.ops.native.runtime import f32, i32, ptr

KV_DTYPES = ("bf16", "fp8", "f32")
ATTN_HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # attention.cu's attn_*_hd<N>
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)  # attention_mma.cuh's attn_prefill_*_hd<N>
PREFILL_ROWS = 64  # query rows (token x head of one group) per prefill block
# Below this many new tokens the row kernel runs: decode (T = 1) and speculative verify
# batches (T <= 8, the GEMV's column limit), where a 64-row tile would be mostly empty.
PREFILL_MIN_T = 9


def row_kernel_rows(t: int, group: int) -> int:
    """Query rows (warps) per block of the row kernel attn_<kv>_hd<N>: a block covers a decode
    step's whole group (up to 8 heads) so that each KV head is read once."""
    return min(8, max(4, t * group))


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

    def __init__(
        self,
        ops: AttentionLaunchers,
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
        self._cap = min(GROW_STEP, max_len)
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

    # -- for the prefix pool: sizes, copies and host arrays of the raw K/V bytes --------------

    @property
    def nbytes(self) -> int:
        return 2 * len(self.layers) * self.nkv * self._cap * self.hd * self.esize

    def _empty(self) -> KVCache:
        return KVCache(
            self.ops, len(self.layers), self.nkv, self.hd, self.max_len,
            self.dtype, self.k_scale, self.v_scale,
        )  # fmt: skip

    def clone(self, length: int) -> KVCache:
        n = self.reusable(length)
        new = self._empty()
        new.reserve(n)
        src_head, dst_head = self._cap * self.hd * self.esize, new._cap * self.hd * self.esize
        for src, dst in zip(self.layers, new.layers, strict=True):
            for old, buf in zip(src, dst, strict=True):
                for h in range(self.nkv):
                    if n:
                        self.ops.rt.d2d(
                            buf, h * dst_head, old, h * src_head, n * self.hd * self.esize
                        )
        new.length = n
        return new

    def export(self) -> dict[str, np.ndarray]:
        """Each layer's K and V as raw bytes (nkv, length, hd * element size), uint8."""
        out = {"length": np.asarray(self.length)}
        for i, pair in enumerate(self.layers):
            for name, buf in zip("kv", pair, strict=True):
                host = np.empty((self.nkv, self._cap, self.hd * self.esize), np.uint8)
                self.ops.rt.d2h(host, buf)
                out[f"{name}{i}"] = host[:, : self.length]
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        n = saved_length(arrays, self.max_len)
        self.reserve(n)
        shape = (self.nkv, n, self.hd * self.esize)
        for i, pair in enumerate(self.layers):
            for name, buf in zip("kv", pair, strict=True):
                got = arrays.get(f"{name}{i}")
                if got is None or got.shape != shape or got.dtype != np.uint8:
                    raise ValueError(f"saved {name}{i} is not {self.dtype} K/V bytes {shape}")
                host = np.zeros((self.nkv, self._cap, self.hd * self.esize), np.uint8)
                host[:, :n] = got
                self.ops.rt.h2d(buf, host)
        self.length = n


class AttentionLaunchers(DeviceOpsBase):
    # Prefill on the tensor-core kernel; off where its first-use check against the portable
    # build failed (attention_check.py), and then the row kernel runs every T.
    prefill_tensor_cores = True
    # The head sizes of the model families atlas runs (SmolLM2 64; Llama, Qwen3 128; Qwen3.5's
    # gated attention 256): what `atlas hw` has the first-use check run for.
    REPORTED_HEAD_DIMS = (64, 128, 256)

    def prefill_report(self) -> dict[str, str]:
        """The prefill attention kernel as `atlas hw` reports it: on a device, the first-use
        check of the tensor-core kernel for this ops' KV type at REPORTED_HEAD_DIMS (cached
        like the compiled kernels, so it runs once per build)."""
        if self.rt.name not in ("cuda", "hip"):
            why = f"the {self.rt.name} runtime runs the portable MMA (checked on a device)"
            return {"kernel": "tensor-core", "reason": why}
        dims = self.REPORTED_HEAD_DIMS
        failed = [hd for hd in dims if not self._prefill_ok(self.kv_dtype, hd)]
        if not failed:
            checked = "/".join(map(str, dims))
            why = f"matches the portable build ({self.kv_dtype} KV, head dims {checked})"
            return {"kernel": "tensor-core", "reason": why}
        failures = "; ".join(self.__dict__.get("prefill_check_failures", []))
        kernel = "row" if len(failed) == len(dims) else "tensor-core and row"
        return {"kernel": kernel, "reason": failures}

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
        prefill = t >= PREFILL_MIN_T and hd in PREFILL_HEAD_DIMS and self._prefill_ok(k.dtype, hd)
        rows_per_block = PREFILL_ROWS if prefill else row_kernel_rows(t, g)
        blocks = -(-(t * g) // rows_per_block) * nkv
        if nsplit is None:
            # split the keys only when there are few blocks to spread over the GPU
            if prefill:
                nsplit = 1 if blocks >= 64 else max(1, min(32, s // 1024))
            else:
                nsplit = 1 if t * g * nkv >= 256 else max(1, min(32, s // 512))
        split_len = -(-s // nsplit)
        split_len = -(-split_len // 64) * 64
        nsplit = -(-s // split_len)
        if nsplit > 1:
            part_o = self.empty((nsplit, t, nh, hd))
            part_ml = self.empty((nsplit, t, nh, 2))
        else:
            part_o = part_ml = out
        name = f"attn_prefill_{k.dtype}_hd{hd}" if prefill else f"attn_{k.dtype}_hd{hd}"
        grid = (-(-(t * g) // rows_per_block), nkv, nsplit)
        args = [ptr(q.ptr), ptr(k.buf.ptr), ptr(v.buf.ptr), f32(k.scale), f32(v.scale)]
        args += [ptr(out.ptr), ptr(part_o.ptr), ptr(part_ml.ptr), i32(t), i32(nh), i32(nkv)]
        args += [i32(k.cap), i32(start), ptr(0), i32(split_len)]
        block = 128 if prefill else 32 * rows_per_block
        self._launch("attention.cu", name, grid, (block,), args)
        if nsplit > 1:
            args = [ptr(part_o.ptr), ptr(part_ml.ptr), ptr(out.ptr), i32(nsplit), i32(t * nh)]
            self._launch("attention.cu", "attn_combine", (t * nh,), (128,), [*args, i32(hd)])
        return out

    def _prefill_ok(self, kv_dtype: str, hd: int) -> bool:
        """The tensor-core prefill for (kv_dtype, hd), checked once against its portable build
        on a real device (attention_check.py); the emulator runs the portable MMA anyway."""
        if not self.prefill_tensor_cores:
            return False
        if self.rt.name not in ("cuda", "hip"):
            return True
        checked = self.__dict__.setdefault("_prefill_checked", {})
        if (kv_dtype, hd) not in checked:
            checked[kv_dtype, hd] = True  # the check's own launch takes the tensor-core path
            from atlas_cli.backend.ops.native.attention_check import check_prefill

            checked[kv_dtype, hd] = check_prefill(self, kv_dtype, hd)
        return checked[kv_dtype, hd]

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
