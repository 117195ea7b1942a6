"""Integer dots of ROWS weight rows with one int8-rounded x in one loop (cpu/ir_int8.py's
arithmetic per row): the rows share the loads of x, their instructions interleave, Q4_K and
Q5_K decode the rows' scales together, and the loop asks for the weight bytes well ahead.
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
    IQ4_NL,
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
    _i64,
    _mask,
    _ptr,
    prefetch_line,
)
from atlas_cli.backend.ops.cpu.ir_int8 import (  # noqa: E402
    _F32,
    _I1,
    _V16F,
    _V64B,
    ISA,
    _bytes,
    _const_vec,
    _int_q4_k,
    _int_q5_k,
    _join,
    _Row,
    _splat8,
)


def _k_scales_rows(b, ptrs):
    """_k_scales_vec of the blocks at 4 pointers (4 rows' blocks of one column range), decoded
    together: the 4 blocks' 16 header bytes share one <64 x i8>, and every step below is one
    lane-local shuffle or bitwise op for all 4 (what one block alone costs, ~40% of a Q4_K
    block's instructions). The floats equal _k_scales_vec's bit for bit."""
    heads = [_bytes(b, p, 0, 16) for p in ptrs]  # d, dmin, then the 12 packed scale bytes
    s = _join(b, _join(b, heads[0], heads[1]), _join(b, heads[2], heads[3]))
    zero = ir.Constant(_V64B, [0] * 64)

    def per_lane(idx):  # the same 16 header bytes of every lane (None: 0)
        return b.shuffle_vector(s, zero, _mask(64 if i is None else 16 * r + i
                                               for r in range(4) for i in idx))  # fmt: skip

    # k_scale_codes per byte: sc_j (j < 4) = s[j] & 63, sc_j (j >= 4) = s[j+4] & 15 | high
    # bits s[j-4] >> 6; m_j (j < 4) = s[j+4] & 63, m_j (j >= 4) = s[j+4] >> 4 | s[j] >> 6
    # (s[i] is header byte 4 + i); a lane ends as sc_0..7, m_0..7
    low = per_lane([4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15])
    shifted = ir.Constant(ir.VectorType(_I1, 64), ([0] * 12 + [1] * 4) * 4)
    low = b.select(shifted, b.lshr(low, _splat8(64, 4)), low)
    low = b.and_(low, _const_vec(_V64B, ([63] * 4 + [15] * 4) * 8))
    high = per_lane([None] * 4 + [4, 5, 6, 7] + [None] * 4 + [8, 9, 10, 11])
    high = b.lshr(b.and_(high, _splat8(64, 0xC0)), _splat8(64, 2))
    codes = b.or_(low, high)
    halves = b.shuffle_vector(s, s, _mask(16 * r + i for r in range(4) for i in range(4)))
    v8 = ir.VectorType(_F32, 8)
    dd = b.fpext(b.bitcast(halves, ir.VectorType(ir.HalfType(), 8)), v8)  # d, dmin per row
    dd = b.fmul(dd, _const_vec(v8, [1.0, -1.0] * 4))
    out = []
    for r in range(4):
        lane = b.uitofp(b.shuffle_vector(codes, codes, _mask(range(16 * r, 16 * r + 16))), _V16F)
        full = b.fmul(lane, b.shuffle_vector(dd, dd, _mask([2 * r] * 8 + [2 * r + 1] * 8)))
        out.append(tuple(b.shuffle_vector(full, full, _mask(range(h, h + 8))) for h in (0, 8)))
    return out


ROWS = 4  # rows of one multi-row dot (rows_dot_int8)
# How far ahead of its reads rows_dot_int8 asks for weight bytes, and into which cache: into
# L2 (LLVM locality 2), 32 KB ahead. On one core of the 1.5B coder's matrices this streamed
# 1.5x faster than 4 KB into L1: each L1 prefetch holds one of the core's few L1 miss buffers
# for a whole memory latency (docs/performance.md).
STREAM_AHEAD = 32768
STREAM_LOCALITY = 2


# Emitters of ROWS rows' blocks at once, where decoding them together saves work
def _k_rows(emit):
    def rows(b, ptrs):
        return [emit(b, p, k) for p, k in zip(ptrs, _k_scales_rows(b, ptrs), strict=True)]

    return rows


_JOINT = {Q4_K: _k_rows(_int_q4_k), Q5_K: _k_rows(_int_q5_k)}


def _make_rows_dot_int8(type_id: int, isa: str):
    """The dots of ROWS rows with one x in one loop over their blocks: the rows share the
    loads of x and their instructions interleave; Q4_K and Q5_K decode the four rows' scales
    together (_k_scales_rows). Each row's arithmetic is row_dot_int8's."""
    step = 2 if BLOCKS[type_id][0] == 32 else 1
    nbytes = BLOCKS[type_id][1]
    lines = -(-ROWS * step * nbytes // 64)  # cache lines the rows read per loop step

    @intrinsic
    def rows_dot_int8(typingctx, w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nblocks, end, out,
                      ooff):  # fmt: skip
        """out[ooff + i] = the dot of the row at byte o_i of uint8 `w` (`nblocks` blocks)
        with the quantized x (as row_dot_int8), for i < ROWS. Each loop step asks for as
        many bytes as the rows read, STREAM_AHEAD bytes past the first row's, up to byte
        `end`: where the rows are consecutive (a matrix read in order), a steady stream."""
        sig = types.void(w, o0, o1, o2, o3, xq, xqoff, xf, xfoff, nblocks, end, out, ooff)

        def codegen(context, b, signature, args):
            wv, *offs, xqv, xqoffv, xfv, xfoffv, nbv, endv, outv, ooffv = args
            ats = signature.args
            base = _ptr(context, b, ats[0], wv)
            xqrow = b.gep(_ptr(context, b, ats[5], xqv), [xqoffv])
            xfrow = b.gep(_ptr(context, b, ats[7], xfv), [xfoffv])
            rows = [_Row(b, isa, type_id, b.gep(base, [o]), xqrow, xfrow, nbv) for o in offs]

            def accumulate(first, count):
                if count == step and type_id in _JOINT:
                    blocks = _JOINT[type_id](b, [r.block_at(first) for r in rows])
                else:
                    blocks = [r.blocks(first, count) for r in rows]
                for r, blk in zip(rows, blocks, strict=True):
                    r.accumulate(blk, first)

            with cgutils.for_range(b, b.sdiv(nbv, _i64(step))) as loop:
                first = b.mul(loop.index, _i64(step))
                at = b.add(offs[0], b.mul(first, _i64(ROWS * nbytes)))
                at = b.add(at, _i64(STREAM_AHEAD))
                last = b.sub(endv, _i64(64 * lines))
                at = b.select(b.icmp_signed("<", at, last), at, last)
                for k in range(lines):
                    prefetch_line(b, b.gep(base, [b.add(at, _i64(64 * k))]), STREAM_LOCALITY)
                accumulate(first, step)
            if step > 1:
                with b.if_then(b.icmp_signed("!=", b.srem(nbv, _i64(step)), _i64(0))):
                    accumulate(b.sub(nbv, _i64(1)), 1)
            outp = _ptr(context, b, ats[11], outv)
            for i, r in enumerate(rows):
                b.store(r.total(), b.gep(outp, [b.add(ooffv, _i64(i))]))
            return context.get_dummy_value()

        return sig, codegen

    return rows_dot_int8


rdot_q4_0 = _make_rows_dot_int8(Q4_0, ISA)
rdot_q4_1 = _make_rows_dot_int8(Q4_1, ISA)
rdot_q5_0 = _make_rows_dot_int8(Q5_0, ISA)
rdot_q5_1 = _make_rows_dot_int8(Q5_1, ISA)
rdot_q8_0 = _make_rows_dot_int8(Q8_0, ISA)
rdot_iq4_nl = _make_rows_dot_int8(IQ4_NL, ISA)
rdot_iq4_xs = _make_rows_dot_int8(IQ4_XS, ISA)
rdot_q2_k = _make_rows_dot_int8(Q2_K, ISA)
rdot_q3_k = _make_rows_dot_int8(Q3_K, ISA)
rdot_q4_k = _make_rows_dot_int8(Q4_K, ISA)
rdot_q5_k = _make_rows_dot_int8(Q5_K, ISA)
rdot_q6_k = _make_rows_dot_int8(Q6_K, ISA)
