"""The prefill products' inner tile on int16 (cpu/prefill.py): 2 tokens times 4 weight rows.

Both sides are int16 vectors: a K-quant row as its exact integers (sub-block scale times code),
x rounded per 256 columns. `vpmaddwd` multiplies 32 pairs and sums them in twos into <16 x i32>,
32 multiply-adds per instruction where a float32 FMA does 16, from half the bytes. The int32
lanes of one 256-column super-block (16 products each, |w| <= 4096, |x| <= X16_MAX) cannot
overflow; they are converted to float once per super-block and scaled by the row's and the
token's float scales for it.
"""

from __future__ import annotations

from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.ir import (  # noqa: E402
    BLOCKS,
    Q4_K,
    Q5_K,
    Q6_K,
    _half,
    _i64,
    _ptr,
    _splat,
    sum_lanes,
)
from atlas_cli.backend.ops.cpu.ir_int8 import (  # noqa: E402
    _INT_EMITTERS,
    ISA,
    _bytes,
    _intrinsic_fn,
    _join,
    _k_scales_vec,
    _mask,
    k_scale_codes,
)

SUPER = 256  # columns per scale of both sides
# 8 int32 sums, 8 float accumulators and 6 loaded vectors: 22 of 32 zmm registers. At 3 x 4
# (31) LLVM spilled sums to the stack in the inner loop, and the products ran 1.0-1.3x the
# float32 tiles' speed where 2 x 4 runs 1.4-1.7x (one process, 512 tokens: docs/performance.md).
TILE_TOKENS, TILE_ROWS = 2, 4
X16_MAX = 16383  # |x| in units of its scale: 16 * 4096 * 16383 < 2^31 (Q6_K's |w| <= 4096)

_F32, _I16, _I32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
_V32W, _V16I, _V16F = ir.VectorType(_I16, 32), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_FAST = ("fast",)


def _madd(b, isa: str, w, x, acc=None):
    """<16 x i32>: lane i = acc[i] + w[2i] * x[2i] + w[2i+1] * x[2i+1] for <32 x i16> w, x."""
    if isa == "vnni512":  # vpdpwssd (LLVM fused most vpmaddwd + vpaddd pairs itself, not all)
        fn = _intrinsic_fn(b, "llvm.x86.avx512.vpdpwssd.512", _V16I, [_V16I] * 3)
        acc = ir.Constant(_V16I, [0] * 16) if acc is None else acc
        return b.call(fn, [acc, b.bitcast(w, _V16I), b.bitcast(x, _V16I)])
    prod = _madd_pairs(b, isa, w, x)
    return prod if acc is None else b.add(acc, prod)


def _madd_pairs(b, isa: str, w, x):
    """_madd without an accumulator, on AVX2 (two vpmaddwd) or portable IR."""
    if isa == "avx2":
        v16w, v8i = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
        fn = _intrinsic_fn(b, "llvm.x86.avx2.pmadd.wd", v8i, [v16w, v16w])
        halves = []
        for h in range(2):
            lanes = _mask(range(16 * h, 16 * h + 16))
            parts = [b.shuffle_vector(v, v, lanes) for v in (w, x)]
            halves.append(b.call(fn, parts))
        return _join(b, *halves)
    wide = ir.VectorType(_I32, 32)
    prod = b.mul(b.sext(w, wide), b.sext(x, wide))
    even, odd = (b.shuffle_vector(prod, prod, _mask(range(k, 32, 2))) for k in range(2))
    return b.add(even, odd)


def _load_w(b, base, index):
    return b.load(b.bitcast(b.gep(base, [index]), _V32W.as_pointer()), align=2)


@intrinsic
def tile_dots16(typingctx, wi, woff, xq, xoff, cols, wd, wdoff, xd, xdoff):
    """TILE_TOKENS * TILE_ROWS floats, token t times row r at TILE_ROWS * t + r: the dots of the
    int16 rows at `wi[woff + r * cols:]` with the int16 tokens at `xq[xoff + t * cols:]`,
    super-block s scaled by `wd[wdoff + r * nsb + s] * xd[xdoff + t * nsb + s]` (nsb = cols /
    256)."""
    sig = types.UniTuple(types.float32, TILE_TOKENS * TILE_ROWS)(
        wi, woff, xq, xoff, cols, wd, wdoff, xd, xdoff
    )

    def codegen(context, b, signature, args):
        wiv, woffv, xqv, xoffv, colsv, wdv, wdoffv, xdv, xdoffv = args
        ats = signature.args
        wp = b.gep(_ptr(context, b, ats[0], wiv), [woffv])
        xp = b.gep(_ptr(context, b, ats[2], xqv), [xoffv])
        wdp = b.gep(_ptr(context, b, ats[5], wdv), [wdoffv])
        xdp = b.gep(_ptr(context, b, ats[7], xdv), [xdoffv])
        nsb = b.sdiv(colsv, _i64(SUPER))
        pairs = [(t, r) for t in range(TILE_TOKENS) for r in range(TILE_ROWS)]
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [cgutils.alloca_once_value(b, zero) for _ in pairs]
        with cgutils.for_range(b, nsb) as loop:
            s = loop.index
            col0 = b.mul(s, _i64(SUPER))
            sums = [None] * len(pairs)
            for step in range(SUPER // 32):
                col = b.add(col0, _i64(32 * step))
                ws = [_load_w(b, wp, b.add(b.mul(colsv, _i64(r)), col)) for r in range(TILE_ROWS)]
                xs = [_load_w(b, xp, b.add(b.mul(colsv, _i64(t)), col)) for t in range(TILE_TOKENS)]
                for i, (t, r) in enumerate(pairs):
                    sums[i] = _madd(b, ISA, ws[r], xs[t], sums[i])
            wds = [b.load(b.gep(wdp, [b.add(b.mul(nsb, _i64(r)), s)])) for r in range(TILE_ROWS)]
            xds = [b.load(b.gep(xdp, [b.add(b.mul(nsb, _i64(t)), s)])) for t in range(TILE_TOKENS)]
            for i, (t, r) in enumerate(pairs):
                scale = _splat(b, b.fmul(wds[r], xds[t], flags=_FAST))
                term = b.fmul(b.sitofp(sums[i], _V16F), scale, flags=_FAST)
                b.store(b.fadd(b.load(accs[i]), term, flags=_FAST), accs[i])
        total, lane_of = sum_lanes(b, [b.load(acc) for acc in accs])
        outs = [b.extract_element(total, _i64(lane_of[i])) for i in range(len(pairs))]
        return context.make_tuple(b, signature.return_type, outs)

    return sig, codegen


def _i16_splat(b, value, n: int = 32):
    """<n x i16> of the i32 scalar `value`."""
    zero = ir.Constant(ir.VectorType(_I16, n), [0] * n)
    vec = b.insert_element(zero, b.trunc(value, _I16), _i64(0))
    return b.shuffle_vector(vec, vec, _mask([0] * n))


def _store(b, ptr, index, value):
    b.store(value, b.bitcast(b.gep(ptr, [index]), value.type.as_pointer()), align=2)


def _make_row_int16(type_id: int):
    """The int16 form of one stored row of a K-quant (INT16_TYPES in cpu/prefill.py): the
    codes of cpu.ir_int8's block decoders times their integer sub-block scales."""
    emit = _INT_EMITTERS[type_id]
    nbytes = BLOCKS[type_id][1]
    v32w = ir.VectorType(_I16, 32)

    @intrinsic
    def row_int16(typingctx, w, woff, nb, wi, wd, wm):
        """wi (cols,) int16, wd (nb,) and wm (cols / 32,) float32 for the `nb` super-blocks at
        byte `woff` of `w`: element k = wd[k // 256] * wi[k] + wm[k // 32]."""
        sig = types.none(w, woff, nb, wi, wd, wm)

        def codegen(context, b, signature, args):
            wv, woffv, nbv, wiv, wdv, wmv = args
            ats = signature.args
            row = b.gep(_ptr(context, b, ats[0], wv), [woffv])
            wip, wdp, wmp = (_ptr(context, b, ats[i], args[i]) for i in (3, 4, 5))
            with cgutils.for_range(b, nbv) as loop:
                s = loop.index
                blk = b.gep(row, [b.mul(s, _i64(nbytes))])
                codes = emit(b, blk).codes  # 8 x <32 x i8>, elements 32i.. in codes[i]
                col0 = b.mul(s, _i64(SUPER))
                if type_id == Q6_K:  # codes q + 32, an int8 scale per 16 elements
                    d = _half(b, blk, 208)
                    sc = b.sext(_bytes(b, blk, 192, 16), ir.VectorType(_I16, 16))
                    offsets = ir.Constant(ir.VectorType(_F32, 8), [0.0] * 8)
                    bias = ir.Constant(v32w, [32] * 32)
                    for i, q in enumerate(codes):
                        scale = b.shuffle_vector(sc, sc, _mask([2 * i] * 16 + [2 * i + 1] * 16))
                        value = b.mul(b.sub(b.zext(q, v32w), bias), scale)
                        _store(b, wip, b.add(col0, _i64(32 * i)), value)
                else:
                    d = _half(b, blk, 0)
                    sc, _m = k_scale_codes(b, blk)
                    offsets = _k_scales_vec(b, blk)[1]
                    for i, q in enumerate(codes):
                        scale = _i16_splat(b, b.extract_element(sc, _i64(i)))
                        _store(b, wip, b.add(col0, _i64(32 * i)), b.mul(b.zext(q, v32w), scale))
                b.store(d, b.gep(wdp, [s]))
                _store(b, wmp, b.mul(s, _i64(8)), offsets)
            return context.get_dummy_value()

        return sig, codegen

    return row_int16


# row_int16_*(w, woff, nb, wi, wd, wm): one row of that type in the form the tile multiplies
row_int16_q4_k, row_int16_q5_k, row_int16_q6_k = (_make_row_int16(t) for t in (Q4_K, Q5_K, Q6_K))
