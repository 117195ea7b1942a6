"""Launchers of the Gated DeltaNet pieces (Qwen3.5 linear attention): causal conv, delta rule."""

from __future__ import annotations

from atlas_cli.backend.ops.native.array import DeviceArray, DeviceOpsBase
from atlas_cli.backend.ops.native.runtime import f32, i32, ptr

CHUNK = 64  # gdn.cu GDN_C: tokens per chunk of the chunked kernels
CHUNK_MAX_DK = 128  # gdn.cu GDN_CDK: the state slab's rows in shared memory
# The chunked form costs two launches and a 64-token chunk's worth of work even for a few
# tokens; below this the recurrent kernel (serial in T, no scratch) is the cheaper one.
CHUNKED_MIN_T = 32
# Tokens per prep + scan launch pair: bounds the scratch (W, U, P, cum: dk + dv + 65 floats
# per token and value head, 126 MB for 2048 tokens of the 27B's 48 heads of 128 x 128).
CHUNK_SEGMENT = 2048


class GatedDeltaNetLaunchers(DeviceOpsBase):
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
        parts = min(256 // dv, dk) if dv <= 256 else 0  # gdn.cu: row parts of S per column
        assert parts and 256 % dv == 0 and dk % parts == 0 and dk // parts <= 64 and dk <= 256, (
            f"gdn kernel limits: dv | 256, min(256/dv, dk) | dk, dk*dv <= 16384 (dk {dk}, dv {dv})"
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
        """Same result as gated_delta_rule, by gdn.cu's chunked (UT-transform) prefill kernels
        for T >= CHUNKED_MIN_T and dk <= 128; shorter runs (and wider key heads) take the
        recurrent kernel. `chunk` is fixed at 64 by the kernel (the argument is the contract's)."""
        q, k, v = (self._f32(a, "gdn q/k/v") for a in (q, k, v))
        t, nk, dk = q.shape
        _, nv, dv = v.shape
        if t < CHUNKED_MIN_T or dk > CHUNK_MAX_DK:
            return self.gated_delta_rule(q, k, v, g, beta, state, scale)
        g, beta = self._f32(g, "gdn g"), self._f32(beta, "gdn beta")
        st = self._f32(state, "gdn state").copy()
        assert k.shape == q.shape and v.shape[0] == t and g.shape == (t, nv) == beta.shape
        assert st.shape == (nv, dk, dv) and nv % nk == 0
        scale = scale if scale is not None else dk**-0.5
        out = self.empty((t, nv, dv))
        nch = -(-min(t, CHUNK_SEGMENT) // CHUNK)
        scratch = (  # W, U, P, cum per (head, chunk), reused by every segment
            self.empty((nv, nch, CHUNK, dk)),
            self.empty((nv, nch, CHUNK, dv)),
            self.empty((nv, nch, CHUNK, CHUNK)),
            self.empty((nv, nch, CHUNK)),
        )
        for t0 in range(0, t, CHUNK_SEGMENT):  # bounded scratch: the state carries over
            seg = slice(t0, min(t, t0 + CHUNK_SEGMENT))
            self._gdn_chunked(
                q[seg], k[seg], v[seg], g[seg], beta[seg], st, out[seg], scratch, scale
            )
        return out, st

    def _gdn_chunked(self, q, k, v, g, beta, st, out, scratch, scale: float) -> None:
        """gdn_chunk_prep over every chunk of q's T tokens, then gdn_chunk_scan, which updates
        `st` in place."""
        t, nk, dk = q.shape
        _, nv, dv = v.shape
        nch = -(-t // CHUNK)
        wbuf, ubuf, pbuf, cbuf = (ptr(a.ptr) for a in scratch)
        dims = [i32(t), i32(nk), i32(nv), i32(dk), i32(dv), f32(scale)]
        self._launch(
            "gdn.cu",
            "gdn_chunk_prep",
            (nch, nv),
            (256,),
            [ptr(q.ptr), ptr(k.ptr), ptr(v.ptr), ptr(g.ptr), ptr(beta.ptr), wbuf, ubuf, pbuf, cbuf]
            + dims,
        )
        self._launch(
            "gdn.cu",
            "gdn_chunk_scan",
            (nv, -(-dv // 32)),
            (256,),
            [ptr(q.ptr), ptr(k.ptr), wbuf, ubuf, pbuf, cbuf, ptr(st.ptr), ptr(out.ptr)] + dims,
        )
