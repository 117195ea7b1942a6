"""The fused decode step's GEMV (kernels/decode.cu dgemv_<fmt>, built by
ops/native_decoder.dgemv) for every weight format on the CPU emulator, against numpy
(tests/gpu/checks.check_fused_gemv, which the GPU tests run too): each of its bodies, stacked
matrices, rows that leave the last block part empty, x in two chunks with a partial last
iteration (the 16-byte path reads the row's last unit there, against zeros of x), and the
fallback for an x that is not 16-byte aligned."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.checks import FORMATS, check_fused_gemv
from tests.test_native_qwen35 import emu_ops


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte", "fallback"])
def test_every_body_matches_numpy(fmt, aligned):
    check_fused_gemv(emu_ops("f32"), np.random.default_rng(3), fmt, aligned)
