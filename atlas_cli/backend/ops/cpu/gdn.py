"""The chunked Gated DeltaNet prefill of the fast CPU path (numpy_ref.gated_delta_rule_chunked,
the UT form), one task per value head on numba's pool.

numpy's version spends most of its time in per-row einsum calls of the forward substitution
and in small BLAS matmuls (2/3 of a Qwen3.5 0.8B prefill's linear-attention time, 1/3 of the
whole prefill). Here a chunk's products are `tile_dots` on the chunk's rows, the substitution
is row updates along dk and dv, and the state is kept transposed, (dv, dk), so that every
product reads rows.
"""

from __future__ import annotations

import platform

import numpy as np

from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.kernels import tile_dots  # noqa: E402

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_FTZ_DAZ = (1 << 15) | (1 << 6)  # MXCSR: flush subnormal results, read subnormal inputs as 0


@intrinsic
def _set_mxcsr(typingctx, flags):
    """On x86 set the calling thread's MXCSR to `flags | FTZ | DAZ` (flags < 0: the current
    value) and return the value before; elsewhere a no-op returning 0. A chunk's decays reach
    exp(-100) and less, and on x86 every float32 operation on a subnormal costs a microcode
    assist: with them the chunk ran 15x slower on the tests' decays. Flushed, nothing below
    1.2e-38 survives, which no output can tell."""
    sig = types.int32(types.int32)

    def codegen(context, b, signature, args):
        if not _X86:
            return ir.Constant(ir.IntType(32), 0)
        i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        store = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.sse.stmxcsr")
        load = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.sse.ldmxcsr")
        slot = cgutils.alloca_once(b, i32)
        b.call(store, [b.bitcast(slot, i8p)])
        old = b.load(slot)
        flags = args[0]
        negative = b.icmp_signed("<", flags, ir.Constant(i32, 0))
        new = b.select(negative, b.or_(old, ir.Constant(i32, _FTZ_DAZ)), flags)
        b.store(new, slot)
        b.call(load, [b.bitcast(slot, i8p)])
        return old

    return sig, codegen


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale: float | None = None, chunk=64):
    """numpy_ref.gated_delta_rule_chunked's result: q, k (T, nk, dk) L2-normalised, v (T, nv,
    dv), g (log-decay) and beta (T, nv), state (nv, dk, dv). Returns (out (T, nv, dv), state)."""
    f32 = np.float32
    q, k, v, g, beta = (np.ascontiguousarray(a, f32) for a in (q, k, v, g, beta))
    scale = f32(scale if scale is not None else q.shape[-1] ** -0.5)
    state_t = np.ascontiguousarray(np.asarray(state, f32).transpose(0, 2, 1))  # (nv, dv, dk)
    out = np.empty(v.shape, f32)
    _chunks(q, k, v, g, beta, state_t, scale, chunk, out)
    return out, np.ascontiguousarray(state_t.transpose(0, 2, 1))


@njit(parallel=True, cache=True, fastmath=True)
def _chunks(q, k, v, g, beta, state_t, scale, chunk, out):
    n_tok, nk = q.shape[0], q.shape[1]
    nv = v.shape[1]
    for h in prange(nv):
        hk = h // (nv // nk)  # value head h reads key head h // (nv / nk) (repeat_interleave)
        st = state_t[h]  # (dv, dk), updated in place
        saved = _set_mxcsr(-1)  # subnormals flushed for this task, restored after it
        for c0 in range(0, n_tok, chunk):
            _chunk(q, k, v, g, beta, st, scale, h, hk, c0, min(chunk, n_tok - c0), out)
        _set_mxcsr(saved)


@njit(cache=True, fastmath=True)
def _chunk(q, k, v, g, beta, st, scale, h, hk, c0, n, out):
    """One chunk of n tokens from c0 for value head h: out rows and the state st (dv, dk)."""
    dk, dv = q.shape[2], v.shape[2]
    cum = np.empty(n, np.float32)  # log-decay from the chunk start, inclusive
    kc, kb = np.empty((n, dk), np.float32), np.empty((n, dk), np.float32)
    qc, u = np.empty((n, dk), np.float32), np.empty((n, dv), np.float32)
    total = np.float32(0.0)
    for i in range(n):
        total += g[c0 + i, h]
        cum[i] = total
        b = beta[c0 + i, h]
        for d in range(dk):
            kc[i, d] = k[c0 + i, hk, d]
            kb[i, d] = kc[i, d] * b
            qc[i, d] = q[c0 + i, hk, d] * scale
        for d in range(dv):
            u[i, d] = v[c0 + i, h, d] * b
    a, attn = np.empty((n, n), np.float32), np.empty((n, n), np.float32)
    tile_dots(kb, kc, n, a, 0)  # (k beta) k^T
    tile_dots(qc, kc, n, attn, 0)  # q k^T
    for i in range(n):
        for j in range(n):
            decay = np.exp(cum[i] - cum[j]) if j <= i else np.float32(0.0)
            attn[i, j] *= decay  # causal, the diagonal included
            a[i, j] = a[i, j] * decay if j < i else np.float32(0.0)
    from_start = np.exp(cum)  # each token's decay since the chunk start
    w = np.empty((n, dk), np.float32)
    for i in range(n):
        for d in range(dk):
            w[i, d] = kb[i, d] * from_start[i]
    # (I + A) [u w] = [v beta, k beta exp(cum)]: forward substitution, one row at a time
    for i in range(1, n):
        for j in range(i):
            c = a[i, j]
            for d in range(dv):
                u[i, d] -= c * u[j, d]
            for d in range(dk):
                w[i, d] -= c * w[j, d]
    predicted = np.empty((n, dv), np.float32)
    tile_dots(w, st, dv, predicted, 0)  # w @ S
    v_new_t = np.empty((dv, n), np.float32)  # what the old state does not already predict
    for i in range(n):
        for d in range(dv):
            v_new_t[d, i] = u[i, d] - predicted[i, d]
        for d in range(dk):
            qc[i, d] *= from_start[i]
    from_state, from_chunk = np.empty((n, dv), np.float32), np.empty((n, dv), np.float32)
    tile_dots(qc, st, dv, from_state, 0)  # (q exp(cum)) @ S
    tile_dots(attn, v_new_t, dv, from_chunk, 0)  # attn @ v_new
    for i in range(n):
        for d in range(dv):
            out[c0 + i, h, d] = from_state[i, d] + from_chunk[i, d]
    last = cum[n - 1]
    k_t = np.empty((dk, n), np.float32)  # (k exp(last - cum))^T
    for i in range(n):
        e = np.exp(last - cum[i])
        for d in range(dk):
            k_t[d, i] = kc[i, d] * e
    update = np.empty((dv, dk), np.float32)
    tile_dots(v_new_t, k_t, dk, update, 0)  # (v_new^T k exp(last - cum)): S^T's increment
    e = np.exp(last)
    for r in range(dv):
        for d in range(dk):
            st[r, d] = st[r, d] * e + update[r, d]
