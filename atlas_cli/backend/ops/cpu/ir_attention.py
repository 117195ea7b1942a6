"""Attention as LLVM IR: prefill's 4 queries x 32 keys tile of scores (cpu.kernels.attention), and
the decode step's one query x 16 keys and its probabilities x values (cpu.decode.attend_group),
both reading a float16 KV cache's bits directly (one vcvtph2ps per 16 elements), so that no
pass widens the keys and values into a float32 tile first.

Scores are q . k over a head's 64-256 dims. As a dot product per (query, key) (tile_dots) every
result ends in a horizontal sum of 16 lanes, as many instructions as the products themselves at
hd = 128. With the keys transposed (hd, S), 16 keys are one vector: per dim, two key vectors and
four broadcast query values make 8 FMAs into 8 accumulators, and no lane is summed across.
"""

from __future__ import annotations

from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.ir import (  # noqa: E402
    _FAST,
    _HALF,
    _VF,
    PREFETCH_BYTES,
    _i64,
    _mask,
    _ptr,
    _splat,
    prefetch_line,
    sum_lanes,
)

QK_QUERIES, QK_KEYS = 4, 32  # 8 accumulators, 2 key vectors, 4 broadcasts: 14 zmm registers


def _vec_ptr(b, base, index):
    return b.bitcast(b.gep(base, [index]), _VF.as_pointer())


def _outer_accumulate(b, scalars, vectors, accs) -> None:
    """accs[i * len(vectors) + h] += scalars[i] * vectors[h]: each scalar broadcast once, one
    FMA per pair into its own accumulator (allocas that LLVM keeps in registers)."""
    for i, x in enumerate(scalars):
        xs = _splat(b, x)
        for h, v in enumerate(vectors):
            acc = accs[i * len(vectors) + h]
            b.store(b.fadd(b.load(acc), b.fmul(xs, v, flags=_FAST), flags=_FAST), acc)


class _Slab:
    """A KV slab (float32, or float16 bits as uint16) from element `offset` on: load(index)
    gives 16 float32 from element offset + index (widened where the slab is float16). A decode
    step streams ~1.5 MB of float16 keys and values per layer at 2,048 positions of a
    3-KV-head model from memory: the kernels ask for their rows PREFETCH_BYTES ahead."""

    def __init__(self, context, b, aryty, value, offset):
        self.b = b
        self.half = aryty.dtype == types.uint16
        self.elem_bytes = 2 if self.half else 4
        base = b.gep(_ptr(context, b, aryty, value), [offset])
        self.base = b.bitcast(base, _HALF.as_pointer()) if self.half else base

    def load(self, index):
        b = self.b
        if not self.half:
            return b.load(_vec_ptr(b, self.base, index), align=4)
        vh = ir.VectorType(_HALF, 16)
        v = b.load(b.bitcast(b.gep(self.base, [index]), vh.as_pointer()), align=2)
        return b.fpext(v, _VF)

    def prefetch(self, index, count):
        """Ask for the lines of elements index .. index + count, once each: `count` a Python
        int (the calls written out, as a row loop wants them) or an IR value (a loop)."""
        b, per_line = self.b, 64 // self.elem_bytes
        if isinstance(count, int):
            for k in range(0, count, per_line):
                prefetch_line(b, b.gep(self.base, [b.add(index, _i64(k))]))
            return
        with cgutils.for_range_slice(b, index, b.add(index, count), _i64(per_line)) as (at, _):
            prefetch_line(b, b.gep(self.base, [at]))

    def rows_ahead(self, hd):
        """How many rows of hd elements PREFETCH_BYTES are (an IR value)."""
        return self.b.sdiv(_i64(PREFETCH_BYTES // self.elem_bytes), hd)


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
            queries = [
                b.load(b.gep(qp, [b.add(b.mul(hdv, _i64(i)), d)])) for i in range(QK_QUERIES)
            ]
            _outer_accumulate(b, queries, keys, accs)
        for i in range(QK_QUERIES):
            for h in range(halves):
                at = b.add(b.mul(ostridev, _i64(i)), _i64(16 * h))
                b.store(b.load(accs[i * halves + h]), _vec_ptr(b, op, at), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dots16(typingctx, q, rows, roff, hd, out, ooff):
    """out[ooff + s] = sum_d q[d] * rows_flat[roff + s * hd + d] for s < 16: one query (hd
    floats, hd % 16 == 0) against 16 key rows hd elements apart from element `roff` of `rows`
    (a KV slab, float32 or float16 bits). The decode step's scores: each key's 16-lane partial
    sums are summed across by sum_lanes' tree (45 instructions for 16 keys) instead of 8 each."""
    sig = types.none(q, rows, roff, hd, out, ooff)

    def codegen(context, b, signature, args):
        qv, rowsv, roffv, hdv, outv, ooffv = args
        ats = signature.args
        qp = _ptr(context, b, ats[0], qv)
        keys = _Slab(context, b, ats[1], rowsv, roffv)
        op = b.gep(_ptr(context, b, ats[4], outv), [ooffv])
        zero = ir.Constant(_VF, [0.0] * 16)
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(16)]
        # the 16 rows that many rows on: one run of 16 * hd elements (a hint: it cannot fault)
        keys.prefetch(b.mul(keys.rows_ahead(hdv), hdv), b.mul(hdv, _i64(16)))
        with cgutils.for_range(b, b.sdiv(hdv, _i64(16))) as loop:
            col = b.mul(loop.index, _i64(16))
            qc = b.load(_vec_ptr(b, qp, col), align=4)
            for s, acc in enumerate(accs):
                key = keys.load(b.add(b.mul(hdv, _i64(s)), col))
                b.store(b.fadd(b.load(acc), b.fmul(qc, key, flags=_FAST), flags=_FAST), acc)
        total, lane_of = sum_lanes(b, [b.load(acc) for acc in accs])
        in_order = b.shuffle_vector(total, total, _mask([lane_of[s] for s in range(16)]))
        b.store(in_order, _vec_ptr(b, op, _i64(0)), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_pv(heads: int, vecs: int):
    @intrinsic
    def pv(typingctx, probs, poff, pstride, rows, roff, n, hd, acc, aoff):
        """acc[aoff + h * hd + c] += sum_{s < n} probs[poff + h * pstride + s] *
        rows_flat[roff + s * hd + c] for h < `heads`, c < 16 * `vecs`: the probabilities of
        `heads` query heads times 16 * `vecs` columns of n value rows (a KV slab, float32 or
        float16 bits). Each head's sums stay in registers while the rows stream past, every row
        loaded (and widened) once for all the heads; heads * vecs independent sums keep the
        FMA latency hidden (one sum per head would wait on each FMA)."""
        sig = types.none(probs, poff, pstride, rows, roff, n, hd, acc, aoff)

        def codegen(context, b, signature, args):
            pv, poffv, pstridev, rowsv, roffv, nv, hdv, accv, aoffv = args
            ats = signature.args
            pp = b.gep(_ptr(context, b, ats[0], pv), [poffv])
            vals = _Slab(context, b, ats[3], rowsv, roffv)
            ap = b.gep(_ptr(context, b, ats[7], accv), [aoffv])
            zero = ir.Constant(_VF, [0.0] * 16)
            sums = [cgutils.alloca_once_value(b, zero) for _ in range(heads * vecs)]
            ahead = vals.rows_ahead(hdv)
            with cgutils.for_range(b, nv) as loop:
                s = loop.index
                at = b.mul(s, hdv)
                vals.prefetch(b.mul(b.add(s, ahead), hdv), 16 * vecs)
                row = [vals.load(b.add(at, _i64(16 * v))) for v in range(vecs)]
                probs = [
                    b.load(b.gep(pp, [b.add(b.mul(pstridev, _i64(h)), s)])) for h in range(heads)
                ]
                _outer_accumulate(b, probs, row, sums)
            for h in range(heads):
                for v in range(vecs):
                    out = _vec_ptr(b, ap, b.add(b.mul(hdv, _i64(h)), _i64(16 * v)))
                    total = b.load(sums[h * vecs + v])
                    b.store(b.fadd(b.load(out, align=4), total, flags=_FAST), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return pv


# 64 columns (4 vectors) of up to 4 heads: 16 sums and 4 rows in the 32 vector registers; 16
# columns where hd % 64 != 0
pv64_4, pv64_2, pv64_1 = (_make_pv(h, 4) for h in (4, 2, 1))
pv16_4, pv16_2, pv16_1 = (_make_pv(h, 1) for h in (4, 2, 1))
