"""The fast prefill GEMM (kernels/gemm_fast.cu: x and the weights rounded to bf16, one MMA per
product) on the CPU emulator: equal to numpy on the bf16-rounded operands up to summation
order, within 2 * 2^-8 sum |x w| of the float32 product, for every format and edge tiles; the
sm_80 fragment code (ldmatrix, mma.sync, the cp.async ring) run with both instructions
emulated on the same registers; and its first-use self-check on a fake device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import gemm_check, runtime_emu
from atlas_cli.backend.ops.native.runtime import i32, ptr
from tests.emu import emu_native_ops
from tests.gpu.checks import FORMATS, col_step, random_weight
from tests.test_gemm import FakeDevice

EMU_MMA = {"ATLAS_EMU_MMA": 1}  # gemm_fast.cu's sm_80 fragment code, emulated


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (round to nearest even) -> float32, as gemm_fast.cu rounds."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.fixture(scope="module")
def emu_ops():
    return emu_native_ops(weight_dtype="f32", prefill="fast")


def _case(fmt: str, t: int, rows: int, base: int, rng):
    step = col_step(fmt)
    cols = max(step, -(-base // step) * step)
    w, wf = random_weight(fmt, rows, cols, rng)
    x = rng.standard_normal((t, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32) if t % 2 else None
    return w, wf, x, bias


def check_fast(got: np.ndarray, fmt: str, wf: np.ndarray, x: np.ndarray, bias, what: str) -> None:
    # NVFP4's values are exact in bf16 before its global scale, which the epilogue applies
    wb = wf if fmt == "nvfp4" else bf16(wf)
    want = bf16(x).astype(np.float64) @ wb.astype(np.float64).T
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T
    if bias is not None:
        want = want + bias
    assert np.isfinite(got).all(), what
    # the bf16 operands' product, up to float32 summation order
    assert np.abs(got - want).max() <= 1e-5 * mag.max(), what
    # the kernel-level bound against the float32 product: bf16 keeps 8 significant bits, so
    # each operand is off by at most 2^-8 of itself and each product by 2 * 2^-8
    exact = ref.linear(x, wf, bias)
    assert (np.abs(got - exact) <= 2 * 2.0**-8 * mag + 1e-6).all(), what


# (tokens, rows, cols before rounding to the format's block): edge tiles in every dimension
# (64 tokens x 128 rows), 4+ steps so the 3-slot x ring wraps, 600 tokens = 10 token tiles
SHAPES = [(9, 70, 96), (64, 128, 64), (65, 1, 32), (131, 150, 288), (600, 37, 256)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_gemm_matches_numpy_on_bf16_operands(emu_ops, fmt):
    rng = np.random.default_rng(100 + FORMATS.index(fmt))
    for t, rows, base in SHAPES:
        w, wf, x, bias = _case(fmt, t, rows, base, rng)
        dev_b = None if bias is None else emu_ops.asarray(bias)
        got = emu_ops.linear(emu_ops.asarray(x), emu_ops.prepare_weight(w), dev_b).numpy()
        check_fast(got, fmt, wf, x, bias, f"gemm_fast {fmt} T={t} {rows}x{x.shape[1]}")


def test_fast_gemm_partial_units_and_unaligned_x(emu_ops):
    """Rows not a multiple of 32 long (the element-wise weight path, x's zero columns past
    cols) and an x that starts 4 bytes into a buffer."""
    rng = np.random.default_rng(7)
    for fmt in ("f32", "bf16", "f16"):
        for t, cols in ((9, 8), (70, 48), (33, 100), (17, 131)):
            w, wf = random_weight(fmt, 37, cols, rng)
            x = rng.standard_normal((t + 1, cols)).astype(np.float32)
            dev_x = emu_ops.asarray(x)[1:]
            got = emu_ops.linear(dev_x, emu_ops.prepare_weight(w)).numpy()
            check_fast(got, fmt, wf, x[1:], None, f"gemm_fast {fmt} T={t} 37x{cols}")


@pytest.mark.parametrize("fmt", ["bf16", "q4_k", "nvfp4"])
def test_the_sm80_fragment_code_matches_the_portable_kernel(emu_ops, fmt):
    """ldmatrix.x4 and mma.sync m16n8k16 emulated by warp shuffles on the very registers the
    sm_80 path fills (-DATLAS_EMU_MMA): a swapped fragment word, a wrong ldmatrix row address
    or a ring slot read before it is written changes the result by O(1)."""
    rng = np.random.default_rng(1)
    for t, rows, base in ((9, 150, 512), (70, 128, 96)):
        w, wf, x, bias = _case(fmt, t, rows, base, rng)
        dw, dx = emu_ops.prepare_weight(w), emu_ops.asarray(x)
        db = None if bias is None else emu_ops.asarray(bias)
        frag = emu_ops.gemm(dx, dw, db, EMU_MMA, kind="fast").numpy()
        check_fast(frag, fmt, wf, x, bias, f"fragments {fmt} T={t} {rows}x{x.shape[1]}")
        portable = emu_ops.gemm(dx, dw, db, None, kind="fast").numpy()
        np.testing.assert_allclose(frag, portable, rtol=1e-5, atol=1e-5)


def test_fast_and_exact_differ_as_bf16_rounding_says(emu_ops):
    """The fast kernel is not the exact one under another name: on these operands bf16
    rounding moves the product by ~1e-3 of its scale, the exact kernel by < 2e-5."""
    rng = np.random.default_rng(5)
    w, wf = random_weight("f32", 64, 512, rng)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    dw, dx = emu_ops.prepare_weight(w), emu_ops.asarray(x)
    want = ref.linear(x, wf)
    scale = np.abs(want).max()
    fast = emu_ops.gemm(dx, dw, None, None, kind="fast").numpy()
    exact = emu_ops.gemm(dx, dw, None, None, kind="exact").numpy()
    assert np.abs(exact - want).max() < 2e-5 * scale
    assert 1e-4 * scale < np.abs(fast - want).max() < 1e-2 * scale


def _fast_device_ops(tmp_path: Path, broken: bool):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    return NativeOps(FakeDevice(tmp_path, broken), weight_dtype="f32", prefill="fast")


@pytest.mark.parametrize("broken", [False, True])
def test_the_fast_kernel_is_checked_against_its_portable_build(tmp_path, broken):
    """On a "cuda" runtime the first fast GEMM runs gemm_fast.cu's tensor-core build (here the
    emulator's, made wrong by one output element when `broken`) against its ATLAS_PORTABLE
    build, and keeps the verdict beside the compile cache."""
    ops = _fast_device_ops(tmp_path, broken)
    rng = np.random.default_rng(2)
    w, wf = random_weight("bf16", 40, 96, rng)
    x = rng.standard_normal((12, 96)).astype(np.float32)
    got = ops.linear(ops.asarray(x), ops.prepare_weight(w)).numpy()
    check_fast(got, "bf16", wf, x, None, "after the check")
    choice = ops.gemm_choice()
    assert choice.kind == "fast"
    if broken:
        assert choice.kernel == "portable" and choice.defines == gemm_check.PORTABLE
        assert "disagreed with the portable one" in choice.reason
    else:
        assert choice.kernel == "tensor-core" and choice.defines is None
    assert gemm_check.verdict_path(ops.rt, "fast").exists()
    assert not gemm_check.verdict_path(ops.rt, "exact").exists()


def test_the_x_conversion_rounds_to_nearest_even_and_zero_pads(emu_ops):
    """gemm_x_bf16 alone: ties to even, NaN kept, columns past cols zero."""
    x = np.array([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0**-130), np.nan, 3.0e38]], np.float32)
    ld = 64
    xb = emu_ops.empty((1, ld), np.uint16)
    fn = emu_ops.rt.compile("gemm_fast.cu").function("gemm_x_bf16")
    dx = emu_ops.asarray(x)
    emu_ops.rt.launch(fn, (1,), (256,), [ptr(dx.ptr), ptr(xb.ptr), i32(1), i32(5), i32(ld)])
    got = xb.numpy().astype(np.uint32)
    want = bf16(x).view(np.uint32) >> 16
    assert (got[0, :3] == want[0, :3]).all() and got[0, 4] == want[0, 4]
    assert np.isnan((got[0, 3] << 16).astype(np.uint32).view(np.float32))
    assert (got[0, 5:] == 0).all()


def test_atlas_prefill_picks_the_gemm_of_a_device(monkeypatch):
    """ATLAS_PREFILL=exact opens a device with the float32-exact GEMM, the default with the
    fast one; another value is a one-line error before anything loads."""
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native import device
    from atlas_cli.errors import UsageError

    monkeypatch.delenv("ATLAS_PREFILL", raising=False)
    assert device.open_device("emu").prefill == "fast"
    monkeypatch.setenv("ATLAS_PREFILL", "exact")
    assert device.open_device("emu").prefill == "exact"
    monkeypatch.setenv("ATLAS_PREFILL", "bf16x3")
    with pytest.raises(UsageError, match="ATLAS_PREFILL must be fast, exact, fp4, got 'bf16x3'"):
        device.open_device("emu")
