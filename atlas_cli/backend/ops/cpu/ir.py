"""The block formats of the fast CPU path as LLVM vector IR (numba `@intrinsic`s).

The inner loops, one block of a row at a time, are written as IR: numba's own loop vectoriser
unrolls the 16-byte nibble loops of these formats completely and then leaves them scalar, or
vectorises across rows with gathers, which measured 2-7x slower per core. Here each block
becomes a handful of <16 x float> operations: load the quants, widen, convert, multiply with x,
and accumulate scaled by the block's float16 scale. One emitter per format describes a block as
groups of `scale * q (+|-) offset`; from it come a row dot product (fast-math) and a row
dequantizer (no fast-math, bit-exact with loaders/quant.py). cpu/kernels.py dispatches on them.
"""

from __future__ import annotations

import atlas_cli.backend.formats as formats
from atlas_cli.backend.loaders.quant import IQ4_VALUES
from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# The formats computed on here (backend/formats.py), by ggml type id, with their kernel blocks:
# the float formats are read 16 elements (one <16 x float>) at a time.
F32, F16, BF16 = formats.F32.ggml_type, formats.F16.ggml_type, formats.BF16.ggml_type
Q4_0, Q4_1, Q8_0 = formats.Q4_0.ggml_type, formats.Q4_1.ggml_type, formats.Q8_0.ggml_type
Q5_0, Q5_1, Q3_K = formats.Q5_0.ggml_type, formats.Q5_1.ggml_type, formats.Q3_K.ggml_type
Q2_K = formats.Q2_K.ggml_type
Q4_K, Q5_K, Q6_K = formats.Q4_K.ggml_type, formats.Q5_K.ggml_type, formats.Q6_K.ggml_type
IQ4_NL, IQ4_XS = formats.IQ4_NL.ggml_type, formats.IQ4_XS.ggml_type
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


def _vi8(n: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I8, 16), [n] * 16)


def _c32(n: int) -> ir.Constant:
    return ir.Constant(_I32, n)


def _at(b: ir.IRBuilder, ptr, offset: int):
    return b.gep(ptr, [_i64(offset)]) if offset else ptr


def _splat(b: ir.IRBuilder, value) -> ir.Value:
    vec = b.insert_element(ir.Constant(_VF, ir.Undefined), value, ir.Constant(_I32, 0))
    return b.shuffle_vector(vec, ir.Constant(_VF, ir.Undefined), ir.Constant(_VI32, [0] * 16))


def sum_lanes(b: ir.IRBuilder, vecs: list):
    """The lane sums of 8 or 16 <16 x float> vectors, as one vector (8 or 16 lanes) and
    lane_of[k], the lane of vecs[k]'s sum. A transposing tree: each step folds two vectors into
    one (two shuffles and an add), so 8 vectors take 24 instructions and 16 take 45, where
    reducing each vector by itself takes about 8 apiece."""
    assert len(vecs) in (8, 16)
    labels = [[k] for k in range(len(vecs))]  # per vector: whose partial sums each group holds
    width = 16  # lanes per group
    while len(vecs) > 1:
        half = width // 2
        lo = []
        for g in range(16 // width):  # group g of the first vector, then of the second
            lo += [g * width + j for j in range(half)] + [16 + g * width + j for j in range(half)]
        hi = [k + half for k in lo]
        folded = []
        for x, y in zip(vecs[0::2], vecs[1::2], strict=True):
            parts = (b.shuffle_vector(x, y, _mask(m)) for m in (lo, hi))
            folded.append(b.fadd(*parts, flags=_FAST))
        labels = [
            [o for pair in zip(a, c, strict=True) for o in pair]
            for a, c in zip(labels[0::2], labels[1::2], strict=True)
        ]
        vecs, width = folded, half
    (v,), (order,) = vecs, labels
    if width == 2:  # 8 groups of 2 lanes
        even, odd = (b.shuffle_vector(v, v, _mask(range(k, 16, 2))) for k in range(2))
        v = b.fadd(even, odd, flags=_FAST)
    return v, {k: lane for lane, k in enumerate(order)}


def _mask(values) -> ir.Constant:
    """A shuffle mask: <n x i32> of `values`."""
    values = list(values)
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


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


def _fifth_bits(b, p, offset: int, first: int) -> ir.Value:
    """<16 x i32>: 16 for element i where bit `first + i` of the little-endian 32-bit qh word
    at byte `offset` of Q5_0/Q5_1 block `p` is set, else 0 (the code's fifth bit)."""
    qh = b.load(b.bitcast(_at(b, p, offset), _I32.as_pointer()), align=1)
    vec = b.insert_element(ir.Constant(_VI32, ir.Undefined), qh, ir.Constant(_I32, 0))
    vec = b.shuffle_vector(vec, ir.Constant(_VI32, ir.Undefined), ir.Constant(_VI32, [0] * 16))
    bits = b.and_(b.lshr(vec, ir.Constant(_VI32, list(range(first, first + 16)))), _vi(1))
    return b.shl(bits, _vi(4))


def _q5_codes(b, p, qh_at: int) -> tuple[ir.Value, ir.Value]:
    """The 5-bit codes of elements 0..15 and 16..31 of a Q5_0/Q5_1 block, as <16 x i32>: the
    low and high nibbles of the 16 bytes after qh, and qh's bits 0..15 and 16..31."""
    q = _bytes16(b, p, qh_at + 4)
    lo = b.or_(b.and_(q, _vi(15)), _fifth_bits(b, p, qh_at, 0))
    hi = b.or_(b.lshr(q, _vi(4)), _fifth_bits(b, p, qh_at, 16))
    return lo, hi


def _emit_q5_0(b, p):
    d = _half(b, p, 0)
    lo, hi = _q5_codes(b, p, 2)
    lo, hi = (b.sitofp(b.sub(q, _vi(16)), _VF) for q in (lo, hi))  # d * (q - 16), as numpy
    return [_Group(d, [(lo, 0), (hi, 16)])]


def _emit_q5_1(b, p):
    d, m = _half(b, p, 0), _half(b, p, 2)
    lo, hi = (b.uitofp(q, _VF) for q in _q5_codes(b, p, 4))
    return [_Group(d, [(lo, 0), (hi, 16)], offset=m, sign=1)]


def _emit_q8_0(b, p):
    d = _half(b, p, 0)
    q0 = b.sitofp(_bytes16(b, p, 2, signed=True), _VF)
    q1 = b.sitofp(_bytes16(b, p, 18, signed=True), _VF)
    return [_Group(d, [(q0, 0), (q1, 16)])]


# IQ4_NL / IQ4_XS: a 4-bit code indexes these non-linear int8 values (ggml's kvalues_iq4nl).
IQ4_TABLE = [int(v) for v in IQ4_VALUES]


def lookup16(b: ir.IRBuilder, table: list[int], codes) -> ir.Value:
    """table[codes] for a 16-entry int8 table and <n x i8> codes below 16, element by element:
    LLVM's x86 backend makes that one pshufb (vpermb with AVX-512 VBMI) where the codes are one
    vector it can see; otherwise it stays n scalar lookups."""
    vec = ir.Constant(ir.VectorType(_I8, 16), table)
    out = ir.Constant(codes.type, ir.Undefined)
    for i in range(codes.type.count):
        at = ir.Constant(_I32, i)
        out = b.insert_element(out, b.extract_element(vec, b.extract_element(codes, at)), at)
    return out


def _iq4_pieces(b, p, offset: int, first: int) -> list:
    """The values of the 32 IQ4 codes in the 16 bytes at `offset` (Q4_0's nibble order: the
    low nibbles are elements first.., the high ones first + 16..), as two <16 x float> pieces.
    Looked up on the bytes, before widening: one pshufb, where 16 floats took 16 scalar
    lookups on AVX2."""
    q = b.load(b.bitcast(_at(b, p, offset), ir.VectorType(_I8, 16).as_pointer()), align=1)
    pieces = []
    for k, nibbles in enumerate((b.and_(q, _vi8(15)), b.lshr(q, _vi8(4)))):
        pieces.append((b.sitofp(lookup16(b, IQ4_TABLE, nibbles), _VF), first + 16 * k))
    return pieces


def _emit_iq4_nl(b, p):
    return [_Group(_half(b, p, 0), _iq4_pieces(b, p, 2, 0))]  # d * value, as numpy


def _iq4_xs_scale(b, p, j: int) -> ir.Value:
    """The int32 scale of sub-block j of an IQ4_XS block: nibble j % 2 of scales_l[j // 2] (at
    4) and bits 2j.. of the little-endian uint16 scales_h (at 2), minus 32."""
    low = b.and_(b.lshr(_byte(b, p, 4 + j // 2), _c32(4 * (j % 2))), _c32(15))
    high = b.and_(b.lshr(_byte(b, p, 2 + j // 4), _c32(2 * (j % 4))), _c32(3))
    return b.sub(b.or_(low, b.shl(high, _c32(4))), _c32(32))


def _emit_iq4_xs(b, p):
    d = _half(b, p, 0)
    groups = []
    for j in range(8):  # sub-block j: the 16 bytes at 8 + 16j
        dl = b.fmul(d, b.sitofp(_iq4_xs_scale(b, p, j), _F32))
        groups.append(_Group(dl, _iq4_pieces(b, p, 8 + 16 * j, 32 * j)))  # (d * scale) * value
    return groups


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


def _emit_q2_k(b, p):
    d, dmin = _half(b, p, 80), _half(b, p, 82)
    groups = []
    for h in range(2):  # two 128-element halves
        for k in range(4):  # element 32k + l: bits 2k.. of qs[32h + l]
            for lh in range(2):
                q = b.lshr(_bytes16(b, p, 16 + 32 * h + 16 * lh), _vi(2 * k))
                q = b.uitofp(b.and_(q, _vi(3)), _VF)
                s = _byte(b, p, 8 * h + 2 * k + lh)  # scale in the low nibble, min in the high
                dl = b.fmul(d, b.uitofp(b.and_(s, _c32(15)), _F32))
                ml = b.fmul(dmin, b.uitofp(b.lshr(s, _c32(4)), _F32))
                # The min is per 16 elements, the x sums per 32: the values themselves, as
                # numpy's (d * sc) * q - (dmin * m), rather than an offset term.
                v = b.fsub(b.fmul(_splat(b, dl), q), _splat(b, ml))
                groups.append(_Group(None, [(v, 128 * h + 32 * k + 16 * lh)]))
    return groups


def _q3_k_scale(b, p, j: int) -> ir.Value:
    """The int32 scale of 16-element group j of a Q3_K block: a nibble of byte j % 8 of the
    packed scales (at 96) and 2 bits of byte 8 + j % 4, minus 32."""
    low = b.and_(b.lshr(_byte(b, p, 96 + j % 8), ir.Constant(_I32, 4 * (j // 8))), _c32(15))
    high = b.and_(b.lshr(_byte(b, p, 104 + j % 4), ir.Constant(_I32, 2 * (j // 4))), _c32(3))
    return b.sub(b.or_(low, b.shl(high, _c32(4))), _c32(32))


def _emit_q3_k(b, p):
    d = _half(b, p, 108)
    groups = []
    for c in range(8):  # element 32c + l: bits 2(c % 4).. of qs[32(c // 4) + l], hmask[l] bit c
        for lh in range(2):
            ql = b.and_(
                b.lshr(_bytes16(b, p, 32 + 32 * (c // 4) + 16 * lh), _vi(2 * (c % 4))), _vi(3)
            )
            clear = b.xor(b.and_(b.lshr(_bytes16(b, p, 16 * lh), _vi(c)), _vi(1)), _vi(1))
            q = b.sitofp(b.sub(ql, b.shl(clear, _vi(2))), _VF)  # minus 4 where the bit is clear
            sc = b.sitofp(_q3_k_scale(b, p, 2 * c + lh), _F32)
            groups.append(_Group(b.fmul(d, sc), [(q, 32 * c + 16 * lh)]))  # (d * sc) * q
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
    Q5_0: _emit_q5_0,
    Q5_1: _emit_q5_1,
    Q8_0: _emit_q8_0,
    IQ4_NL: _emit_iq4_nl,
    IQ4_XS: _emit_iq4_xs,
    Q2_K: _emit_q2_k,
    Q3_K: _emit_q3_k,
    Q4_K: _emit_q4_k,
    Q5_K: _emit_q5_k,
    Q6_K: _emit_q6_k,
}


def _ptr(context, builder, aryty, value):
    return context.make_array(aryty)(context, builder, value).data


# How far ahead of its reads a streaming loop asks for its bytes: the decode GEMVs' weight rows
# (cpu.kernels.prefetch_row) and the decode attention's KV rows (cpu.ir_attention).
PREFETCH_BYTES = 4096


@intrinsic
def prefetch(typingctx, w, start, n):
    """Ask the caches for the 64-byte lines of bytes w[start : start + n] (LLVM's prefetch:
    read, keep in every level; a hint that cannot fault). A decode GEMV streams each weight row
    once from memory: the hardware prefetcher alone left a single core at 5-6 GB/s of the 10-13
    it can read, the kernel waiting on each row's first lines (docs/performance.md)."""
    sig = types.void(w, start, n)

    def codegen(context, b, signature, args):
        wv, startv, nv = args
        base = _ptr(context, b, signature.args[0], wv)
        with cgutils.for_range_slice(b, startv, b.add(startv, nv), _i64(64)) as (at, _):
            prefetch_line(b, b.gep(base, [at]))
        return context.get_dummy_value()

    return sig, codegen


def prefetch_line(b: ir.IRBuilder, address, locality: int = 3) -> None:
    """LLVM's prefetch of the 64-byte line holding `address` (any pointer): read, into every
    level (locality 3) or L2 and beyond (2); a hint that cannot fault, wherever the address
    points."""
    i8p = _I8.as_pointer()
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0i8"
    )
    read, keep, data = ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)
    b.call(fn, [b.bitcast(address, i8p), read, keep, data])


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


dot_f32, deq_f32 = _make_row_dot(F32), _make_row_dequant(F32)
dot_f16, deq_f16 = _make_row_dot(F16), _make_row_dequant(F16)
dot_bf16, deq_bf16 = _make_row_dot(BF16), _make_row_dequant(BF16)
dot_q4_0, deq_q4_0 = _make_row_dot(Q4_0), _make_row_dequant(Q4_0)
dot_q4_1, deq_q4_1 = _make_row_dot(Q4_1), _make_row_dequant(Q4_1)
dot_q5_0, deq_q5_0 = _make_row_dot(Q5_0), _make_row_dequant(Q5_0)
dot_q5_1, deq_q5_1 = _make_row_dot(Q5_1), _make_row_dequant(Q5_1)
dot_q8_0, deq_q8_0 = _make_row_dot(Q8_0), _make_row_dequant(Q8_0)
dot_iq4_nl, deq_iq4_nl = _make_row_dot(IQ4_NL), _make_row_dequant(IQ4_NL)
dot_iq4_xs, deq_iq4_xs = _make_row_dot(IQ4_XS), _make_row_dequant(IQ4_XS)
dot_q2_k, deq_q2_k = _make_row_dot(Q2_K), _make_row_dequant(Q2_K)
dot_q3_k, deq_q3_k = _make_row_dot(Q3_K), _make_row_dequant(Q3_K)
dot_q4_k, deq_q4_k = _make_row_dot(Q4_K), _make_row_dequant(Q4_K)
dot_q5_k, deq_q5_k = _make_row_dot(Q5_K), _make_row_dequant(Q5_K)
dot_q6_k, deq_q6_k = _make_row_dot(Q6_K), _make_row_dequant(Q6_K)


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits`."""
    sig = types.float32(types.int32)

    def codegen(context, b, signature, args):
        return b.bitcast(args[0], _F32)

    return sig, codegen


def _half_convert(to_float: bool):
    """An intrinsic converting n elements between float16 bits (uint16) and float32, 16 at a
    time (one vcvtph2ps / vcvtps2ph with F16C), then one by one. IEEE conversions, no
    fast-math: float16 -> float32 is exact, float32 -> float16 rounds to nearest even, as
    numpy's astype does."""
    src_elem, dst_elem = (_HALF, _F32) if to_float else (_F32, _HALF)
    convert = "fpext" if to_float else "fptrunc"

    @intrinsic
    def half_convert(typingctx, src, soff, dst, doff, n):
        sig = types.none(src, soff, dst, doff, n)

        def codegen(context, b, signature, args):
            sv, soffv, dv, doffv, nv = args
            ats = signature.args
            s = b.bitcast(_ptr(context, b, ats[0], sv), src_elem.as_pointer())
            d = b.bitcast(_ptr(context, b, ats[2], dv), dst_elem.as_pointer())
            s, d = b.gep(s, [soffv]), b.gep(d, [doffv])
            vs, vd = ir.VectorType(src_elem, 16), ir.VectorType(dst_elem, 16)
            n16 = b.sdiv(nv, _i64(16))
            with cgutils.for_range(b, n16) as loop:
                i = b.mul(loop.index, _i64(16))
                v = b.load(b.bitcast(b.gep(s, [i]), vs.as_pointer()), align=2)
                out = b.bitcast(b.gep(d, [i]), vd.as_pointer())
                b.store(getattr(b, convert)(v, vd), out, align=2)
            with cgutils.for_range(b, b.sub(nv, b.mul(n16, _i64(16)))) as loop:
                i = b.add(b.mul(n16, _i64(16)), loop.index)
                b.store(getattr(b, convert)(b.load(b.gep(s, [i])), dst_elem), b.gep(d, [i]))
            return context.get_dummy_value()

        return sig, codegen

    return half_convert


# widen_half(bits, boff, out, ooff, n): out[ooff:ooff+n] = float32 of the float16 bits
# bits[boff:boff+n]; narrow_half(x, xoff, bits, boff, n): the reverse (the float16 KV cache).
widen_half, narrow_half = _half_convert(True), _half_convert(False)
