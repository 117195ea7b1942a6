"""Integer dot products of the fast CPU path: GGUF weight blocks times int8 activations.

The activation vector is rounded once per token (`quantize_x` in cpu/kernels.py) per 32-group
to two planes of int8: hi = rint(x / d) with d = max|x| / 127 (llama.cpp's Q8_0) and the
rounded remainder lo in units of d/256, so x ~ d/256 * (256 * hi + lo). One plane alone (what
llama.cpp does) put the default model's logits 6% (of max |logit|) off the float32 reference;
two put them 1e-4 off, for one more integer multiply-add per 64 elements. Per 32-group the
kernel gets XF floats, in three planes: d/256 for each group, then d/256 times the sum of
256 * hi + lo over each group, then over each 16-half (the sums serve the offsets and mins).

A weight block is described as pieces of 32 unsigned (or, for Q8_0 and the IQ4s, signed) 8-bit
codes, a vector of float scales (one per 16 or 32 elements) and offset terms
`coef * (a sum of x)`: Q4_K's sub-block j is `d*sc_j * q - dmin*m_j`, so its dot with x is
`d*sc_j * sum(q * x) - dmin*m_j * sum(x)`. Two pieces make one 64-byte step: `_dot4` gives
<16 x i32>, lane i the sum of four adjacent code * x products: one `vpdpbusd` on AVX-512
VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2, plain widening multiplies and adds elsewhere
(`dot_isa`, chosen when the kernel compiles for its CPU). The lanes are converted to float
once per step and scaled per lane (4 lanes = 16 elements), so the int32 sums stay exact.
"""

from __future__ import annotations

import os
import platform

from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.ir import (  # noqa: E402
    BLOCKS,
    IQ4_NL,
    IQ4_TABLE,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _at,
    _half,
    _i64,
    _mask,
    _ptr,
    lookup16,
)

XF = 4  # floats per 32-group of a quantized x: its unit, its sum, the sums of its halves
ISAS = ("vnni512", "avx2", "portable")
ISA_ENV = jit.ISA_ENV  # forces one of ISAS (tests, A/B runs); part of the cache stamp

_F32, _I1, _I8, _I16, _I32 = (
    ir.FloatType(),
    ir.IntType(1),
    ir.IntType(8),
    ir.IntType(16),
    ir.IntType(32),
)
_V32B, _V64B = ir.VectorType(_I8, 32), ir.VectorType(_I8, 64)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_FAST = ("fast",)


def dot_isa() -> str:
    """The instructions the integer dots compile to: ATLAS_CPU_ISA when set, else the best one
    numba's target CPU has (the host, unless NUMBA_CPU_NAME says otherwise)."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            from atlas_cli.errors import UsageError

            raise UsageError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, got {forced!r}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    have = target_features()
    if {"avx512vnni", "avx512bw", "avx512f"} <= have:
        return "vnni512"
    return "avx2" if "avx2" in have else "portable"


def target_features() -> set[str]:
    """The CPU features numba compiles for: the host's, unless NUMBA_CPU_NAME says otherwise."""
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        features = config.CPU_FEATURES or ""
    else:
        import llvmlite.binding as llb

        features = llb.get_host_cpu_features().flatten()
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def _const_vec(ty, values):
    return ir.Constant(ty, list(values))


def _join(b, lo, hi):
    """Two <n x T> vectors as one <2n x T>."""
    n = lo.type.count
    return b.shuffle_vector(lo, hi, _mask(range(2 * n)))


def _bytes(b, p, offset: int, n: int):
    ty = ir.VectorType(_I8, n)
    return b.load(b.bitcast(_at(b, p, offset), ty.as_pointer()), align=1)


def _splat8(n: int, value: int):
    return _const_vec(ir.VectorType(_I8, n), [value] * n)


def _nibbles(b, q):
    """(low, high) nibbles of the bytes q, as unsigned codes."""
    n = q.type.count
    return b.and_(q, _splat8(n, 15)), b.lshr(q, _splat8(n, 4))


def _intrinsic_fn(b, name, ret, args):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _dot4(b, isa: str, codes, x, signed: bool, acc=None):
    """<16 x i32>: lane i = acc[i] + sum_k codes[4i+k] * x[4i+k] (k < 4) for <64 x i8> codes
    (unsigned unless `signed`) and signed x. Exact: no sum of two products here leaves int16
    (|code| <= 128, |x| <= 127), which vpmaddubsw needs."""
    if signed and isa != "portable":  # u8 x s8 instructions: |w| * (x with w's sign)
        absfn = _intrinsic_fn(b, "llvm.abs.v64i8", _V64B, [_V64B, _I1])
        negative = b.icmp_signed("<", codes, _splat8(64, 0))
        x = b.select(negative, b.sub(_splat8(64, 0), x), x)
        codes = b.call(absfn, [codes, ir.Constant(_I1, 0)])
    if isa == "vnni512":
        fn = _intrinsic_fn(b, "llvm.x86.avx512.vpdpbusd.512", _V16I, [_V16I] * 3)
        acc = ir.Constant(_V16I, [0] * 16) if acc is None else acc
        return b.call(fn, [acc, b.bitcast(codes, _V16I), b.bitcast(x, _V16I)])
    if isa == "avx2":
        v16s, v8i = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
        maddubs = _intrinsic_fn(b, "llvm.x86.avx2.pmadd.ub.sw", v16s, [_V32B, _V32B])
        maddwd = _intrinsic_fn(b, "llvm.x86.avx2.pmadd.wd", v8i, [v16s, v16s])
        ones = ir.Constant(v16s, [1] * 16)
        halves = []
        for h in range(2):
            lanes = _mask(range(32 * h, 32 * h + 32))
            c, xv = b.shuffle_vector(codes, codes, lanes), b.shuffle_vector(x, x, lanes)
            halves.append(b.call(maddwd, [b.call(maddubs, [c, xv]), ones]))
        out = _join(b, *halves)
    else:
        wide = ir.VectorType(_I32, 64)
        prod = b.mul(b.sext(codes, wide) if signed else b.zext(codes, wide), b.sext(x, wide))
        parts = [b.shuffle_vector(prod, prod, _mask(range(k, 64, 4))) for k in range(4)]
        out = b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3]))
    return out if acc is None else b.add(acc, out)


class _Block:
    """One block (or, for 32-element formats, two) as integer pieces: `codes`, <32 x i8> each,
    element 32i.. in codes[i] (unsigned unless `signed`); `scales` the float weight scale per
    32 elements (<n/32 x float>) or, with `per16`, per 16; `offsets` None or the coefficients
    of the offset terms, per 32 (or per 16 with `per16`), times the matching sums of x. With a
    `table` (16 int8 values), the codes are indices into it, looked up per step (`_lookup`)."""

    def __init__(self, codes, scales, offsets=None, per16=False, signed=False, table=None):
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.per16, self.signed, self.table = per16, signed, table

    def join(self, b, other: _Block) -> _Block:
        off = None if self.offsets is None else _join(b, self.offsets, other.offsets)
        scales = _join(b, self.scales, other.scales)
        return _Block(self.codes + other.codes, scales, off, self.per16, self.signed, self.table)


def _lookup(b, isa: str, table: list[int], codes):
    """<64 x i8>: table[codes] for a 16-entry int8 table and codes below 16. On x86 one pshufb
    per register, which looks up within each 16-byte lane (the table is repeated per lane):
    written element by element, the lookups of a step's joined pieces are no vector LLVM sees
    as one, and it makes them 64 scalar ones (8x slower)."""
    if isa == "portable":
        return lookup16(b, table, codes)
    if isa == "vnni512":
        fn = _intrinsic_fn(b, "llvm.x86.avx512.pshuf.b.512", _V64B, [_V64B, _V64B])
        return b.call(fn, [_const_vec(_V64B, table * 4), codes])
    fn = _intrinsic_fn(b, "llvm.x86.avx2.pshuf.b", _V32B, [_V32B, _V32B])
    halves = [b.shuffle_vector(codes, codes, _mask(range(32 * h, 32 * h + 32))) for h in range(2)]
    return _join(b, *(b.call(fn, [_const_vec(_V32B, table * 2), h]) for h in halves))


def _vec(b, *values):
    """<n x float> of float32 scalars."""
    v = ir.Constant(ir.VectorType(_F32, len(values)), [0.0] * len(values))
    for i, x in enumerate(values):
        v = b.insert_element(v, x, ir.Constant(_I32, i))
    return v


def _fsplat(b, x, n: int):
    return b.shuffle_vector(_vec(b, x), _vec(b, x), _mask([0] * n))


# Per-format decoders: (builder, i8* block) -> _Block; the element order and values follow
# loaders/quant.py (ggml's dequantize_row_*).


def _int_q4_0(b, p):
    d = _half(b, p, 0)
    lo, hi = _nibbles(b, _bytes(b, p, 2, 16))
    return _Block([_join(b, lo, hi)], _vec(b, d), _vec(b, b.fmul(d, ir.Constant(_F32, -8.0))))


def _int_q4_1(b, p):
    d, m = _half(b, p, 0), _half(b, p, 2)
    lo, hi = _nibbles(b, _bytes(b, p, 4, 16))
    return _Block([_join(b, lo, hi)], _vec(b, d), _vec(b, m))


def _q5_codes(b, p, qh_at: int):
    """<32 x i8>: the 5-bit codes of a Q5_0/Q5_1 block, the nibbles of the 16 bytes after the
    32-bit qh word at byte `qh_at` with bit i of qh as element i's fifth bit."""
    lo, hi = _nibbles(b, _bytes(b, p, qh_at + 4, 16))
    qh = b.load(b.bitcast(_at(b, p, qh_at), _I32.as_pointer()), align=1)
    # the 32 bits as a <32 x i1> mask: one mask-register move and a masked move of 16s on
    # AVX-512 (shifting 32 copies of qh, as before, cost ~3x the rest of the block)
    bits = b.bitcast(qh, ir.VectorType(_I1, 32))
    high = b.select(bits, _splat8(32, 16), _splat8(32, 0))
    return b.or_(_join(b, lo, hi), high)


def _int_q5_0(b, p):
    d = _half(b, p, 0)
    return _Block([_q5_codes(b, p, 2)], _vec(b, d), _vec(b, b.fmul(d, ir.Constant(_F32, -16.0))))


def _int_q5_1(b, p):
    d, m = _half(b, p, 0), _half(b, p, 2)
    return _Block([_q5_codes(b, p, 4)], _vec(b, d), _vec(b, m))


def _int_q8_0(b, p):
    return _Block([_bytes(b, p, 2, 32)], _vec(b, _half(b, p, 0)), signed=True)


def _iq4_codes(b, p, offset: int):
    """<32 x i8>: the 32 IQ4 codes of the 16 bytes at `offset`, low nibbles first."""
    return _join(b, *_nibbles(b, _bytes(b, p, offset, 16)))


def _int_iq4_nl(b, p):
    return _Block([_iq4_codes(b, p, 2)], _vec(b, _half(b, p, 0)), signed=True, table=IQ4_TABLE)


def _int_iq4_xs(b, p):
    codes = [_iq4_codes(b, p, 8 + 16 * j) for j in range(8)]
    # The 8 6-bit scales: nibble j % 2 of the 4 bytes at 4, bits 2j.. of the uint16 at 2 (of
    # its byte j // 4), minus 32.
    v8 = ir.VectorType(_I8, 8)
    low, high = _bytes(b, p, 4, 4), _bytes(b, p, 2, 2)
    low = b.shuffle_vector(low, low, _mask([j // 2 for j in range(8)]))
    low = b.and_(b.lshr(low, _const_vec(v8, [0, 4] * 4)), _splat8(8, 15))
    high = b.shuffle_vector(high, high, _mask([j // 4 for j in range(8)]))
    high = b.and_(b.lshr(high, _const_vec(v8, [0, 2, 4, 6] * 2)), _splat8(8, 3))
    sc = b.sub(b.or_(low, b.shl(high, _splat8(8, 4))), _splat8(8, 32))
    scales = b.fmul(_fsplat(b, _half(b, p, 0), 8), b.sitofp(sc, ir.VectorType(_F32, 8)))
    return _Block(codes, scales, signed=True, table=IQ4_TABLE)


def k_scale_codes(b, p):
    """(sc, m) as <8 x i32>, the 6-bit scales and mins of the 8 sub-blocks of a Q4_K/Q5_K block:
    ggml's get_scale_min_k4 on the 12 packed bytes at offset 4, on all eight at once."""
    s = _bytes(b, p, 4, 16)  # the 12 scale bytes and 4 more of the block

    def pick(*idx):
        return b.zext(b.shuffle_vector(s, s, _mask(idx)), ir.VectorType(_I32, 8))

    def c(n):
        return ir.Constant(ir.VectorType(_I32, 8), [n] * 8)

    first = ir.Constant(ir.VectorType(_I1, 8), [1] * 4 + [0] * 4)
    lo_hi = pick(0, 1, 2, 3, 8, 9, 10, 11)  # sc: s[j] (j < 4), s[j + 4] (j >= 4)
    mid_lo = pick(4, 5, 6, 7, 0, 1, 2, 3)  # high bits of sc (j >= 4): s[j - 4] >> 6
    mid_hi = pick(4, 5, 6, 7, 8, 9, 10, 11)  # m: s[j + 4]
    mid = pick(4, 5, 6, 7, 4, 5, 6, 7)  # high bits of m (j >= 4): s[j] >> 6
    sc_hi = b.or_(b.and_(lo_hi, c(15)), b.shl(b.lshr(mid_lo, c(6)), c(4)))
    sc = b.select(first, b.and_(lo_hi, c(63)), sc_hi)
    m_hi = b.or_(b.lshr(mid_hi, c(4)), b.shl(b.lshr(mid, c(6)), c(4)))
    m = b.select(first, b.and_(mid_hi, c(63)), m_hi)
    return sc, m


def _k_scales_vec(b, p):
    """(d * sc, -dmin * m) as <8 x float> for the 8 sub-blocks of a Q4_K/Q5_K block."""
    sc, m = k_scale_codes(b, p)
    v8 = ir.VectorType(_F32, 8)
    d, dmin = _half(b, p, 0), _half(b, p, 2)
    ndmin = b.fsub(ir.Constant(_F32, 0.0), dmin)
    return b.fmul(_fsplat(b, d, 8), b.uitofp(sc, v8)), b.fmul(_fsplat(b, ndmin, 8), b.uitofp(m, v8))


def _int_q4_k(b, p, k_scales=None):
    scales, offsets = k_scales or _k_scales_vec(b, p)
    codes = []
    for c in range(4):  # qs[32c + l]: sub-block 2c in the low nibble, 2c+1 in the high one
        codes += _nibbles(b, _bytes(b, p, 16 + 32 * c, 32))
    return _Block(codes, scales, offsets)


def _int_q5_k(b, p, k_scales=None):
    scales, offsets = k_scales or _k_scales_vec(b, p)
    qh = _bytes(b, p, 16, 32)
    codes = []
    for c in range(4):
        for nib, low in enumerate(_nibbles(b, _bytes(b, p, 48 + 32 * c, 32))):
            j = 2 * c + nib  # the fifth bit: bit j of qh[l]
            high = b.shl(b.and_(b.lshr(qh, _splat8(32, j)), _splat8(32, 1)), _splat8(32, 4))
            codes.append(b.or_(low, high))
    return _Block(codes, scales, offsets)


def _int_q2_k(b, p):
    codes = []
    for h in range(2):  # two 128-element halves
        qs = _bytes(b, p, 16 + 32 * h, 32)
        for k in range(4):  # element 32k + l: bits 2k.. of qs[32h + l]
            codes.append(b.and_(b.lshr(qs, _splat8(32, 2 * k)), _splat8(32, 3)))
    s = _bytes(b, p, 0, 16)  # per 16 elements: the scale in the low nibble, the min in the high
    f16 = ir.VectorType(_F32, 16)
    sc, m = b.uitofp(b.and_(s, _splat8(16, 15)), f16), b.uitofp(b.lshr(s, _splat8(16, 4)), f16)
    ndmin = b.fsub(ir.Constant(_F32, 0.0), _half(b, p, 82))
    scales = b.fmul(_fsplat(b, _half(b, p, 80), 16), sc)
    return _Block(codes, scales, b.fmul(_fsplat(b, ndmin, 16), m), per16=True)


def _int_q3_k(b, p):
    codes = []
    hmask = _bytes(b, p, 0, 32)
    for c in range(8):  # element 32c + l: bits 2(c % 4).. of qs[32(c // 4) + l], hmask[l] bit c
        ql = b.and_(
            b.lshr(_bytes(b, p, 32 + 32 * (c // 4), 32), _splat8(32, 2 * (c % 4))), _splat8(32, 3)
        )
        high = b.and_(b.lshr(hmask, _splat8(32, c)), _splat8(32, 1))
        codes.append(b.or_(ql, b.shl(high, _splat8(32, 2))))  # q + 4
    # The 16 6-bit scales: a nibble of the 8 bytes at 96, 2 bits of the 4 at 104, minus 32
    # (two loads: one of 16 bytes would read past the block's 110).
    v16 = ir.VectorType(_I8, 16)
    lo8, hi4 = _bytes(b, p, 96, 8), _bytes(b, p, 104, 4)
    low = b.shuffle_vector(lo8, lo8, _mask(list(range(8)) * 2))
    low = b.and_(b.lshr(low, _const_vec(v16, [0] * 8 + [4] * 8)), _splat8(16, 15))
    high = b.shuffle_vector(hi4, hi4, _mask(list(range(4)) * 4))
    high = b.and_(b.lshr(high, _const_vec(v16, [2 * (j // 4) for j in range(16)])), _splat8(16, 3))
    sc = b.sub(b.or_(low, b.shl(high, _splat8(16, 4))), _splat8(16, 32))
    f16 = ir.VectorType(_F32, 16)
    scales = b.fmul(_fsplat(b, _half(b, p, 108), 16), b.sitofp(sc, f16))
    offsets = b.fmul(scales, ir.Constant(f16, [-4.0] * 16))  # the codes are q + 4
    return _Block(codes, scales, offsets, per16=True)


def _int_q6_k(b, p):
    codes = []
    for h in range(2):  # two 128-element halves
        qh = _bytes(b, p, 128 + 32 * h, 32)
        for k in range(4):  # element 32k + l: nibble of ql[l + 32 (k % 2)], bits 2k.. of qh[l]
            lo, hi = _nibbles(b, _bytes(b, p, 64 * h + 32 * (k % 2), 32))
            high = b.shl(b.and_(b.lshr(qh, _splat8(32, 2 * k)), _splat8(32, 3)), _splat8(32, 4))
            codes.append(b.or_(lo if k < 2 else hi, high))
    v16 = ir.VectorType(_F32, 16)
    sc = b.sitofp(_bytes(b, p, 192, 16), v16)  # the int8 scale of each 16 elements
    scales = b.fmul(_fsplat(b, _half(b, p, 208), 16), sc)
    offsets = b.fmul(scales, ir.Constant(v16, [-32.0] * 16))  # the codes are q + 32
    return _Block(codes, scales, offsets, per16=True)


_INT_EMITTERS = {
    Q4_0: _int_q4_0,
    Q4_1: _int_q4_1,
    Q5_0: _int_q5_0,
    Q5_1: _int_q5_1,
    Q8_0: _int_q8_0,
    IQ4_NL: _int_iq4_nl,
    IQ4_XS: _int_iq4_xs,
    Q2_K: _int_q2_k,
    Q3_K: _int_q3_k,
    Q4_K: _int_q4_k,
    Q5_K: _int_q5_k,
    Q6_K: _int_q6_k,
}
INT8_TYPES = tuple(_INT_EMITTERS)


def _load_floats(b, ptr, n: int):
    ty = ir.VectorType(_F32, n)
    return b.load(b.bitcast(ptr, ty.as_pointer()), align=4)


class _Row:
    """What the code of one row dot works with: the row's blocks, the x planes, accumulators."""

    def __init__(self, b, isa, type_id, row, xqrow, xfrow, nbv):
        self.b, self.isa, self.emit = b, isa, _INT_EMITTERS[type_id]
        self.elems, self.nbytes = BLOCKS[type_id]
        self.row, self.xqrow = row, xqrow
        self.cols = b.mul(nbv, _i64(self.elems))
        ng = b.sdiv(self.cols, _i64(32))
        # xf: unit d/256 per 32-group, then the sums per 32-group, then per 16
        self.planes = (xfrow, b.gep(xfrow, [ng]), b.gep(xfrow, [b.mul(ng, _i64(2))]))
        zero = ir.Constant(_V16F, [0.0] * 16)
        self.accs = [cgutils.alloca_once_value(b, zero) for _ in range(2)]
        self.accm = {  # offset terms by vector width (a step has 1, 2, 8 or 16; unused ones
            n: cgutils.alloca_once_value(b, ir.Constant(ir.VectorType(_F32, n), [0.0] * n))
            for n in (1, 2, 8, 16)
        }  # compile to nothing)

    def step(self, first, count: int) -> None:
        """Accumulate blocks first .. first + count - 1 (count 1 or 2)."""
        self.accumulate(self.blocks(first, count), first)

    def block_at(self, index):
        """A pointer to block `index` of the row."""
        return self.b.gep(self.row, [self.b.mul(index, _i64(self.nbytes))])

    def blocks(self, first, count: int) -> _Block:
        """Blocks first .. first + count - 1 (count 1 or 2) as one _Block."""
        blk = self.emit(self.b, self.block_at(first))
        if count == 2:
            blk = blk.join(self.b, self.emit(self.b, self.block_at(self.b.add(first, _i64(1)))))
        return blk

    def accumulate(self, blk: _Block, first) -> None:
        """Add the dot of `blk`, the blocks from `first` on, with x to the accumulators."""
        b, elems = self.b, self.elems
        groups = len(blk.codes)  # 32-groups of x in this step
        g0 = b.mul(first, _i64(elems // 32))
        dx = _load_floats(b, b.gep(self.planes[0], [g0]), groups)
        if blk.per16:
            dx = b.shuffle_vector(dx, dx, _mask([i // 2 for i in range(2 * groups)]))
        lane_scales = b.fmul(blk.scales, dx, flags=_FAST)
        if blk.offsets is not None:
            n = blk.offsets.type.count
            if blk.per16:
                at = b.gep(self.planes[2], [b.mul(g0, _i64(2))])
            else:
                at = b.gep(self.planes[1], [g0])
            term = b.fmul(blk.offsets, _load_floats(b, at, n), flags=_FAST)
            b.store(b.fadd(b.load(self.accm[n]), term, flags=_FAST), self.accm[n])
        base = b.mul(first, _i64(elems))  # the step's first element of x
        per_lane = 4 if blk.per16 else 8  # lanes of one scale
        for i in range(0, groups, 2):
            codes = blk.codes[i : i + 2]
            lanes = self.pair(codes, blk, b.add(base, _i64(32 * i)))
            first_scale = i * 8 // per_lane
            mask = _mask([first_scale + k // per_lane for k in range(16)])
            if len(codes) == 1:  # upper lanes are zeros: any scale
                mask = _mask([first_scale] * 16)
            spread = b.shuffle_vector(lane_scales, lane_scales, mask)
            acc = self.accs[(i // 2) % 2]
            b.store(b.fadd(b.load(acc), b.fmul(lanes, spread, flags=_FAST), flags=_FAST), acc)

    def pair(self, codes, blk: _Block, xstart):
        """<16 x float>: the lane sums of one or two 32-code pieces of `blk` (contiguous in x)
        with x. x is two planes of int8, x = d/256 * (256 * hi + lo): lanes = (dot(hi) << 8) +
        dot(lo) (|lane| < 2^24, so its float32 is exact)."""
        b = self.b
        planes = [b.gep(self.xqrow, [xstart]), b.gep(self.xqrow, [b.add(xstart, self.cols)])]
        if len(codes) == 2:
            joined = _join(b, *codes)
            xs = [b.load(b.bitcast(p, _V64B.as_pointer()), align=1) for p in planes]
        else:  # the odd last block of a 32-element format: the upper half is zeros
            zeros = ir.Constant(_V32B, [0] * 32)
            joined = _join(b, codes[0], zeros)
            xs = [
                _join(b, b.load(b.bitcast(p, _V32B.as_pointer()), align=1), zeros) for p in planes
            ]
        if blk.table is not None:
            joined = _lookup(b, self.isa, blk.table, joined)
        high = _dot4(b, self.isa, joined, xs[0], blk.signed)
        high = b.shl(high, ir.Constant(_V16I, [8] * 16))
        return b.sitofp(_dot4(b, self.isa, joined, xs[1], blk.signed, acc=high), _V16F)

    def total(self):
        b = self.b
        out = ir.Constant(_F32, 0.0)
        parts = [(16, b.fadd(b.load(self.accs[0]), b.load(self.accs[1]), flags=_FAST))]
        parts += [(n, b.load(acc)) for n, acc in self.accm.items()]
        for n, v in parts:
            fnty = ir.FunctionType(_F32, [_F32, ir.VectorType(_F32, n)])
            fn = cgutils.get_or_insert_function(b.module, fnty, f"llvm.vector.reduce.fadd.v{n}f32")
            out = b.fadd(out, b.call(fn, [ir.Constant(_F32, -0.0), v], fastmath=_FAST), flags=_FAST)
        return out


def _make_row_dot_int8(type_id: int, isa: str):
    step = 2 if BLOCKS[type_id][0] == 32 else 1  # blocks per loop step: whole 64-byte pairs

    @intrinsic
    def row_dot_int8(typingctx, w, woff, xq, xqoff, xf, xfoff, nblocks):
        """sum(row * x) for the `nblocks` blocks at byte `woff` of uint8 `w` and the quantized
        x (quantize_x): its two int8 planes at `xq[xqoff:]`, its floats at `xf[xfoff:]`."""
        sig = types.float32(w, woff, xq, xqoff, xf, xfoff, nblocks)

        def codegen(context, b, signature, args):
            wv, woffv, xqv, xqoffv, xfv, xfoffv, nbv = args
            ats = signature.args
            row = b.gep(_ptr(context, b, ats[0], wv), [woffv])
            xqrow = b.gep(_ptr(context, b, ats[2], xqv), [xqoffv])
            xfrow = b.gep(_ptr(context, b, ats[4], xfv), [xfoffv])
            r = _Row(b, isa, type_id, row, xqrow, xfrow, nbv)
            with cgutils.for_range(b, b.sdiv(nbv, _i64(step))) as loop:
                r.step(b.mul(loop.index, _i64(step)), step)
            if step > 1:
                with b.if_then(b.icmp_signed("!=", b.srem(nbv, _i64(step)), _i64(0))):
                    r.step(b.sub(nbv, _i64(1)), 1)
            return r.total()

        return sig, codegen

    return row_dot_int8


ISA = dot_isa()
idot_q4_0 = _make_row_dot_int8(Q4_0, ISA)
idot_q4_1 = _make_row_dot_int8(Q4_1, ISA)
idot_q5_0 = _make_row_dot_int8(Q5_0, ISA)
idot_q5_1 = _make_row_dot_int8(Q5_1, ISA)
idot_q8_0 = _make_row_dot_int8(Q8_0, ISA)
idot_iq4_nl = _make_row_dot_int8(IQ4_NL, ISA)
idot_iq4_xs = _make_row_dot_int8(IQ4_XS, ISA)
idot_q2_k = _make_row_dot_int8(Q2_K, ISA)
idot_q3_k = _make_row_dot_int8(Q3_K, ISA)
idot_q4_k = _make_row_dot_int8(Q4_K, ISA)
idot_q5_k = _make_row_dot_int8(Q5_K, ISA)
idot_q6_k = _make_row_dot_int8(Q6_K, ISA)
