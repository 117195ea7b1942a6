"""The W4A4 prefill GEMM (kernels/gemm_fp4.cu: NVFP4 weights, x quantized to NVFP4 per token,
Blackwell's block-scaled FP4 MMA) on the CPU emulator: the quantizer bit for bit against
numpy, the portable kernel and the MMA's fragment code (-DATLAS_EMU_MMA: ldmatrix and the
block-scaled MMA emulated on the same registers) against numpy on the quantized operands, and
which weights and devices take it."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops.native import gemm_check, runtime_emu
from atlas_cli.backend.ops.native.runtime import i32, ptr
from atlas_cli.backend.requantize import e2m1_codes
from tests.emu import emu_native_ops
from tests.gpu.checks import E2M1, E4M3, e4m3_encode_ref, random_weight
from tests.test_gemm import FakeDevice

EMU_MMA = {"ATLAS_EMU_MMA": 1}


@pytest.fixture(scope="module")
def emu_ops():
    return emu_native_ops(weight_dtype="f32", prefill="fp4")


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NVIDIA's activation recipe as gemm_x_nvfp4 computes it, in float32: (codes (T, cols),
    E4M3 scale codes (T, cols / 16), global scales (T,))."""
    t, cols = x.shape
    amax = np.abs(x).max(1)
    g = np.where(amax > 0, amax / np.float32(448 * 6), np.float32(1)).astype(np.float32)
    blocks = x.reshape(t, cols // 16, 16)
    bmax = np.abs(blocks).max(-1)
    sc = e4m3_encode_ref((bmax / (np.float32(6) * g[:, None])).astype(np.float32))
    d = (E4M3[sc] * g[:, None]).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (blocks / d[..., None]).astype(np.float32)
    codes = np.where(d[..., None] > 0, e2m1_codes(v), 0).astype(np.uint8)
    return codes.reshape(t, cols), sc, g


def _quantize_on_device(ops, x: np.ndarray):
    t, cols = x.shape
    xq = ops.empty((t, cols // 2), np.uint8)
    xs = ops.empty((t, cols // 16), np.uint8)
    xg = ops.empty((t,))
    fn = ops.rt.compile("gemm_fp4.cu").function("gemm_x_nvfp4")
    dx = ops.asarray(x)
    ops.rt.launch(
        fn, (t,), (256,), [ptr(dx.ptr), ptr(xq.ptr), ptr(xs.ptr), ptr(xg.ptr), i32(t), i32(cols)]
    )
    packed = xq.numpy()
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(t, cols)
    return codes, xs.numpy(), xg.numpy()


def test_the_quantizer_matches_numpy_bit_for_bit(emu_ops):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 256)) * np.array([[1], [1e-3], [50], [0], [1], [1]])).astype(
        np.float32
    )
    x[4, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -6.5, 0, 1e-30, 3, 3, 3, 6]
    x[5, 5] = 7.0e4  # one outlier: every other block of the row gets tiny scales
    got = _quantize_on_device(emu_ops, x)
    want = quantize_x(x)
    for g, w, what in zip(got, want, ("codes", "scales", "global scales"), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=what)
    assert (got[0][3] == 0).all() and got[2][3] == 1.0  # a zero row: codes 0, global scale 1


def _reference(x: np.ndarray, wf: np.ndarray, bias) -> tuple[np.ndarray, np.ndarray]:
    """y from x's quantized values and the weight's (wf) in float64, and sum |x w|."""
    codes, sc, g = quantize_x(x)
    xd = E2M1[codes].astype(np.float64) * np.repeat(E4M3[sc], 16, 1) * g[:, None]
    wd = wf.astype(np.float64)
    y = xd @ wd.T + (0 if bias is None else bias)
    return y, np.abs(x).astype(np.float64) @ np.abs(wd).T


SHAPES = [(9, 129, 128), (67, 200, 256), (130, 1, 512), (64, 128, 384)]


@pytest.mark.parametrize("defines", [None, EMU_MMA], ids=["portable", "fragments"])
def test_w4a4_gemm_matches_numpy_on_the_quantized_operands(emu_ops, defines):
    rng = np.random.default_rng(3)
    for t, rows, cols in SHAPES[:2] if defines else SHAPES:
        w, wf = random_weight("nvfp4", rows, cols, rng)
        x = rng.standard_normal((t, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32) if t % 2 else None
        db = None if bias is None else emu_ops.asarray(bias)
        got = emu_ops.gemm(
            emu_ops.asarray(x), emu_ops.prepare_weight(w), db, defines, kind="fp4"
        ).numpy()
        want, mag = _reference(x, wf, bias)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 1e-5 * mag.max(), f"T={t} {rows}x{cols}"
        # and it is a product of x and W, within FP4's rounding of x
        assert (
            np.corrcoef(got.ravel(), (x @ wf.T + (0 if bias is None else bias)).ravel())[0, 1]
            > 0.95
        )


def test_only_nvfp4_weights_in_whole_steps_take_it(emu_ops):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((20, 160)).astype(np.float32)
    calls = []
    real = emu_ops.gemm

    def spy(*args, **kw):
        calls.append(args[5] if len(args) > 5 else kw.get("kind"))
        return real(*args, **kw)

    emu_ops.gemm = spy
    try:
        for fmt, cols in (("nvfp4", 128), ("nvfp4", 160), ("q4_0", 128)):
            w, _ = random_weight(fmt, 40, cols, rng)
            emu_ops.linear(emu_ops.asarray(x[:, :cols]), emu_ops.prepare_weight(w))
    finally:
        del emu_ops.gemm
    assert calls == ["fp4", "fast", "fast"]


def test_devices_without_the_fp4_mma_take_the_fast_kernel(tmp_path):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    ops = NativeOps(FakeDevice(tmp_path, broken=False), weight_dtype="f32", prefill="fp4")
    choice = ops.gemm_choice("fp4")  # an "sm_90" device
    assert choice.kernel == "none" and "no block-scaled FP4 MMA" in choice.reason
    assert (
        ops._prefill_gemm(
            ops.prepare_weight(random_weight("nvfp4", 8, 128, np.random.default_rng(1))[0])
        )[0]
        == "fast"
    )


@pytest.mark.parametrize("broken", [False, True])
def test_the_fp4_kernel_is_checked_on_an_fp4_device(tmp_path, broken):
    """On an sm_121a device the first W4A4 GEMM runs the MMA build (here the emulator's,
    made wrong by one output element when `broken`) against its portable build; a mismatch
    sends NVFP4 weights to the fast kernel, not to the slow portable one."""
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    device = FakeDevice(tmp_path, broken)
    device.target = "sm_121a"
    ops = NativeOps(device, weight_dtype="f32", prefill="fp4")
    w = ops.prepare_weight(random_weight("nvfp4", 8, 128, np.random.default_rng(1))[0])
    kind, defines = ops._prefill_gemm(w)
    choice = ops.gemm_choice("fp4")
    assert gemm_check.verdict_path(ops.rt, "fp4").exists()
    if broken:
        # (this fake device breaks every tensor-core build, so "fast" runs portable here)
        assert choice.kernel == "portable" and kind == "fast"
    else:
        assert choice.kernel == "tensor-core" and (kind, defines) == ("fp4", None)
