"""The counters of the fused decode step's work claiming (cpu_ir_sync), on numba's threads."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops.cpu.ir_sync import SLOT, claim, load_acquire, wait_until

numba = pytest.importorskip("numba")


@numba.njit(parallel=True)
def _hand_out(n, step, workers, counters, taken):
    """Every worker claims chunks of `step` items until none are left, marks them, adds them
    to the done count, then waits for all n."""
    for _worker in numba.prange(workers):
        while True:
            i0 = claim(counters, 0, step)
            if i0 >= n:
                break
            i1 = min(n, i0 + step)
            for i in range(i0, i1):
                taken[i] += 1
            claim(counters, SLOT, i1 - i0)
        wait_until(counters, SLOT, n)


@pytest.mark.parametrize("workers", [1, 2, 7])
@pytest.mark.parametrize("step", [1, 3, 64])
def test_each_item_is_claimed_exactly_once(workers, step):
    n = 1000
    counters = np.zeros(2 * SLOT, np.int64)
    taken = np.zeros(n, np.int64)
    _hand_out(n, step, workers, counters, taken)
    assert (taken == 1).all()
    assert counters[SLOT] == n  # done: every item once
    assert counters[0] >= n  # claims: the last one of each worker found nothing left


@numba.njit
def _claim_and_read(counters):
    a = claim(counters, 0, 5)
    b = claim(counters, 0, 2)
    return a, b, load_acquire(counters, 0)


def test_claim_returns_the_value_before_and_load_reads_the_sum():
    counters = np.full(SLOT, 10, np.int64)
    assert _claim_and_read(counters) == (10, 15, 17)
    assert counters[0] == 17
