"""Counters shared by the threads of one parallel region: the fused decode step's work claiming.

numba starts a parallel loop per `prange`, and with TBB each start builds a task arena that
the idle workers join again, ~4 us back to back and ~17 us between the short serial stretches
of a decode step: 150 loops per token of the default model cost more than a tenth of its
2-thread decode (docs/performance.md). The fused step instead runs one loop per token, one
iteration per worker, and hands the rows of each stage out through atomic counters: a worker
claims a chunk (`claim`), computes it, adds it to the stage's done count, and when nothing is
left to claim waits (`wait_until`) for the chunks other workers hold. A worker that starts late
finds the stages claimed and passes through, so iterations that TBB runs one after the other
on one thread finish too (the first does everything); nobody waits on work nobody holds.
"""

from __future__ import annotations

import platform
import sys

from atlas_cli.backend.ops.cpu import jit

jit.configure()  # before numba loads: TBB, the pool size, the cache stamp

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from atlas_cli.backend.ops.cpu.ir import _ptr  # noqa: E402

SLOT = 8  # int64s per counter: one 64-byte line each, so no two counters share a line
SPINS = 4096  # pauses (~0.1-0.5 ms) before a waiting worker yields its core once


@intrinsic
def claim(typingctx, counters, index, n):
    """counters[index] += n atomically (sequentially consistent); returns the value before."""
    sig = types.int64(counters, index, n)

    def codegen(context, b, signature, args):
        arr, idx, nv = args
        p = b.gep(_ptr(context, b, signature.args[0], arr), [idx])
        return b.atomic_rmw("add", p, nv, "seq_cst")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, counters, index):
    """counters[index], read with acquire order: what was written before the matching
    `claim` on another thread is visible after it."""
    sig = types.int64(counters, index)

    def codegen(context, b, signature, args):
        arr, idx = args
        p = b.gep(_ptr(context, b, signature.args[0], arr), [idx])
        return b.load_atomic(p, "acquire", 8)

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 `pause`; nothing elsewhere)."""
    sig = types.void()

    def codegen(context, b, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64"):
            fn = cgutils.get_or_insert_function(
                b.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            b.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


if sys.platform.startswith("linux") or sys.platform == "darwin":
    _sched_yield = types.ExternalFunction("sched_yield", types.int32())

    @njit(cache=True, inline="always")
    def give_way():
        _sched_yield()

else:

    @njit(cache=True, inline="always")
    def give_way():
        pass


@njit(cache=True, inline="always")
def wait_until(counters, index, n):
    """Spin until counters[index] >= n. Only chunks that a running worker holds are waited for,
    each a few microseconds of rows; a wait much longer than that means the holder lost its
    core to another process, and spinning on would keep the core it needs: give it away."""
    spins = 0
    while load_acquire(counters, index) < n:
        pause()
        spins += 1
        if spins == SPINS:
            give_way()
            spins = 0
