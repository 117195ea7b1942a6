"""Prefill products of the K-quants on Intel AMX tiles, where the CPU and the kernel have them.

An AMX-INT8 `tdpbssd` here multiplies 16 tokens by 16 weight rows over 32 int8 columns into 16 x
16 int32 sums, 8,192 multiply-adds in one instruction: ~500 GMAC/s per core with its loads,
where the int16 tiles of cpu/prefill.py reach 64-75 (docs/performance.md). The pieces are the
decode path's: a Q4_K/Q5_K row as its integer codes (cpu.ir_int8's block decoders) with a float
scale per 32 columns, and x in two int8 planes per 256 columns, `hi = rint(x / d)` and the
remainder `lo` in units of d/256 (cpu.kernels.quantize_x's rounding: within d/512 of x). One
tile multiply per plane gives a 32-column group's exact integer dots of 16 tokens with 16 rows;
they are combined as `256 * hi + lo`, converted to float and scaled by the rows' scales, and
once per 256 columns by the tokens'. The `-dmin * m` offsets are the float product of x's
32-column sums that cpu/prefill.py uses too. Q6_K (a scale per 16 columns: twice the scaling per
multiply-add) measured no faster than its int16 tiles and stays on them.

AMX state needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM) and a tile
configuration per thread (`ldtilecfg`, at the start of each task). Its numerics cannot be
checked on a machine without it, so `checked()` compares it once per process with the int16
products on random blocks of each type before anything uses it, and says so when they differ.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

import numpy as np

from atlas_cli.backend.ops.cpu import jit

jit.configure()

from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.ir import BLOCKS, GROUP, Q4_K, Q5_K, _i64, _ptr  # noqa: E402
from atlas_cli.backend.ops.cpu.ir_int8 import (  # noqa: E402
    _INT_EMITTERS,
    _fsplat,
    _intrinsic_fn,
    dot_isa,
    target_features,
)
from atlas_cli.backend.ops.cpu.kernels import abs_max, group_sums, tile_dots  # noqa: E402
from atlas_cli.backend.ops.cpu.prefill import gemm_int16  # noqa: E402

AMX_TYPES = (Q4_K, Q5_K)
TILE = 16  # tokens per tile (its rows) and weight rows per tile (its int32 columns)
AMX_ENV = "ATLAS_CPU_AMX"  # "0": never use the AMX products

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_P8 = _I8.as_pointer()
_V16I, _V16F = ir.VectorType(_I32, TILE), ir.VectorType(_F32, TILE)
_FAST = ("fast",)
# tiles: 0, 1 the int32 sums of the hi and lo planes; 2, 3 those planes (16 tokens x GROUP
# bytes); 4 the weights (GROUP / 4 rows of 16 rows x 4 codes: the layout tdpbssd reads)
_C_HI, _C_LO, _X_HI, _X_LO, _W = range(5)


def _config() -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for groups of GROUP columns."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for tile, (n_rows, row_bytes) in enumerate(
        [(TILE, 4 * TILE), (TILE, 4 * TILE), (TILE, GROUP), (TILE, GROUP), (GROUP // 4, 4 * TILE)]
    ):
        rows[tile], colsb[tile] = n_rows, row_bytes
    return cfg


CONFIG = _config()


def _call(b, name: str, args, arg_types):
    """Calls the void LLVM intrinsic `name`."""
    return b.call(_intrinsic_fn(b, name, ir.VoidType(), arg_types), args)


def _imm(v: int) -> ir.Constant:
    return ir.Constant(_I8, v)


def _load_tile(b, tile: int, ptr, stride):
    _call(b, "llvm.x86.tileloadd64", [_imm(tile), b.bitcast(ptr, _P8), stride], [_I8, _P8, _I64])


@intrinsic
def tile_config(typingctx, cfg):
    """Loads the tile configuration `cfg` (uint8 (64,)) on this thread."""

    def codegen(context, b, signature, args):
        p = b.bitcast(_ptr(context, b, signature.args[0], args[0]), _P8)
        _call(b, "llvm.x86.ldtilecfg", [p], [_P8])
        return context.get_dummy_value()

    return types.none(cfg), codegen


@intrinsic
def tile_release(typingctx):
    """Gives this thread's tile state back (so a context switch need not save it)."""

    def codegen(context, b, signature, args):
        _call(b, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.none(), codegen


def _floats(b, ptr, index):
    """The <16 x float> at ptr[index:] (any alignment)."""
    return b.bitcast(b.gep(ptr, [index]), _V16F.as_pointer())


@intrinsic
def tile_block(typingctx, xh, xl, xoff, cols, wb, ws, xd, xdoff, ng, dst, doff, stride, nt):
    """dst[doff + t * stride + r] += the product of token t < nt of the 16 at int8
    `xh/xl[xoff + t * cols:]` with weight row r < 16, over `ng` groups of 32 columns: group j's
    weight tile at byte 512 j of `wb`, its row scales at ws[16 j:]; the tokens' scales per 256
    columns at xd[xdoff + t * ng / 8:] (in units of the lo plane)."""
    sig = types.none(xh, xl, xoff, cols, wb, ws, xd, xdoff, ng, dst, doff, stride, nt)

    def codegen(context, b, signature, args):
        xhv, xlv, xoffv, colsv, wbv, wsv, xdv, xdoffv, ngv, dstv, doffv, stridev, ntv = args
        ats = signature.args
        xhp = b.gep(_ptr(context, b, ats[0], xhv), [xoffv])
        xlp = b.gep(_ptr(context, b, ats[1], xlv), [xoffv])
        wbp = b.bitcast(_ptr(context, b, ats[4], wbv), _P8)
        wsp = _ptr(context, b, ats[5], wsv)
        xdp = b.gep(_ptr(context, b, ats[6], xdv), [xdoffv])
        dstp = b.gep(_ptr(context, b, ats[9], dstv), [doffv])
        # Two buffers of both planes' sums: group j's multiplies and stores run while the vector
        # unit scales group j - 1's. Storing and then loading one buffer in the same step made
        # each wait for the other (0.6x).
        sums = cgutils.alloca_once(b, ir.ArrayType(_I32, 4 * TILE * TILE))
        sums.align = 64
        sums_p = b.bitcast(sums, _V16I.as_pointer())
        zero = ir.Constant(_V16F, [0.0] * TILE)
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(TILE)]  # per token
        row_bytes, shift = _i64(4 * TILE), ir.Constant(_V16I, [8] * TILE)
        per_super = 256 // GROUP
        nsb = b.sdiv(ngv, _i64(per_super))

        def buffer(j):  # the first vector of group j's buffer
            return b.gep(sums_p, [b.mul(b.and_(j, _i64(1)), _i64(2 * TILE))])

        def multiply(j):
            col = b.mul(j, _i64(GROUP))
            _load_tile(b, _X_HI, b.gep(xhp, [col]), colsv)
            _load_tile(b, _X_LO, b.gep(xlp, [col]), colsv)
            _load_tile(b, _W, b.gep(wbp, [b.mul(j, _i64(GROUP * TILE))]), row_bytes)
            for c, x, offset in ((_C_HI, _X_HI, 0), (_C_LO, _X_LO, TILE)):
                _call(b, "llvm.x86.tilezero", [_imm(c)], [_I8])
                _call(b, "llvm.x86.tdpbssd", [_imm(c), _imm(x), _imm(_W)], [_I8] * 3)
                ptr = b.bitcast(b.gep(buffer(j), [_i64(offset)]), _P8)
                _call(b, "llvm.x86.tilestored64", [_imm(c), ptr, row_bytes], [_I8, _P8, _I64])

        def scale(j):  # group j's dots times its rows' scales; after a super-block, x's
            buf, row_scales = buffer(j), b.load(_floats(b, wsp, b.mul(j, _i64(TILE))), align=4)
            for t in range(TILE):
                hi = b.load(b.gep(buf, [_i64(t)]), align=64)
                lo = b.load(b.gep(buf, [_i64(TILE + t)]), align=64)
                dots = b.sitofp(b.add(b.shl(hi, shift), lo), _V16F)
                term = b.fmul(dots, row_scales, flags=_FAST)
                b.store(b.fadd(b.load(accs[t]), term, flags=_FAST), accs[t])
            end = b.icmp_signed("==", b.srem(j, _i64(per_super)), _i64(per_super - 1))
            with b.if_then(end):
                sb = b.sdiv(j, _i64(per_super))
                for t in range(TILE):
                    with b.if_then(b.icmp_signed("<", _i64(t), ntv)):
                        xscale = _fsplat(
                            b, b.load(b.gep(xdp, [b.add(b.mul(_i64(t), nsb), sb)])), TILE
                        )
                        p = _floats(b, dstp, b.mul(_i64(t), stridev))
                        term = b.fmul(b.load(accs[t]), xscale, flags=_FAST)
                        b.store(b.fadd(b.load(p, align=4), term, flags=_FAST), p, align=4)
                    b.store(zero, accs[t])

        multiply(_i64(0))
        with cgutils.for_range(b, ngv) as loop:  # j = 1 .. ng: multiply j, scale j - 1
            j = b.add(loop.index, _i64(1))
            with b.if_then(b.icmp_signed("<", j, ngv)):
                multiply(j)
            scale(loop.index)
        return context.get_dummy_value()

    return sig, codegen


def _make_row_codes(type_id: int):
    emit = _INT_EMITTERS[type_id]
    nbytes = BLOCKS[type_id][1]

    @intrinsic
    def row_codes(typingctx, w, woff, nb, wc, ws, wm):
        """One stored row of `nb` super-blocks at byte `woff` of `w` as wc (cols,) int8 codes,
        ws and wm (cols / 32,) float32 scales and offsets: element k = ws[k // 32] * wc[k] +
        wm[k // 32]."""
        sig = types.none(w, woff, nb, wc, ws, wm)

        def codegen(context, b, signature, args):
            wv, woffv, nbv, wcv, wsv, wmv = args
            ats = signature.args
            row = b.gep(_ptr(context, b, ats[0], wv), [woffv])
            wcp, wsp, wmp = (_ptr(context, b, ats[i], args[i]) for i in (3, 4, 5))
            with cgutils.for_range(b, nbv) as loop:
                s = loop.index
                block = emit(b, b.gep(row, [b.mul(s, _i64(nbytes))]))
                for i, q in enumerate(block.codes):
                    _store(b, wcp, b.add(b.mul(s, _i64(256)), _i64(32 * i)), q)
                _store(b, wsp, b.mul(s, _i64(8)), block.scales)
                _store(b, wmp, b.mul(s, _i64(8)), block.offsets)
            return context.get_dummy_value()

        return sig, codegen

    return row_codes


def _store(b, ptr, index, value):
    b.store(value, b.bitcast(b.gep(ptr, [index]), value.type.as_pointer()), align=1)


row_codes_q4_k, row_codes_q5_k = (_make_row_codes(t) for t in AMX_TYPES)


@njit(cache=True, inline="always")
def _row_codes(t, w, woff, nb, wc, ws, wm):
    if t == Q4_K:
        row_codes_q4_k(w, woff, nb, wc, ws, wm)
    else:
        row_codes_q5_k(w, woff, nb, wc, ws, wm)


@njit(parallel=True, cache=True, fastmath=False)
def quantize_planes(x, group, xh, xl, xd):
    """x (T, K) as two int8 planes per `group` columns (cpu.kernels.quantize_x's rounding):
    with d = max|x| / 127, xh = rint(x / d), xl = rint((x - d * xh) * 256 / d), xd[t, j] =
    d / 256, so x ~ xd * (256 * xh + xl)."""
    n_tok, cols = x.shape
    lim = np.float32(127.0)
    for t in prange(n_tok):
        xt, ht, lt = x[t], xh[t], xl[t]  # 1-D rows: half the time of 2-D indexing
        for j in range(cols // group):
            c0 = group * j
            d = abs_max(xt, c0, c0 + group) / lim
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            for i in range(c0, c0 + group):
                hi = min(max(np.rint(xt[i] * inv), -lim), lim)
                lo = min(max(np.rint((xt[i] - hi * d) * inv * np.float32(256.0)), -lim), lim)
                ht[i], lt[i] = np.int8(np.int32(hi)), np.int8(np.int32(lo))
            xd[t, j] = d / np.float32(256.0)


@njit(parallel=True, cache=True, fastmath=True)
def gemm_amx(t, w, off, rowbytes, nb, perm, x, out):
    """out (T, rows) = x (T, cols) @ W^T for a K-quant W (AMX_TYPES) on AMX tiles: each task
    turns 16 rows into codes in the tiles' layout once and multiplies them with every 16
    tokens. Call only when `ready()`."""
    n_tok, cols = x.shape
    rows = perm.shape[0]
    ng = cols // GROUP
    padded = (n_tok + TILE - 1) // TILE * TILE
    xh = np.zeros((padded, cols), np.int8)  # tokens past n_tok stay zero
    xl = np.zeros((padded, cols), np.int8)
    xd = np.zeros((padded, cols // 256), np.float32)
    quantize_planes(x, 256, xh, xl, xd)
    xs = np.empty((n_tok, ng), np.float32)  # x's 32-column sums: the offsets' side
    for i in range(n_tok):
        group_sums(x[i], xs[i])
    xhf, xlf, xdf = xh.reshape(-1), xl.reshape(-1), xd.reshape(-1)
    for task in prange((rows + TILE - 1) // TILE):
        r0 = task * TILE
        n = min(TILE, rows - r0)
        wc = np.zeros((TILE, cols), np.int8)  # rows past n stay zero
        ws = np.zeros((TILE, ng), np.float32)
        wm = np.zeros((TILE, ng), np.float32)
        for j in range(n):
            _row_codes(t, w, off + perm[r0 + j] * rowbytes, nb, wc[j], ws[j], wm[j])
        # this task's columns of out, 16 floats a token (L2; the offsets' float product and
        # the tiles write there), copied to out once
        part = np.empty((n_tok, TILE), np.float32)
        tile_dots(xs, wm, TILE, part, 0)
        wc32 = wc.view(np.int32)  # 4 codes of a row per int32: the tiles' layout is its transpose
        wb = np.empty((cols // 4, TILE), np.int32)
        for k in range(cols // 4):
            for r in range(TILE):
                wb[k, r] = wc32[r, k]
        wbf, wsf, partf = wb.reshape(-1), np.ascontiguousarray(ws.T).reshape(-1), part.reshape(-1)
        tile_config(CONFIG)
        for t0 in range(0, padded, TILE):
            xoff, xdoff, nt = t0 * cols, t0 * (cols // 256), min(TILE, n_tok - t0)
            tile_block(xhf, xlf, xoff, cols, wbf, wsf, xdf, xdoff, ng, partf, t0 * TILE, TILE, nt)
        tile_release()
        out[:, r0 : r0 + n] = part[:, :n]


# ---------------------------------------------------------------------------------------------
# whether to use it


def _host_has_amx() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or dot_isa() != "vnni512":
        return False
    return {"amx-int8", "amx-tile"} <= target_features()


def _request_permission() -> bool:
    """Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, 18
    except (OSError, AttributeError):
        return False


def random_rows(type_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) uint8 of random Q4_K/Q5_K blocks with finite, realistic scales."""
    nbytes = BLOCKS[type_id][1]
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    d = rng.uniform(0, 3e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    raw[:, :, 0:2] = d  # d, then dmin
    raw[:, :, 2:4] = (d.view(np.float16) / 4).view(np.uint8)
    return raw.reshape(rows, -1)


def agrees_with_int16(type_id: int, rows: int = 40, cols: int = 512, tokens: int = 21) -> bool:
    """gemm_amx against cpu.prefill.gemm_int16 on random blocks (read-only, as a memory map's
    are: the kernels' real argument types), within 1e-3 of max |ref|. Needs the permission."""
    rng = np.random.default_rng(type_id)
    blocks = random_rows(type_id, rows, cols, rng).reshape(-1)
    blocks.flags.writeable = False
    args = (type_id, blocks, 0, blocks.size // rows, cols // 256, np.arange(rows, dtype=np.int64))
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got, ref = (np.empty((tokens, rows), np.float32) for _ in range(2))
    gemm_amx(*args, x, got)
    gemm_int16(*args, x, ref)
    scale = float(np.abs(ref).max())
    return bool(np.isfinite(got).all() and np.abs(got - ref).max() <= 1e-3 * scale)


@functools.cache
def checked() -> bool:
    """The CPU and the kernel have AMX, and gemm_amx agreed with the int16 products here (once
    per process; a disagreement is said once, on stderr)."""
    if not _host_has_amx() or not _request_permission():
        return False
    if all(agrees_with_int16(t) for t in AMX_TYPES):
        return True
    print(
        "atlas: the AMX prefill products disagree with the int16 ones on this machine; "
        "using the int16 ones",
        file=sys.stderr,
    )
    return False


def ready() -> bool:
    """Whether the prefill products of AMX_TYPES run on AMX: ATLAS_CPU_AMX is not "0" and
    `checked()`."""
    return os.environ.get(AMX_ENV, "1") != "0" and checked()
