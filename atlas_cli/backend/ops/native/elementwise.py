"""Launchers of the norms, activations, RoPE and the elementwise glue of `DeviceArray`."""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.ops.native.array import DeviceArray, DeviceOpsBase, blocks_for
from atlas_cli.backend.ops.native.runtime import f32, i32, i64, ptr


class ElementwiseLaunchers(DeviceOpsBase):
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

    def silu_mul(self, gate, up) -> DeviceArray:
        gate, up = self._f32(gate, "silu_mul gate"), self._f32(up, "silu_mul up")
        assert gate.shape == up.shape, f"silu_mul: {gate.shape} vs {up.shape}"
        out = self.empty(gate.shape)
        self._launch(
            "elementwise.cu",
            "silu_mul",
            (blocks_for(gate.size),),
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
            (blocks_for(x.size),),
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
                (blocks_for(x.size),),
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
                (blocks_for(a.size),),
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
            (blocks_for(a.size),),
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
                (blocks_for(out.size),),
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
