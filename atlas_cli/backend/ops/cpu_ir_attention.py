"""Attention scores as LLVM IR: prefill's 4 queries x 32 keys tile (cpu_kernels.attention), and
the decode step's one query x 16 keys (cpu_decode.attend_group).

Scores are q . k over a head's 64-256 dims. As a dot product per (query, key) (tile_dots) every
result ends in a horizontal sum of 16 lanes, as many instructions as the products themselves at
hd = 128. With the keys transposed (hd, S), 16 keys are one vector: per dim, two key vectors and
four broadcast query values make 8 FMAs into 8 accumulators, and no lane is summed across.
"""

from __future__ import annotations

from atlas_cli.backend.ops import cpu_numba

cpu_numba.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu_ir import (  # noqa: E402
    _FAST,
    _VF,
    _i64,
    _mask,
    _ptr,
    _splat,
    sum_lanes,
)

QK_QUERIES, QK_KEYS = 4, 32  # 8 accumulators, 2 key vectors, 4 broadcasts: 14 zmm registers


def _vec_ptr(b, base, index):
    return b.bitcast(b.gep(base, [index]), _VF.as_pointer())


@intrinsic
def tile_qk(typingctx, q, qoff, kt, koff, kstride, hd, out, ooff, ostride):
    """out[ooff + i * ostride + s] = sum_d q[qoff + i * hd + d] * kt[koff + d * kstride + s]
    for i < QK_QUERIES, s < QK_KEYS: 4 query rows (hd floats each) against 32 keys of the
    transposed keys (hd rows, kstride apart)."""
    sig = types.none(q, qoff, kt, koff, kstride, hd, out, ooff, ostride)

    def codegen(context, b, signature, args):
        qv, qoffv, ktv, koffv, kstridev, hdv, outv, ooffv, ostridev = args
        ats = signature.args
        qp = b.gep(_ptr(context, b, ats[0], qv), [qoffv])
        kp = b.gep(_ptr(context, b, ats[2], ktv), [koffv])
        op = b.gep(_ptr(context, b, ats[6], outv), [ooffv])
        zero = ir.Constant(_VF, [0.0] * 16)
        halves = QK_KEYS // 16
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(QK_QUERIES * halves)]
        with cgutils.for_range(b, hdv) as loop:
            d = loop.index
            row = b.mul(d, kstridev)
            keys = [
                b.load(_vec_ptr(b, kp, b.add(row, _i64(16 * h))), align=4) for h in range(halves)
            ]
            for i in range(QK_QUERIES):
                qi = _splat(b, b.load(b.gep(qp, [b.add(b.mul(hdv, _i64(i)), d)])))
                for h in range(halves):
                    acc = accs[i * halves + h]
                    prod = b.fmul(qi, keys[h], flags=_FAST)
                    b.store(b.fadd(b.load(acc), prod, flags=_FAST), acc)
        for i in range(QK_QUERIES):
            for h in range(halves):
                at = b.add(b.mul(ostridev, _i64(i)), _i64(16 * h))
                b.store(b.load(accs[i * halves + h]), _vec_ptr(b, op, at), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dots16(typingctx, q, rows, roff, hd, out, ooff):
    """out[ooff + s] = sum_d q[d] * rows_flat[roff + s * hd + d] for s < 16: one query (hd
    floats, hd % 16 == 0) against 16 key rows hd floats apart from element `roff` of `rows`
    (a KV slab or its widened tile). The decode step's scores: each key's 16-lane partial sums
    are summed across by sum_lanes' tree (45 instructions for 16 keys) instead of 8 each."""
    sig = types.none(q, rows, roff, hd, out, ooff)

    def codegen(context, b, signature, args):
        qv, rowsv, roffv, hdv, outv, ooffv = args
        ats = signature.args
        qp = _ptr(context, b, ats[0], qv)
        kp = b.gep(_ptr(context, b, ats[1], rowsv), [roffv])
        op = b.gep(_ptr(context, b, ats[4], outv), [ooffv])
        zero = ir.Constant(_VF, [0.0] * 16)
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(16)]
        with cgutils.for_range(b, b.sdiv(hdv, _i64(16))) as loop:
            col = b.mul(loop.index, _i64(16))
            qc = b.load(_vec_ptr(b, qp, col), align=4)
            for s, acc in enumerate(accs):
                key = b.load(_vec_ptr(b, kp, b.add(b.mul(hdv, _i64(s)), col)), align=4)
                b.store(b.fadd(b.load(acc), b.fmul(qc, key, flags=_FAST), flags=_FAST), acc)
        total, lane_of = sum_lanes(b, [b.load(acc) for acc in accs])
        in_order = b.shuffle_vector(total, total, _mask([lane_of[s] for s in range(16)]))
        b.store(in_order, _vec_ptr(b, op, _i64(0)), align=4)
        return context.get_dummy_value()

    return sig, codegen
