"""Launchers that read weights in their stored format: upload, dequantize, embedding, linear."""

from __future__ import annotations

from typing import Any

import numpy as np

import atlas_cli.backend.formats as formats
from atlas_cli.backend.formats import QuantizedWeight, StoredRows, WeightFormat
from atlas_cli.backend.ops.native import gemm_check
from atlas_cli.backend.ops.native.array import (
    DeviceArray,
    DeviceOpsBase,
    DeviceWeight,
    f32_to_bf16_bits,
)
from atlas_cli.backend.ops.native.runtime import f32, i32, i64, ptr

GEMV_MAX_T = 8  # gemv.cu GEMV_MAX_T
# the width of gemv.cuh's block-scale loads (gemv_aligned): 4 bytes, else 2, else none
SCALE_LOAD_BYTES = {f: 4 for f in ("q4_1", "q5_1", "iq4_xs")} | {
    f: 2 for f in ("nvfp4", "q4_0", "q8_0", "q6_k", "q5_0", "q3_k", "iq4_nl")
}
# gemv_mma.cu's formats: the decoded codes are exact f16 halves
MMA_VERIFY_FORMATS = frozenset(
    ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "nvfp4")
    + ("q5_0", "q5_1", "q3_k", "iq4_nl", "iq4_xs")
)


class WeightLaunchers(DeviceOpsBase):
    # Prompt tokens per prefill forward (backend/engine.py). Every forward streams each weight
    # from DRAM once per 512 tokens (gemm.cu's groups of token tiles) and at least once: a
    # 256-token chunk reads them twice as often, and each forward's small launches (norms,
    # GDN, attention) are paid per chunk. attention.cu keeps no score matrix (one tile of
    # scores per block), so what grows with the chunk is the activations, linear in T: the
    # MLP's (T, intermediate) and, for Engine.logits, (T, vocab).
    PREFILL_CHUNK = 2048
    _gemm_choices: dict | None = None  # kind -> GemmChoice, decided at its first GEMM
    _scratches: dict | None = None  # _scratch

    def prepare_weight(self, w) -> DeviceWeight:
        """A loader's weight -> DeviceWeight: formats the kernels decode as they are stored
        (GGUF blocks, most with their scales split off and some with their codes reordered by
        formats.split_blocks; NVFP4 codes + E4M3 scales + global scale) as they are; a float
        array in the narrowest float format that holds it exactly (the loaders widen bf16 and
        f16 to float32 losslessly, so this is the checkpoint's own format), or rounded to bf16 /
        kept f32 when the ops were made with weight_dtype="bf16" / "f32"."""
        if isinstance(w, DeviceWeight):
            return w
        if isinstance(w, QuantizedWeight) and w.format.native:
            return self._upload_stored(w.format, w.shape, w.stored())
        a = np.asarray(w, np.float32)
        if a.ndim == 1:
            a = a.reshape(1, -1)
        assert a.ndim == 2, f"weight {a.shape}: 2-D expected"
        fmt = self._float_format(a)
        if fmt == "f32":
            data = np.ascontiguousarray(a)
        elif fmt == "f16":
            data = a.astype(np.float16).view(np.uint16)
        else:
            data = f32_to_bf16_bits(a)
        return DeviceWeight(
            fmt, *a.shape, self._upload_bytes(data), a.shape[1] * data.itemsize, self._dummy, 0, 1.0
        )

    def _float_format(self, a: np.ndarray) -> str:
        """ "bf16", "f16" or "f32" for the float32 weight `a` (see prepare_weight)."""
        if self.weight_dtype != "stored":
            return self.weight_dtype
        if not (np.ascontiguousarray(a).view(np.uint32) & 0xFFFF).any():
            return "bf16"  # the low 16 bits are zero: a widened bf16
        with np.errstate(over="ignore"):
            if np.array_equal(a.astype(np.float16).astype(np.float32), a, equal_nan=True):
                return "f16"
        return "f32"

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
        whole = not fmt.quantized or cols % 32 == 0  # kernels read blocks in 32-element units
        assert whole and raw.shape[1] == cols // fmt.block_elems * fmt.block_bytes, (
            f"{fmt.kernel} weight {shape}: {raw.shape[1]} bytes per row"
        )
        codes, scales = formats.split_blocks(fmt, raw) if fmt.device_layout else (raw, None)
        sbuf, srow = (
            (self._dummy, 0) if scales is None else (self._upload_bytes(scales), scales.shape[1])
        )
        return DeviceWeight(
            fmt.kernel, rows, cols, self._upload_bytes(codes), codes.shape[1], sbuf, srow, 1.0
        )

    def _wargs(self, w: DeviceWeight) -> list:
        return [ptr(w.data.ptr), ptr(w.scales.ptr), f32(w.gscale)]

    def dequantize(self, w: DeviceWeight) -> DeviceArray:
        """The whole weight as float32 (rows, cols), bit-exact with the numpy dequantizers."""
        assert isinstance(w, DeviceWeight)
        out = self.empty((w.rows, w.cols))
        units = -(-w.cols // 32)
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
        if t > GEMV_MAX_T:
            kind, defines = self._prefill_gemm(w)
            return self.gemm(x, w, b, defines, out, kind)
        if t > 1 and self._verify_on_mma(w):
            return self.gemv_mma(x, w, b, self.gemm_choice("verify").defines, out)
        return self.gemv(x, w, b, out)

    def gemv(self, x: DeviceArray, w: DeviceWeight, b, out: DeviceArray) -> DeviceArray:
        """gemv.cu for T <= 8: the T == 1 body, or gemv_t8 (T FFMAs per weight)."""
        args = self._linear_args(x, w, b, out)
        name = f"gemv_{w.fmt}" if x.shape[0] == 1 else f"gemv_t8_{w.fmt}"  # its own registers
        self._launch("gemv.cu", name, (-(-w.rows // 8),), (256,), args)
        return out

    def _verify_on_mma(self, w: DeviceWeight) -> bool:
        """Whether 2 <= T <= 8 multiplies `w` on the tensor cores (gemv_mma.cu): a format it
        has, 16-byte aligned rows and block scales (the kernel's loads), and a device whose
        kernel passed its check."""
        if w.fmt not in MMA_VERIFY_FORMATS or (w.data.ptr | w.row_bytes) % 16:
            return False
        if (w.scales.ptr | w.srow_bytes) % SCALE_LOAD_BYTES.get(w.fmt, 1):
            return False
        return self.gemm_choice("verify").kernel == "tensor-core"

    def gemv_mma(self, x: DeviceArray, w: DeviceWeight, b, defines, out=None) -> DeviceArray:
        """y = x w^T (+ b) for 2 <= T <= 8 by gemv_mma.cu compiled with `defines`: x scaled and
        split into f16 fragments once (gemv_mma_x), then one MMA per 16 x 16 x 8 of weights."""
        t, cols = x.shape
        assert 1 <= t <= GEMV_MAX_T and w.fmt in MMA_VERIFY_FORMATS, (t, w.fmt)
        out = self.empty((t, w.rows)) if out is None else out
        slices = -(-cols // 1024) * 64  # whole tiles of 32 units, zero past cols
        xf = self._scratch("vf", slices * 32 * 4, np.uint32)
        xsum = self._scratch("vsum", slices * 8, np.float32)
        xscale = self._scratch("vscale", 8, np.float32)
        pairing = 1 if w.fmt == "nvfp4" else 0  # gemv_mma.cu GVM_PAIR_FP4 / GVM_PAIR_NIB
        xargs = [ptr(x.ptr), ptr(xf.ptr), ptr(xsum.ptr), ptr(xscale.ptr), i32(t), i32(cols)]
        runs = min(16, -(-slices // 64))  # blocks per token: a tile's slices or more each
        self.rt.launch(self._fn("gemv_mma.cu", "gemv_mma_x", defines), (8, runs), (256,),
                       [*xargs, i32(pairing)])  # fmt: skip
        args = self._linear_args(x, w, b, out)
        args[3:4] = [ptr(xf.ptr), ptr(xsum.ptr), ptr(xscale.ptr)]  # x -> its fragments
        fn = self._fn("gemv_mma.cu", f"gemv_mma_{w.fmt}", defines)
        self.rt.launch(fn, (-(-w.rows // 32),), (256,), args)
        return out

    def _linear_args(self, x: DeviceArray, w: DeviceWeight, b, out: DeviceArray) -> list:
        """The argument list gemv.cu and gemm.cu share."""
        return [
            *self._wargs(w),
            ptr(x.ptr),
            ptr(b.ptr if b is not None else 0),
            ptr(out.ptr),
            i32(x.shape[0]),
            i32(w.rows),
            i32(w.cols),
            i64(w.row_bytes),
            i64(w.srow_bytes),
        ]

    def gemm_choice(self, kind: str | None = None) -> gemm_check.GemmChoice:
        """The tensor-core GEMM of `kind` (default self.prefill), or the portable build of the
        same file where its first-use check failed."""
        kind = kind or self.prefill
        if self._gemm_choices is None:
            self._gemm_choices = {}
        if kind not in self._gemm_choices:
            self._gemm_choices[kind] = gemm_check.choose(self, kind)
        return self._gemm_choices[kind]

    def _prefill_gemm(self, w: DeviceWeight) -> tuple[str, dict | None]:
        """(kind, defines) of the GEMM that multiplies `w` in prefill: self.prefill's, except
        that "fp4" covers only NVFP4 weights it can take (whole 128-column steps, 16-byte
        aligned rows) on a device whose W4A4 kernel passed its check; the rest run "fast"."""
        kind = self.prefill
        if kind == "fp4":
            choice = self.gemm_choice("fp4")
            takes = w.fmt == "nvfp4" and w.cols % 128 == 0 and w.row_bytes % 16 == 0
            if takes and w.data.ptr % 16 == 0 and choice.defines is None:
                return "fp4", None
            kind = "fast"
        return kind, self.gemm_choice(kind).defines

    def gemm(self, x: DeviceArray, w: DeviceWeight, b, defines, out=None, kind=None) -> DeviceArray:
        """The prefill GEMM of `kind` (default self.prefill) compiled with `defines` (None: the
        tensor-core build, gemm_check.PORTABLE: the portable one) on x (T, in), w, bias b or
        None -> (T, out). Kinds: "fast" (gemm_fast.cu: x and the weights rounded to bf16, one
        MMA per product), "exact" (gemm.cu: float32-exact), "fp4" (gemm_fp4.cu: NVFP4
        weights, x quantized to NVFP4, the block-scaled FP4 MMA)."""
        kind = kind or self.prefill
        t = x.shape[0]
        out = self.empty((t, w.rows)) if out is None else out
        file = gemm_check.FILES[kind]

        def fn(entry: str):
            return self._fn(file, entry, defines)

        args = self._linear_args(x, w, b, out)
        if kind == "exact":
            grid = (-(-t // 64) * -(-w.rows // 64),)  # 64 x 64 tiles, grouped in gemm.cu
            self.rt.launch(fn(f"gemm_{w.fmt}"), grid, (256,), args)
            return out
        tail = args[4:]  # bias, y, T, rows, cols, row bytes: after W, S, gs and x
        grid = (-(-t // 64) * -(-w.rows // 128),)  # 64 x 128 tiles, grouped as in gemm.cu
        if kind == "fp4":
            assert w.fmt == "nvfp4" and w.cols % 128 == 0, f"fp4 GEMM of {w.fmt} {w.shape}"
            xq = self._scratch("xq", t * w.cols // 2, np.uint8)
            xs = self._scratch("xs", t * w.cols // 16, np.uint8)
            xg = self._scratch("xg", t, np.float32)
            qargs = [ptr(x.ptr), ptr(xq.ptr), ptr(xs.ptr), ptr(xg.ptr), i32(t), i32(w.cols)]
            self.rt.launch(fn("gemm_x_nvfp4"), (t,), (256,), qargs)
            args = [*self._wargs(w), ptr(xq.ptr), ptr(xs.ptr), ptr(xg.ptr), *tail]
            self.rt.launch(fn("gemm_fp4_nvfp4"), grid, (256,), args)
        else:
            ld = -(-w.cols // 64) * 64  # whole 64-column steps, zero past cols
            xb = self._scratch("xb", t * ld, np.uint16)
            xargs = [ptr(x.ptr), ptr(xb.ptr), i32(t), i32(w.cols), i32(ld)]
            self.rt.launch(fn("gemm_x_bf16"), (min(-(-t * ld // 256), 4096),), (256,), xargs)
            args = [*self._wargs(w), ptr(xb.ptr), i32(ld), *tail]
            self.rt.launch(fn(f"gemm_fast_{w.fmt}"), grid, (256,), args)
        return out

    def _scratch(self, name: str, n: int, dtype) -> DeviceArray:
        """A GEMM's copy of x (bf16, or NVFP4 codes, scales and global scales): one buffer per
        name, grown to the largest prompt chunk and kept, so a captured graph's launches keep
        pointing at live memory."""
        if self._scratches is None:
            self._scratches = {}
        buf = self._scratches.get(name)
        if buf is None or buf.size < n:
            buf = self._scratches[name] = self.empty((max(n, 1),), dtype)
        return buf

    def warmup(self) -> dict[str, Any]:
        """DeviceOpsBase.warmup, and which GEMM and verify GEMV run (checked here on first use)."""
        info = super().warmup()
        return {
            **info,
            "gemm": self.gemm_choice().report(),
            "verify": self.gemm_choice("verify").report(),
        }
