"""The MTP verify GEMV on the tensor cores (kernels/gemv_mma.cu: 2 <= T <= 8 tokens, the decoded
codes as f16 halves, x in two f16 parts per token scale, one MMA per 16 x 16 x 8) on the CPU
emulator, its sm_80 fragment code run with ldmatrix and mma.sync emulated on the same registers
(-DATLAS_EMU_MMA): equal to the float32 product within 2^-20 of sum |x w| for every format it
takes, edge rows, partial tiles and blocks, tokens of very different scales; linear() sending
T = 2..8 there; and its first-use check against gemv_t8 on a fake device."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import gemm_check, runtime_emu
from atlas_cli.backend.ops.native.weights import MMA_VERIFY_FORMATS
from tests.emu import emu_native_ops
from tests.gpu.checks import FORMATS, col_step, random_weight
from tests.test_gemm import FakeDevice

EMU_MMA = {"ATLAS_EMU_MMA": 1}
MMA_FORMATS = [f for f in FORMATS if f in MMA_VERIFY_FORMATS]


@pytest.fixture(scope="module")
def emu_ops():
    return emu_native_ops(weight_dtype="f32")


def _cols(fmt: str, base: int) -> int:
    step = col_step(fmt)
    return max(step, -(-base // step) * step)


def check_verify(got, x, wf, bias, what: str, bound: float = 2.0**-20) -> None:
    """Within `bound` * sum |x w| of the float64 product, token by token."""
    want = x.astype(np.float64) @ wf.astype(np.float64).T
    if bias is not None:
        want = want + bias
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T
    assert np.isfinite(got).all(), what
    for t in range(x.shape[0]):
        err = np.abs(got[t] - want[t]).max()
        assert err <= bound * mag[t].max() + 1e-30, f"{what}: token {t} off by {err:.3g}"


def test_formats_match_the_launcher():
    assert set(MMA_FORMATS) == MMA_VERIFY_FORMATS
    assert not MMA_VERIFY_FORMATS & {"f32", "f16", "bf16"}  # not f16 halves: gemv_t8 keeps them


@pytest.mark.parametrize("fmt", MMA_FORMATS)
def test_every_format_is_the_float32_product(emu_ops, fmt):
    """T = 2, 5, 8; 37 rows (a partial block of 32); 1.5 tiles of columns (a partial last
    tile: lanes with no unit there store zeros) and a single short tile; a bias on odd T."""
    rng = np.random.default_rng(11)
    for t, rows, base in ((2, 37, 1536), (5, 32, 256), (8, 70, 2048 + 512)):
        cols = _cols(fmt, base)
        w, wf = random_weight(fmt, rows, cols, rng)
        x = rng.standard_normal((t, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32) if t % 2 else None
        dw = emu_ops.prepare_weight(w)
        db = None if bias is None else emu_ops.asarray(bias)
        got = emu_ops.gemv_mma(emu_ops.asarray(x), dw, db, EMU_MMA).numpy()
        check_verify(got, x, wf, bias, f"{fmt} T={t} {rows}x{cols}")
        t8 = emu_ops.gemv(emu_ops.asarray(x), dw, db, emu_ops.empty((t, rows))).numpy()
        scale = np.abs(t8).max()
        assert np.abs(got - t8).max() <= 1e-5 * scale, f"{fmt}: gemv_t8 differs"


def test_tokens_of_very_different_scales(emu_ops):
    """Each token is scaled on its own (its largest |x| to [2^14, 2^15)), so a token near
    float32's top, one near its bottom, one of zeros and one with a single huge element keep
    their relative accuracy."""
    rng = np.random.default_rng(12)
    cols = 1024
    w, wf = random_weight("q4_k", 33, cols, rng)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    x[0] *= np.float32(1e30)
    x[1] *= np.float32(1e-30)
    x[2] = 0.0
    x[4, 7] = 3e4  # beside values ~1: they keep 22 bits of their own, not of the largest
    got = emu_ops.gemv_mma(emu_ops.asarray(x), emu_ops.prepare_weight(w), None, EMU_MMA).numpy()
    check_verify(got, x, wf, None, "scales")
    assert (got[2] == 0).all()


def test_a_long_row_splits_its_x_over_many_blocks(emu_ops):
    """17,408 columns (the 27B's MLP width: 17 tiles, more than gemv_mma_x's 16 blocks per
    token, so each block takes 68 slices, runs that do not follow the tiles)."""
    rng = np.random.default_rng(16)
    w, wf = random_weight("q4_k", 33, 17408, rng)
    x = rng.standard_normal((3, 17408)).astype(np.float32)
    got = emu_ops.gemv_mma(emu_ops.asarray(x), emu_ops.prepare_weight(w), None, EMU_MMA).numpy()
    check_verify(got, x, wf, None, "17408 columns")


def test_split_keeps_22_bits_not_11(emu_ops):
    """One f16 part would leave 2^-11 of x: the check's bound is 2^-20, and the kernel is well
    inside it (the second part is read)."""
    rng = np.random.default_rng(13)
    w, wf = random_weight("q8_0", 32, 1024, rng)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    got = emu_ops.gemv_mma(emu_ops.asarray(x), emu_ops.prepare_weight(w), None, EMU_MMA).numpy()
    want = x.astype(np.float64) @ wf.astype(np.float64).T
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T
    assert np.abs(got - want).max() <= 2.0**-21 * mag.max()


def _mma_ops(**kw):
    """Emulator ops whose verify GEMV is gemv_mma.cu's fragment code."""
    ops = emu_native_ops(weight_dtype="f32", **kw)
    ops._gemm_choices = {
        "verify": gemm_check.GemmChoice("verify", "tensor-core", "emulated fragments", EMU_MMA)
    }
    return ops


def test_linear_sends_2_to_8_tokens_to_the_mma_kernel():
    """linear(): T = 1 keeps gemv.cu's T == 1 body, T = 2..8 of a quantized weight take
    gemv_mma (bit-equal to calling it), bf16 weights and T = 9 do not."""
    ops = _mma_ops(prefill="exact")  # T = 9: the float32-exact GEMM, for the same bound
    rng = np.random.default_rng(14)
    w, wf = random_weight("q6_k", 40, 512, rng)
    dw = ops.prepare_weight(w)
    for t in (1, 2, 8, 9):
        x = rng.standard_normal((t, 512)).astype(np.float32)
        got = ops.linear(ops.asarray(x), dw).numpy()
        if t <= 8:
            mma = ops.gemv_mma(ops.asarray(x), dw, None, EMU_MMA).numpy()
            assert np.array_equal(got, mma) == (t > 1), t
        assert np.abs(got - ref.linear(x, wf)).max() <= 2e-5 * np.abs(got).max()
    fb, _ = random_weight("bf16", 40, 512, rng)
    assert not ops._verify_on_mma(ops.prepare_weight(fb))


class FakeMmaDevice(FakeDevice):
    """The emulator as an sm_90 CUDA device (its gemv_mma.cu: the emulated fragment code);
    `broken`: one output element of each gemv_mma launch off by 1."""

    def launch(self, fn, grid, block, args) -> None:
        super().launch(fn, grid, block, args)
        if self.broken and fn.name.startswith("gemv_mma_") and fn.name != "gemv_mma_x":
            ctypes.c_float.from_address(args[7].value).value += 1.0  # y


@pytest.mark.parametrize("broken", [False, True])
def test_the_verify_kernel_is_checked_against_gemv_t8(tmp_path: Path, broken):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    ops = NativeOps(FakeMmaDevice(tmp_path, broken), weight_dtype="f32")
    rng = np.random.default_rng(15)
    w, wf = random_weight("nvfp4", 40, 1024, rng)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    got = ops.linear(ops.asarray(x), ops.prepare_weight(w)).numpy()
    check_verify(got, x, wf, None, "after the check")
    choice = ops.gemm_choice("verify")
    assert choice.kernel == ("portable" if broken else "tensor-core"), choice
    assert gemm_check.verdict_path(ops.rt, "verify").exists()


def test_no_mma_sync_no_mma_kernel(tmp_path: Path):
    """The emulator itself, HIP and pre-sm_80 CUDA verify with gemv_t8."""
    ops = emu_native_ops(weight_dtype="f32")
    assert ops.gemm_choice("verify").kernel == "none"
    fake = FakeDevice(tmp_path, False)
    fake.target = "sm_75"
    assert not gemm_check._has_mma_sync(fake)
    fake.target = "sm_121a"
    assert gemm_check._has_mma_sync(fake)
