"""Numba kernels of the fast CPU path: products straight on GGUF blocks, and the fused decode step.

Weights stay in their GGUF blocks. The inner loops, one block of a row at a time, are written as
LLVM vector IR (numba `@intrinsic`): numba's own loop vectoriser unrolls the 16-byte nibble loops
of these formats completely and then leaves them scalar, or vectorises across rows with gathers,
which measured 2-7x slower per core. Here each block becomes a handful of <16 x float>
operations: load the quants, widen, convert, multiply with x, and accumulate scaled by the
block's float16 scale.
Activations and accumulators are float32 (llama.cpp instead rounds x to int8 first).

Every @njit function lives in this one file and is cached on disk (`cache=True`): numba checks
only the timestamp of the file that holds a cached function, so keeping callers and callees
together keeps the cache valid. Shapes: H hidden size, I MLP size, L layers, S cached positions.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys

import numpy as np

from atlas_cli.backend import formats


def _preload_tbb() -> None:
    """Make numba's default threading layer TBB where the `tbb` wheel is installed.

    TBB hands out work by stealing, so when another process takes one of the cores the other
    thread finishes the loop; OpenMP's static split waits for the preempted thread, and on a
    busy 2-core machine that made each decode step 10-50x slower (docs/architecture.md).
    numba's PyPI wheel looks for libtbb.so.12 only on the system library path, while the tbb
    wheel installs it into <prefix>/lib: loading it first makes it resolvable by soname."""
    if sys.platform != "linux":
        return
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(path):
            with contextlib.suppress(OSError):  # numba then falls back to OpenMP
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def _threads_from_env() -> int | None:
    """ATLAS_THREADS as numba's pool size. It has to be in the environment before numba starts:
    `numba.set_num_threads` only applies to the calling thread, and the server decodes on a
    worker thread."""
    value = os.environ.get("ATLAS_THREADS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        from atlas_cli.errors import UsageError

        raise UsageError(f"ATLAS_THREADS must be a positive whole number, got {value!r}")
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = value
    return int(value)


_preload_tbb()
_THREADS = _threads_from_env()

from llvmlite import ir  # noqa: E402  (after the TBB preload, before numba starts its threads)
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.core.config import NUMBA_NUM_THREADS as _POOL  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

if _THREADS is not None and _POOL != _THREADS:  # numba started before us: this thread only
    from numba import set_num_threads

    set_num_threads(min(_THREADS, _POOL))

# The formats computed on here (backend/formats.py), by ggml type id, with their kernel blocks:
# the float formats are read 16 elements (one <16 x float>) at a time.
F32, F16, BF16 = formats.F32.ggml_type, formats.F16.ggml_type, formats.BF16.ggml_type
Q4_0, Q4_1, Q8_0 = formats.Q4_0.ggml_type, formats.Q4_1.ggml_type, formats.Q8_0.ggml_type
Q4_K, Q5_K, Q6_K = formats.Q4_K.ggml_type, formats.Q5_K.ggml_type, formats.Q6_K.ggml_type
BLOCKS = {
    tid: (f.block_elems, f.block_bytes) if f.quantized else (16, 16 * f.block_bytes)
    for tid, f in formats.GGML.items()
    if f.cpu
}
GROUP = 32  # the "x sums" every kernel receives are sums over consecutive 32-element groups

# ---------------------------------------------------------------------------------------------
# LLVM IR building blocks

_F32 = ir.FloatType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_HALF = ir.HalfType()
_VF = ir.VectorType(_F32, 16)
_VI32 = ir.VectorType(_I32, 16)
_FAST = ("fast",)  # reassociation and contraction: only in the dot products, never in dequant


def _i64(n: int) -> ir.Constant:
    return ir.Constant(_I64, n)


def _vi(n: int) -> ir.Constant:
    return ir.Constant(_VI32, [n] * 16)


def _at(b: ir.IRBuilder, ptr, offset: int):
    return b.gep(ptr, [_i64(offset)]) if offset else ptr


def _splat(b: ir.IRBuilder, value) -> ir.Value:
    vec = b.insert_element(ir.Constant(_VF, ir.Undefined), value, ir.Constant(_I32, 0))
    return b.shuffle_vector(vec, ir.Constant(_VF, ir.Undefined), ir.Constant(_VI32, [0] * 16))


def _half(b: ir.IRBuilder, p, offset: int) -> ir.Value:
    """The float16 at byte `offset` of block `p`, as float32 (exact)."""
    return b.fpext(b.load(b.bitcast(_at(b, p, offset), _HALF.as_pointer()), align=1), _F32)


def _byte(b: ir.IRBuilder, p, offset: int) -> ir.Value:
    return b.zext(b.load(_at(b, p, offset)), _I32)


def _bytes16(b: ir.IRBuilder, p, offset: int, signed: bool = False) -> ir.Value:
    """16 bytes from byte `offset` of `p`, widened to <16 x i32>."""
    v = b.load(b.bitcast(_at(b, p, offset), ir.VectorType(_I8, 16).as_pointer()), align=1)
    return b.sext(v, _VI32) if signed else b.zext(v, _VI32)


def _floats16(b: ir.IRBuilder, p_f32, offset: int) -> ir.Value:
    return b.load(b.bitcast(_at(b, p_f32, offset), _VF.as_pointer()), align=4)


class _Group:
    """Values `scale * q (+|-) offset` for some 16-element pieces of a block. `q` vectors are
    float32; `scale` None means 1; `xs_index` is the 32-group whose x-sum multiplies `offset`."""

    def __init__(self, scale, pieces, offset=None, sign=1, xs_index=0):
        self.scale, self.pieces, self.offset, self.sign, self.xs_index = (
            scale,
            pieces,
            offset,
            sign,
            xs_index,
        )


# Per-type block decoders: (builder, i8* block) -> [_Group]. Element order and the order of the
# float operations follow loaders/quant.py (and ggml's dequantize_row_*), so dequantization here
# is bit-exact with the reference.


def _emit_f32(b, p):
    q = b.load(b.bitcast(p, _VF.as_pointer()), align=1)
    return [_Group(None, [(q, 0)])]


def _emit_f16(b, p):
    vh = ir.VectorType(_HALF, 16)
    q = b.fpext(b.load(b.bitcast(p, vh.as_pointer()), align=1), _VF)
    return [_Group(None, [(q, 0)])]


def _emit_bf16(b, p):
    v16 = ir.VectorType(_I16, 16)
    bits = b.zext(b.load(b.bitcast(p, v16.as_pointer()), align=1), _VI32)
    return [_Group(None, [(b.bitcast(b.shl(bits, _vi(16)), _VF), 0)])]


def _emit_q4_0(b, p):
    d = _half(b, p, 0)
    q = _bytes16(b, p, 2)
    lo = b.sitofp(b.sub(b.and_(q, _vi(15)), _vi(8)), _VF)
    hi = b.sitofp(b.sub(b.lshr(q, _vi(4)), _vi(8)), _VF)
    return [_Group(d, [(lo, 0), (hi, 16)])]


def _emit_q4_1(b, p):
    d, m = _half(b, p, 0), _half(b, p, 2)
    q = _bytes16(b, p, 4)
    lo = b.uitofp(b.and_(q, _vi(15)), _VF)
    hi = b.uitofp(b.lshr(q, _vi(4)), _VF)
    return [_Group(d, [(lo, 0), (hi, 16)], offset=m, sign=1)]


def _emit_q8_0(b, p):
    d = _half(b, p, 0)
    q0 = b.sitofp(_bytes16(b, p, 2, signed=True), _VF)
    q1 = b.sitofp(_bytes16(b, p, 18, signed=True), _VF)
    return [_Group(d, [(q0, 0), (q1, 16)])]


def _k_scales(b, p):
    """(d * sc, dmin * m) as float32 for the 8 sub-blocks of a Q4_K/Q5_K block (ggml's
    get_scale_min_k4 on the 12 packed bytes at offset 4)."""
    d, dmin = _half(b, p, 0), _half(b, p, 2)
    s = [_byte(b, p, 4 + i) for i in range(12)]
    c63, c15, c6, c4 = (ir.Constant(_I32, n) for n in (63, 15, 6, 4))
    out = []
    for j in range(8):
        if j < 4:
            sc, mn = b.and_(s[j], c63), b.and_(s[j + 4], c63)
        else:
            sc = b.or_(b.and_(s[j + 4], c15), b.shl(b.lshr(s[j - 4], c6), c4))
            mn = b.or_(b.lshr(s[j + 4], c4), b.shl(b.lshr(s[j], c6), c4))
        out.append((b.fmul(d, b.uitofp(sc, _F32)), b.fmul(dmin, b.uitofp(mn, _F32))))
    return out


def _emit_q4_k(b, p):
    scales = _k_scales(b, p)
    groups = []
    for c in range(4):  # qs[32c + l]: sub-block 2c in the low nibble, 2c+1 in the high one
        qa, qb = _bytes16(b, p, 16 + 32 * c), _bytes16(b, p, 32 + 32 * c)
        for nib in range(2):
            j = 2 * c + nib

            def part(q, nib=nib):
                return b.uitofp(b.and_(q, _vi(15)) if nib == 0 else b.lshr(q, _vi(4)), _VF)

            base = 64 * c + 32 * nib
            pieces = [(part(qa), base), (part(qb), base + 16)]
            groups.append(_Group(scales[j][0], pieces, scales[j][1], sign=-1, xs_index=j))
    return groups


def _emit_q5_k(b, p):
    scales = _k_scales(b, p)
    qh = (_bytes16(b, p, 16), _bytes16(b, p, 32))
    groups = []
    for c in range(4):
        qs = (_bytes16(b, p, 48 + 32 * c), _bytes16(b, p, 64 + 32 * c))
        for nib in range(2):
            j = 2 * c + nib
            pieces = []
            for half in range(2):
                low = b.and_(qs[half], _vi(15)) if nib == 0 else b.lshr(qs[half], _vi(4))
                high = b.shl(b.and_(b.lshr(qh[half], _vi(j)), _vi(1)), _vi(4))  # bit j of qh[l]
                pieces.append((b.uitofp(b.or_(low, high), _VF), 64 * c + 32 * nib + 16 * half))
            groups.append(_Group(scales[j][0], pieces, scales[j][1], sign=-1, xs_index=j))
    return groups


def _emit_q6_k(b, p):
    d = _half(b, p, 208)
    groups = []
    for h in range(2):  # two 128-element halves
        for k in range(4):  # element 32k + l: nibble of ql[l + 32 (k % 2)], bits 2k.. of qh[l]
            for lh in range(2):
                ql = _bytes16(b, p, 64 * h + 32 * (k % 2) + 16 * lh)
                qh = _bytes16(b, p, 128 + 32 * h + 16 * lh)
                low = b.and_(ql, _vi(15)) if k < 2 else b.lshr(ql, _vi(4))
                high = b.shl(b.and_(b.lshr(qh, _vi(2 * k)), _vi(3)), _vi(4))
                q = b.sitofp(b.sub(b.or_(low, high), _vi(32)), _VF)
                s = 8 * h + 2 * k + lh  # the int8 scale of these 16 elements
                sc = b.sitofp(b.sext(b.load(_at(b, p, 192 + s)), _I32), _F32)
                groups.append(_Group(b.fmul(d, sc), [(q, 128 * h + 32 * k + 16 * lh)]))
    return groups


_EMITTERS = {
    F32: _emit_f32,
    F16: _emit_f16,
    BF16: _emit_bf16,
    Q4_0: _emit_q4_0,
    Q4_1: _emit_q4_1,
    Q8_0: _emit_q8_0,
    Q4_K: _emit_q4_k,
    Q5_K: _emit_q5_k,
    Q6_K: _emit_q6_k,
}


def _ptr(context, builder, aryty, value):
    return context.make_array(aryty)(context, builder, value).data


def _make_row_dot(type_id: int):
    emit = _EMITTERS[type_id]
    elems, nbytes = BLOCKS[type_id]

    @intrinsic
    def row_dot(typingctx, w, woff, x, xoff, xs, xsoff, nblocks):
        """sum(row * x) for the `nblocks` blocks at byte `woff` of uint8 `w` and the float32
        `x[xoff:]`; `xs[xsoff:]` holds the 32-element sums of that x (for min/offset terms)."""
        sig = types.float32(w, woff, x, xoff, xs, xsoff, nblocks)

        def codegen(context, b, signature, args):
            wv, woffv, xv, xoffv, xsv, xsoffv, nbv = args
            ats = signature.args
            row = b.gep(_ptr(context, b, ats[0], wv), [woffv])
            xrow = b.gep(_ptr(context, b, ats[2], xv), [xoffv])
            xsrow = b.gep(_ptr(context, b, ats[4], xsv), [xsoffv])
            # Two independent sets of accumulators, for even and odd blocks: one chain of
            # dependent adds per block would make the adds' latency the limit (4 cycles on
            # recent x86 per block of ~5 cycles of work).
            zero = ir.Constant(_VF, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(2)] for _ in range(2)]
            accm = [cgutils.alloca_once_value(b, ir.Constant(_F32, 0.0)) for _ in range(2)]

            def block(index, unit):
                blk = b.gep(row, [b.mul(index, _i64(nbytes))])
                xb = b.gep(xrow, [b.mul(index, _i64(elems))])
                for gi, g in enumerate(emit(b, blk)):
                    t = None
                    for q, off in g.pieces:
                        prod = b.fmul(q, _floats16(b, xb, off), flags=_FAST)
                        t = prod if t is None else b.fadd(t, prod, flags=_FAST)
                    if g.scale is not None:
                        t = b.fmul(_splat(b, g.scale), t, flags=_FAST)
                    acc = accs[unit][gi % 2]  # K-quant blocks have 8-16 groups
                    b.store(b.fadd(b.load(acc), t, flags=_FAST), acc)
                    if g.offset is not None:
                        gidx = b.add(b.mul(index, _i64(elems // GROUP)), _i64(g.xs_index))
                        term = b.fmul(g.offset, b.load(b.gep(xsrow, [gidx])), flags=_FAST)
                        op = b.fadd if g.sign > 0 else b.fsub
                        b.store(op(b.load(accm[unit]), term, flags=_FAST), accm[unit])

            with cgutils.for_range(b, b.sdiv(nbv, _i64(2))) as loop:
                first = b.mul(loop.index, _i64(2))
                block(first, 0)
                block(b.add(first, _i64(1)), 1)
            with b.if_then(b.icmp_signed("!=", b.srem(nbv, _i64(2)), _i64(0))):
                block(b.sub(nbv, _i64(1)), 0)
            total = b.fadd(b.load(accs[0][0]), b.load(accs[0][1]), flags=_FAST)
            total = b.fadd(total, b.load(accs[1][0]), flags=_FAST)
            total = b.fadd(total, b.load(accs[1][1]), flags=_FAST)
            fnty = ir.FunctionType(_F32, [_F32, _VF])
            name = "llvm.vector.reduce.fadd.v16f32"
            reduce = cgutils.get_or_insert_function(b.module, fnty, name)
            hsum = b.call(reduce, [ir.Constant(_F32, -0.0), total], fastmath=_FAST)
            tail = b.fadd(b.load(accm[0]), b.load(accm[1]), flags=_FAST)
            return b.fadd(hsum, tail, flags=_FAST)

        return sig, codegen

    return row_dot


def _make_row_dequant(type_id: int):
    emit = _EMITTERS[type_id]
    elems, nbytes = BLOCKS[type_id]

    @intrinsic
    def row_dequant(typingctx, w, woff, out, ooff, nblocks):
        """out[ooff : ooff + nblocks * block_elems] = the float32 values of the blocks at byte
        `woff` of `w`. No fast-math: bit-exact with loaders/quant.py."""
        sig = types.none(w, woff, out, ooff, nblocks)

        def codegen(context, b, signature, args):
            wv, woffv, ov, ooffv, nbv = args
            ats = signature.args
            row = b.gep(_ptr(context, b, ats[0], wv), [woffv])
            orow = b.gep(_ptr(context, b, ats[2], ov), [ooffv])
            with cgutils.for_range(b, nbv) as loop:
                blk = b.gep(row, [b.mul(loop.index, _i64(nbytes))])
                ob = b.gep(orow, [b.mul(loop.index, _i64(elems))])
                for g in emit(b, blk):
                    for q, off in g.pieces:
                        v = q if g.scale is None else b.fmul(_splat(b, g.scale), q)
                        if g.offset is not None:
                            op = b.fadd if g.sign > 0 else b.fsub
                            v = op(v, _splat(b, g.offset))
                        b.store(v, b.bitcast(_at(b, ob, off), _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return row_dequant


_dot_f32, _deq_f32 = _make_row_dot(F32), _make_row_dequant(F32)
_dot_f16, _deq_f16 = _make_row_dot(F16), _make_row_dequant(F16)
_dot_bf16, _deq_bf16 = _make_row_dot(BF16), _make_row_dequant(BF16)
_dot_q4_0, _deq_q4_0 = _make_row_dot(Q4_0), _make_row_dequant(Q4_0)
_dot_q4_1, _deq_q4_1 = _make_row_dot(Q4_1), _make_row_dequant(Q4_1)
_dot_q8_0, _deq_q8_0 = _make_row_dot(Q8_0), _make_row_dequant(Q8_0)
_dot_q4_k, _deq_q4_k = _make_row_dot(Q4_K), _make_row_dequant(Q4_K)
_dot_q5_k, _deq_q5_k = _make_row_dot(Q5_K), _make_row_dequant(Q5_K)
_dot_q6_k, _deq_q6_k = _make_row_dot(Q6_K), _make_row_dequant(Q6_K)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits`."""
    sig = types.float32(types.int32)

    def codegen(context, b, signature, args):
        return b.bitcast(args[0], _F32)

    return sig, codegen


@njit(cache=True, fastmath=True, inline="always")
def fast_exp(x):
    """exp(x) in float32 within 2 ulp (Cephes expf: exp(x) = 2^n * exp(r), |r| <= ln2/2),
    with x clamped to [-87.3, 88]. Unlike libm's expf it is branch-free and inlined, so loops
    over it vectorise; softmax and SiLU spend much of their time here."""
    x = min(max(x, np.float32(-87.33654)), np.float32(88.0))  # 2^n stays a normal float
    n = np.floor(x * np.float32(1.442695041) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


# ---------------------------------------------------------------------------------------------
# Type dispatch (a branch per row is noise next to a row's hundreds of elements)


@njit(cache=True)
def row_dot(t, w, woff, x, xoff, xs, xsoff, nb):
    """Dot product of one stored row (type `t`, `nb` blocks at byte `woff` of `w`) with x."""
    if t == Q4_1:
        return _dot_q4_1(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q8_0:
        return _dot_q8_0(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q4_0:
        return _dot_q4_0(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q4_K:
        return _dot_q4_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q6_K:
        return _dot_q6_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == Q5_K:
        return _dot_q5_k(w, woff, x, xoff, xs, xsoff, nb)
    if t == F16:
        return _dot_f16(w, woff, x, xoff, xs, xsoff, nb)
    if t == BF16:
        return _dot_bf16(w, woff, x, xoff, xs, xsoff, nb)
    return _dot_f32(w, woff, x, xoff, xs, xsoff, nb)


@njit(cache=True)
def row_dequant(t, w, woff, out, ooff, nb):
    """Write the float32 values of one stored row into out[ooff:]."""
    if t == Q4_1:
        _deq_q4_1(w, woff, out, ooff, nb)
    elif t == Q8_0:
        _deq_q8_0(w, woff, out, ooff, nb)
    elif t == Q4_0:
        _deq_q4_0(w, woff, out, ooff, nb)
    elif t == Q4_K:
        _deq_q4_k(w, woff, out, ooff, nb)
    elif t == Q6_K:
        _deq_q6_k(w, woff, out, ooff, nb)
    elif t == Q5_K:
        _deq_q5_k(w, woff, out, ooff, nb)
    elif t == F16:
        _deq_f16(w, woff, out, ooff, nb)
    elif t == BF16:
        _deq_bf16(w, woff, out, ooff, nb)
    else:
        _deq_f32(w, woff, out, ooff, nb)


@njit(cache=True, fastmath=True)
def group_sums(x, xs):
    """xs[g] = sum(x[32g : 32g + 32]) for each whole 32-group of the 1-D x."""
    for g in range(xs.shape[0]):
        s = np.float32(0.0)
        for i in range(GROUP * g, GROUP * g + GROUP):
            s += x[i]
        xs[g] = s


# ---------------------------------------------------------------------------------------------
# Matrix products on a stored matrix: w is the flat uint8 buffer, the matrix starts at byte
# `off`, stored row `perm[r]` is logical row r (llama.cpp's Q/K row order, undone for free).


@njit(parallel=True, cache=True, fastmath=True)
def gemv_batch(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for a few tokens: each row is read once for all T."""
    n_tok, cols = x.shape
    rows = perm.shape[0]
    xf = x.reshape(-1)  # (T * cols,)
    xs = np.empty(n_tok * (cols // GROUP), np.float32)
    ng = cols // GROUP
    for i in range(n_tok):
        group_sums(x[i], xs[i * ng : (i + 1) * ng])
    for r in prange(rows):
        woff = off + perm[r] * rowbytes
        for i in range(n_tok):
            out[i, r] = row_dot(t, w, woff, xf, i * cols, xs, i * ng, nb)


@njit(parallel=True, cache=True)
def dequant_rows(t, w, off, rowbytes, nb, perm, r0, out):
    """out (R, cols) = float32 values of logical rows r0 .. r0 + R - 1."""
    rows, cols = out.shape
    of = out.reshape(-1)
    for i in prange(rows):
        row_dequant(t, w, off + perm[r0 + i] * rowbytes, of, i * cols, nb)


@njit(parallel=True, cache=True)
def gather_rows(t, w, off, rowbytes, nb, ids, out):
    """Embedding lookup: out (T, cols) = float32 values of rows `ids` (stored order)."""
    cols = out.shape[1]
    of = out.reshape(-1)
    for i in prange(ids.shape[0]):
        row_dequant(t, w, off + ids[i] * rowbytes, of, i * cols, nb)


@njit(cache=True, fastmath=True)
def tile_dots(x, b, nrows, out, r0):
    """out[t, r0 + j] = x[t] . b[j] for every token t and j < nrows: x (T, K), b (>= nrows, K).
    Three tokens times four rows per inner loop: each loaded x and b value feeds several
    multiply-adds (12 accumulators, which LLVM keeps in vector registers), which is what lets
    this reach ~90% of OpenBLAS's single-core sgemm."""
    n_tok, k_len = x.shape
    t = 0
    while t + 2 < n_tok:
        j = 0
        while j + 3 < nrows:
            a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = np.float32(0.0)
            for k in range(k_len):
                x0, x1, x2 = x[t, k], x[t + 1, k], x[t + 2, k]
                b0, b1, b2, b3 = b[j, k], b[j + 1, k], b[j + 2, k], b[j + 3, k]
                a0 += x0 * b0
                a1 += x0 * b1
                a2 += x0 * b2
                a3 += x0 * b3
                c0 += x1 * b0
                c1 += x1 * b1
                c2 += x1 * b2
                c3 += x1 * b3
                e0 += x2 * b0
                e1 += x2 * b1
                e2 += x2 * b2
                e3 += x2 * b3
            out[t, r0 + j], out[t, r0 + j + 1] = a0, a1
            out[t, r0 + j + 2], out[t, r0 + j + 3] = a2, a3
            out[t + 1, r0 + j], out[t + 1, r0 + j + 1] = c0, c1
            out[t + 1, r0 + j + 2], out[t + 1, r0 + j + 3] = c2, c3
            out[t + 2, r0 + j], out[t + 2, r0 + j + 1] = e0, e1
            out[t + 2, r0 + j + 2], out[t + 2, r0 + j + 3] = e2, e3
            j += 4
        while j < nrows:
            a0 = c0 = e0 = np.float32(0.0)
            for k in range(k_len):
                a0 += x[t, k] * b[j, k]
                c0 += x[t + 1, k] * b[j, k]
                e0 += x[t + 2, k] * b[j, k]
            out[t, r0 + j], out[t + 1, r0 + j], out[t + 2, r0 + j] = a0, c0, e0
            j += 1
        t += 3
    while t < n_tok:  # the last one or two tokens
        j = 0
        while j + 3 < nrows:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(k_len):
                x0 = x[t, k]
                a0 += x0 * b[j, k]
                a1 += x0 * b[j + 1, k]
                a2 += x0 * b[j + 2, k]
                a3 += x0 * b[j + 3, k]
            out[t, r0 + j], out[t, r0 + j + 1] = a0, a1
            out[t, r0 + j + 2], out[t, r0 + j + 3] = a2, a3
            j += 4
        while j < nrows:
            a0 = np.float32(0.0)
            for k in range(k_len):
                a0 += x[t, k] * b[j, k]
            out[t, r0 + j] = a0
            j += 1
        t += 1


TILE_ROWS = 16  # rows dequantized per task: small tasks keep both cores busy to the end


@njit(parallel=True, cache=True, fastmath=True)
def gemm(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for many tokens: each task dequantizes TILE_ROWS rows
    once (bit-exact) and multiplies them with every token."""
    cols = x.shape[1]
    rows = perm.shape[0]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for ti in prange(n_tiles):
        r0 = ti * TILE_ROWS
        n = min(TILE_ROWS, rows - r0)
        tile = np.empty((TILE_ROWS, cols), np.float32)
        flat = tile.reshape(-1)
        for j in range(n):
            row_dequant(t, w, off + perm[r0 + j] * rowbytes, flat, j * cols, nb)
        tile_dots(x, tile, n, out, r0)


QUERY_BLOCK = 16


@njit(parallel=True, cache=True, fastmath=True)
def attention(q, k, v, start, out):
    """Causal GQA attention (as numpy_ref.attention): q (T, nh, hd) at positions start..,
    k, v (nkv, S, hd) with S = start + T; out (T, nh, hd). One task per head and block of
    queries; scores come from tile_dots, so each key feeds a block of queries."""
    n_tok, n_heads, hd = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    n_blocks = (n_tok + QUERY_BLOCK - 1) // QUERY_BLOCK
    scale = np.float32(1.0 / math.sqrt(hd))
    for job in prange(n_heads * n_blocks):
        h = job // n_blocks
        i0 = (job % n_blocks) * QUERY_BLOCK
        nq = min(QUERY_BLOCK, n_tok - i0)
        n_keys = start + i0 + nq  # the last query of the block sees this many keys
        qb = np.empty((nq, hd), np.float32)
        for i in range(nq):
            for d in range(hd):
                qb[i, d] = q[i0 + i, h, d] * scale
        scores = np.empty((nq, n_keys), np.float32)
        keys = k[h // group]
        vals = v[h // group]
        tile_dots(qb, keys, n_keys, scores, 0)
        for i in range(nq):
            seen = start + i0 + i + 1  # causal: keys 0 .. start + i0 + i
            best = np.float32(-np.inf)
            for s in range(seen):
                best = max(best, scores[i, s])
            total = np.float32(0.0)
            for s in range(seen):
                e = fast_exp(scores[i, s] - best)
                scores[i, s] = e
                total += e
            inv = np.float32(1.0) / total
            for s in range(seen):
                scores[i, s] *= inv
            for s in range(seen, n_keys):
                scores[i, s] = 0.0
        # P (nq, S) @ V (S, hd) as dot products with the rows of V^T, so tile_dots' register
        # blocking applies here too
        vt = np.empty((hd, n_keys), np.float32)
        for s in range(n_keys):
            for d in range(hd):
                vt[d, s] = vals[s, d]
        ob = np.empty((nq, hd), np.float32)
        tile_dots(scores, vt, hd, ob, 0)
        for i in range(nq):
            for d in range(hd):
                out[i0 + i, h, d] = ob[i, d]


# ---------------------------------------------------------------------------------------------
# The fused decode step: every layer of a Llama-family decoder for one token in one call.
#
# mats (L, 7, 4) int64: for q, k, v, o, gate, up, down: [type, byte offset, row bytes, blocks].
# norms (L, 2, H): input and post-attention RMSNorm weights. bias (L, nq*hd + 2*nkv*hd): q/k/v
# biases (zeros when the model has none). qk_norm (L, 2, hd): per-head q/k norms (used when
# `use_qk_norm`). kc, vc (L, nkv, capacity, hd): the KV cache.

Q, K, V, O, GATE, UP, DOWN = range(7)


@njit(cache=True, fastmath=True)
def _rms_norm_into(x, w, eps, out):
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        ss += x[i] * x[i]
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + np.float32(eps))
    for i in range(n):
        out[i] = x[i] * scale * w[i]


@njit(cache=True, fastmath=True)
def _rope_neox(v, n_heads, hd, cos, sin):
    """In place on v (n_heads * hd,): rotate_half RoPE on the first 2 * len(cos) dims of each
    head (as numpy_ref.rope)."""
    half = cos.shape[0]
    for h in range(n_heads):
        base = h * hd
        for i in range(half):
            a = v[base + i]
            b = v[base + half + i]
            v[base + i] = a * cos[i] - b * sin[i]
            v[base + half + i] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=True)
def _attend_group(q, keys, vals, n_pos, scale, scores, out):
    """Attention of one GQA group's query heads q (g * hd,) over keys/vals (>= n_pos, hd);
    scores (g, >= n_pos) scratch; writes out (g * hd,)."""
    g = scores.shape[0]
    hd = keys.shape[1]
    qs = np.empty((g, hd), np.float32)
    for j in range(g):
        for d in range(hd):
            qs[j, d] = q[j * hd + d] * scale
    tile_dots(qs, keys, n_pos, scores, 0)
    acc = np.zeros((g, hd), np.float32)
    for j in range(g):
        best = np.float32(-np.inf)
        for s in range(n_pos):
            best = max(best, scores[j, s])
        total = np.float32(0.0)
        for s in range(n_pos):
            e = fast_exp(scores[j, s] - best)
            scores[j, s] = e
            total += e
        inv = np.float32(1.0) / total
        for s in range(n_pos):
            scores[j, s] *= inv
    for s in range(n_pos):
        for j in range(g):
            p = scores[j, s]
            for d in range(hd):
                acc[j, d] += p * vals[s, d]
    for j in range(g):
        for d in range(hd):
            out[j * hd + d] = acc[j, d]


@njit(parallel=True, cache=True, fastmath=True)
def decode_step(
    w,  # uint8 (file bytes)
    mats,  # int64 (L, 7, 4)
    perm_q,  # int64 (nq * hd,)
    perm_k,  # int64 (nkv * hd,)
    embed,  # int64 (4,): [type, offset, row bytes, blocks] of the embedding table
    token,
    pos,
    norms,  # float32 (L, 2, H)
    final_norm,  # float32 (H,)
    bias,  # float32 (L, nq*hd + 2*nkv*hd)
    qk_norm,  # float32 (L, 2, hd)
    use_qk_norm,
    inv_freq,  # float32 (rot/2,)
    eps,
    kc,  # float32 (L, nkv, cap, hd)
    vc,
    qkv,  # float32 scratch (nq*hd + 2*nkv*hd,)
    act,  # float32 scratch (I,)
    scores,  # float32 scratch (nq, cap)
    x,  # float32 scratch (H,): the residual stream
    out,  # float32 (H,): the final normed hidden state
):
    n_layers = mats.shape[0]
    n_kv, hd = kc.shape[1], kc.shape[3]
    n_heads = scores.shape[0]
    hidden, inter = x.shape[0], act.shape[0]
    nq, nk = n_heads * hd, n_kv * hd
    n_qkv = nq + 2 * nk
    xn = np.empty(hidden, np.float32)
    att = np.empty(nq, np.float32)
    xs = np.empty(max(hidden, inter, nq) // GROUP, np.float32)  # 32-group sums of the input

    half = inv_freq.shape[0]
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for i in range(half):
        angle = np.float32(pos) * inv_freq[i]  # float32, as numpy_ref.rope
        cos[i] = np.cos(angle)
        sin[i] = np.sin(angle)
    row_dequant(embed[0], w, embed[1] + token * embed[2], x, 0, embed[3])

    group = n_heads // n_kv
    n_pos = pos + 1
    inv_sqrt = np.float32(1.0 / math.sqrt(hd))
    for layer in range(n_layers):
        m = mats[layer]
        # --- attention block
        _rms_norm_into(x, norms[layer, 0], eps, xn)
        group_sums(xn, xs[: hidden // GROUP])
        for r in prange(n_qkv):
            if r < nq:
                t, off, rb, nb, src = m[Q, 0], m[Q, 1], m[Q, 2], m[Q, 3], perm_q[r]
            elif r < nq + nk:
                t, off, rb, nb, src = m[K, 0], m[K, 1], m[K, 2], m[K, 3], perm_k[r - nq]
            else:
                t, off, rb, nb, src = m[V, 0], m[V, 1], m[V, 2], m[V, 3], r - nq - nk
            qkv[r] = row_dot(t, w, off + src * rb, xn, 0, xs, 0, nb) + bias[layer, r]
        q = qkv[:nq]
        k = qkv[nq : nq + nk]
        v = qkv[nq + nk :]
        if use_qk_norm:
            for h in range(n_heads):
                seg = q[h * hd : (h + 1) * hd]
                _rms_norm_into(seg, qk_norm[layer, 0], eps, seg)
            for h in range(n_kv):
                seg = k[h * hd : (h + 1) * hd]
                _rms_norm_into(seg, qk_norm[layer, 1], eps, seg)
        _rope_neox(q, n_heads, hd, cos, sin)
        _rope_neox(k, n_kv, hd, cos, sin)
        for h in range(n_kv):
            kc[layer, h, pos, :] = k[h * hd : (h + 1) * hd]
            vc[layer, h, pos, :] = v[h * hd : (h + 1) * hd]
        for kvh in prange(n_kv):  # the query heads of one KV head share each key and value read
            h0 = kvh * group
            _attend_group(
                q[h0 * hd : (h0 + group) * hd],
                kc[layer, kvh],
                vc[layer, kvh],
                n_pos,
                inv_sqrt,
                scores[h0 : h0 + group],
                att[h0 * hd : (h0 + group) * hd],
            )
        group_sums(att, xs[: nq // GROUP])
        for r in prange(hidden):
            x[r] += row_dot(m[O, 0], w, m[O, 1] + r * m[O, 2], att, 0, xs, 0, m[O, 3])
        # --- MLP block
        _rms_norm_into(x, norms[layer, 1], eps, xn)
        group_sums(xn, xs[: hidden // GROUP])
        for r in prange(inter):
            g = row_dot(m[GATE, 0], w, m[GATE, 1] + r * m[GATE, 2], xn, 0, xs, 0, m[GATE, 3])
            u = row_dot(m[UP, 0], w, m[UP, 1] + r * m[UP, 2], xn, 0, xs, 0, m[UP, 3])
            act[r] = g / (np.float32(1.0) + fast_exp(-g)) * u
        group_sums(act, xs[: inter // GROUP])
        for r in prange(hidden):
            x[r] += row_dot(m[DOWN, 0], w, m[DOWN, 1] + r * m[DOWN, 2], act, 0, xs, 0, m[DOWN, 3])
    _rms_norm_into(x, final_norm, eps, out)


# ---------------------------------------------------------------------------------------------
# Start-up


GEMV_WARM_TOKENS = 8  # any count above cpu_fast.GEMV_MAX_TOKENS: the gemm kernel


def warm_up() -> None:
    """Load every kernel a generation uses (from numba's disk cache, or compile it) by running
    each once on a tiny dummy model with the argument types of real calls."""
    hidden, hd, heads, kv, inter = 32, 16, 2, 1, 32
    nb, rb = 1, BLOCKS[Q8_0][1]  # one Q8_0 block per 32-wide row
    w = np.zeros(64 * rb, np.uint8)
    perm = np.arange(32, dtype=np.int64)
    x = np.zeros((1, hidden), np.float32)
    gemv_batch(Q8_0, w, 0, rb, nb, perm, x, np.empty((1, 32), np.float32))
    x = np.zeros((GEMV_WARM_TOKENS, hidden), np.float32)
    gemm(Q8_0, w, 0, rb, nb, perm, x, np.empty((GEMV_WARM_TOKENS, 32), np.float32))
    gather_rows(Q8_0, w, 0, rb, nb, np.zeros(2, np.int64), np.empty((2, hidden), np.float32))
    q = np.ones((2, heads, hd), np.float32)
    kc = np.ones((kv, 2, hd), np.float32)
    attention(q, kc, kc, 0, np.empty_like(q))
    mats = np.zeros((1, 7, 4), np.int64)
    mats[0, :, 0], mats[0, :, 2], mats[0, :, 3] = Q8_0, rb, nb
    mats[0, O, 3] = mats[0, DOWN, 3] = 1  # o_proj and down_proj read 32 columns too
    cache = np.zeros((1, kv, 4, hd), np.float32)
    decode_step(
        w,
        mats,
        perm,
        perm[: kv * hd],
        np.array([Q8_0, 0, rb, nb], np.int64),
        0,
        0,
        np.ones((1, 2, hidden), np.float32),
        np.ones(hidden, np.float32),
        np.zeros((1, (heads + 2 * kv) * hd), np.float32),
        np.ones((1, 2, hd), np.float32),
        False,
        np.ones(hd // 2, np.float32),
        1e-5,
        cache,
        cache.copy(),
        np.empty((heads + 2 * kv) * hd, np.float32),
        np.empty(inter, np.float32),
        np.empty((heads, 4), np.float32),
        np.empty(hidden, np.float32),
        np.empty(hidden, np.float32),
    )


def kernels_cached() -> bool:
    """Whether numba's disk cache already holds the kernels for this source file (so loading
    takes a fraction of a second instead of a compile). Best effort: numba's cache index is
    not public API, and any surprise counts as cached."""
    try:
        return bool(decode_step._cache._cache_file._load_index())
    except Exception:
        return True


def release_compiler_memory() -> None:
    """Drop LLVM's code pages from this process's resident memory (Linux, MADV_PAGEOUT).

    Once the kernels are loaded, the ~60-70 MB of libllvmlite code that loading touched is
    not run again (unless a new kernel has to be compiled, when the pages fault back in from
    the page cache). Called after `warm_up` and before the weights are first read, it keeps
    the compiler and the weights from being resident at the same time."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            ranges = [
                line.split()[0]
                for line in maps
                if line.rstrip().endswith(".so") and "libllvmlite" in line.rsplit("/", 1)[-1]
            ]
    except (OSError, AttributeError):
        return
    for span in ranges:
        lo, hi = (int(v, 16) for v in span.split("-"))
        madvise(lo, hi - lo, 21)  # MADV_PAGEOUT; clean file pages only, errors are harmless
