"""The fused decode step's GEMV (kernels/decode.cu dgemv_<fmt>, built by
ops/native_decoder.dgemv) for every weight format on the CPU emulator, against numpy
(tests/gpu/checks.check_fused_gemv, which the GPU tests run too): each of its bodies, stacked
matrices, rows that leave the last block part empty, x in two chunks with a partial last
iteration (the 16-byte path reads the row's last unit there, against zeros of x), and the
fallback for an x that is not 16-byte aligned."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops import runtime_emu
from tests.gpu.checks import FORMATS, check_fused_gemv


@pytest.fixture(scope="module")
def emu_rt():
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    return runtime_emu.EmuRuntime(cache)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte", "fallback"])
def test_every_body_matches_numpy(emu_rt, fmt, aligned):
    from atlas_cli.backend.ops.native import NativeOps

    ops = NativeOps(emu_rt)
    ops.poison = True  # an output row the kernel forgets is NaN
    check_fused_gemv(ops, np.random.default_rng(3), fmt, aligned)
