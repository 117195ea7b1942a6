"""Shared-memory banks of the GEMV's x reads (kernels/gemv.cuh gv_lane): each 16-byte read of
a warp is served 8 lanes at a time, one pass when those 8 float4s sit in distinct 16-byte bank
groups (float4 index mod 8). The lanes' indices come from the kernel code itself, run on the
emulator through a probe entry compiled beside the kernels."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from atlas_cli.backend.ops.native import runtime as rt
from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.backend.ops.native.runtime import ptr
from tests.gpu.checks import FORMATS

PROBE = """#include "gemv.cuh"
#define LANES(name, F)                                                                  \\
    extern "C" __global__ void lanes_##name(int* out) {                                 \\
        GvLane g = gv_lane<F>((int)threadIdx.x);                                        \\
        out[2 * threadIdx.x] = g.xa;                                                    \\
        out[2 * threadIdx.x + 1] = g.xb;                                                \\
    }
ATLAS_FOR_EACH_FORMAT(LANES)
"""


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    kdir = tmp_path_factory.mktemp("kernels") / "kernels"
    shutil.copytree(rt.kernels_dir(), kdir)
    (kdir / "lanes.cu").write_text(PROBE)
    mp = pytest.MonkeyPatch()
    mp.setattr(rt, "kernels_dir", lambda: kdir)
    runtime = runtime_emu.EmuRuntime(tmp_path_factory.mktemp("cache"))
    module = runtime.compile("lanes.cu")
    found = {}
    for fmt in FORMATS:
        buf = runtime.alloc(64 * 4)
        runtime.launch(module.function(f"lanes_{fmt}"), (1,), (32,), [ptr(buf.ptr)])
        out = np.empty(64, np.int32)
        runtime.d2h(out, buf)
        found[fmt] = out.reshape(32, 2)
    mp.undo()
    return found


def worst_sharing(index: np.ndarray) -> int:
    """Most lanes of one 8-lane phase in one bank group, over the 4 float4s a half reads."""
    return max(
        np.bincount((index[q : q + 8] + k) % 8, minlength=8).max()
        for q in range(0, 32, 8)
        for k in range(4)
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_x_reads_are_conflict_free(lanes, fmt):
    xa, xb = lanes[fmt][:, 0], lanes[fmt][:, 1]
    # Q6_K's lanes read units {0, 1, 4, 5} of each 8 with both halves: two lanes per bank
    # group whatever the gap between a unit's halves (gemv.cuh gv_lane)
    allowed = 2 if fmt == "q6_k" else 1
    assert worst_sharing(xa) == allowed and worst_sharing(xb) == allowed, (fmt, xa, xb)
