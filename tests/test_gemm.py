"""The prefill GEMM (kernels/gemm.cu) on the CPU emulator against numpy, every format, T = 9..600
and odd shapes; and the first-use self-check of the tensor-core kernel (ops/native/gemm_check.py),
decided on a fake "cuda" runtime that runs the emulator (one whose tensor-core kernel is made
wrong, one whose is right)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import gemm_check, runtime_emu
from tests.emu import emu_native_ops
from tests.gpu.checks import E2M1, E4M3, FORMATS, PLAIN, col_step, random_weight, rel_err
from tests.test_gemm_sass import WEIGHT_PARTS


def _cols(fmt: str, base: int) -> int:
    step = col_step(fmt)
    return max(step, -(-base // step) * step)


@pytest.fixture(scope="module")
def emu_ops():
    return emu_native_ops(weight_dtype="f32", prefill="exact")


# (tokens, rows, cols before rounding to the format's block): edge tiles in every dimension,
# one step (64 columns) partly filled, 600 tokens = 10 token tiles
SHAPES = [(9, 70, 96), (64, 64, 64), (65, 1, 32), (131, 67, 160), (600, 37, 288)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_matches_numpy(emu_ops, fmt):
    rng = np.random.default_rng(FORMATS.index(fmt))
    for t, rows, base in SHAPES:
        cols = _cols(fmt, base)
        w, wf = random_weight(fmt, rows, cols, rng)
        x = rng.standard_normal((t, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32) if t % 2 else None
        dev_b = None if bias is None else emu_ops.asarray(bias)
        got = emu_ops.linear(emu_ops.asarray(x), emu_ops.prepare_weight(w), dev_b)
        err = rel_err(got, ref.linear(x, wf, bias))
        assert err < 2e-5, f"gemm {fmt} T={t} {rows}x{cols}: {err:.2e}"


@pytest.mark.parametrize("fmt", PLAIN)
def test_gemm_partial_units_and_unaligned_x(emu_ops, fmt):
    """Rows whose length is not a multiple of 32 (the element-wise weight path) and an x whose
    rows are not 16-byte aligned (the scalar x path)."""
    rng = np.random.default_rng(3)
    for t, cols in ((9, 8), (70, 48), (33, 100), (17, 131)):
        w, wf = random_weight(fmt, 37, cols, rng)
        x = rng.standard_normal((t + 1, cols)).astype(np.float32)
        dev_x = emu_ops.asarray(x)[1:]  # one row in: 4 * cols bytes past an aligned start
        got = emu_ops.linear(dev_x, emu_ops.prepare_weight(w))
        assert rel_err(got, ref.linear(x[1:], wf)) < 2e-5, f"gemm {fmt} T={t} 37x{cols}"


def _moved(ops, buf, nbytes: int, shift: int) -> SimpleNamespace:
    raw = np.empty(nbytes, np.uint8)
    ops.rt.d2h(raw, buf)
    moved = ops._upload_bytes(np.concatenate([np.zeros(shift, np.uint8), raw]))
    return SimpleNamespace(ptr=moved.ptr + shift, keep=moved)


@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32", "nvfp4"])
def test_gemm_misaligned_weights_take_the_byte_path(emu_ops, fmt):
    """The 16-byte weight loads need an aligned row; a weight that is not falls back to
    quant.cuh's decoders, with the same result."""
    rng = np.random.default_rng(11)
    w, wf = random_weight(fmt, 45, 128, rng)
    x = rng.standard_normal((20, 128)).astype(np.float32)
    dw = emu_ops.prepare_weight(w)
    want = emu_ops.linear(emu_ops.asarray(x), dw).numpy()
    moved = {"data": _moved(emu_ops, dw.data, dw.rows * dw.row_bytes, 2)}
    got = emu_ops.linear(emu_ops.asarray(x), type(dw)(**{**vars(dw), **moved})).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert rel_err(got, x @ wf.T) < 2e-5


def test_gemm_keeps_float32_accuracy_where_bf16_would_not(emu_ops):
    """The operands are split into bf16 high and low parts: a plain bf16 product of these
    would be off by ~1e-3 of the output's scale; the kernel is within 2e-5."""
    rng = np.random.default_rng(5)
    w, wf = random_weight("f32", 64, 512, rng)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    got = emu_ops.linear(emu_ops.asarray(x), emu_ops.prepare_weight(w))
    want = ref.linear(x, wf)
    round_bf16 = ref.linear(_bf16(x), _bf16(wf))
    assert rel_err(round_bf16, want) > 5e-4  # what one bf16 MMA per tile would give
    assert rel_err(got, want) < 2e-5


def _split(v: np.ndarray) -> list[np.ndarray]:
    """gemm.cu's gm_split in numpy: float32 -> three truncated bf16 parts, v = p0 + p1 + p2."""
    top = 0xFFFF0000

    def trunc(a):
        return (a.view(np.uint32) & top).view(np.float32)

    p0 = trunc(v)
    r = v - p0
    p1 = trunc(r)
    return [p0, p1, r - p1]


def test_the_weight_parts_are_exact_for_every_value_of_their_format():
    """gemm.cu multiplies 1 or 2 bf16 parts of these formats' weights: exhaustively, every
    value they dequantize to is that many parts exactly (NVFP4 without its global scale, which
    the epilogue applies; Q4_0 and Q5_0 as f16 scale x (code - 8 or - 16)); and any float32 is
    three."""
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    f16 = f16[np.isfinite(f16)]
    values = {
        "bf16": (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32),
        "nvfp4": (E2M1[:, None] * E4M3[None, :]).ravel(),
        "f16": f16,
        "q4_0": (f16[:, None] * np.arange(-8, 8, dtype=np.float32)[None, :]).ravel(),
        "q5_0": (f16[:, None] * np.arange(-16, 16, dtype=np.float32)[None, :]).ravel(),
    }
    assert set(values) == set(WEIGHT_PARTS)
    for fmt, v in values.items():
        v = v[np.isfinite(v)]
        parts = _split(v)
        for p in parts[WEIGHT_PARTS[fmt] :]:
            assert not p.any(), f"{fmt}: a value needs more than {WEIGHT_PARTS[fmt]} parts"
    rng = np.random.default_rng(8)
    v = (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-100, 100, 1 << 16))).astype(
        np.float32
    )
    p0, p1, p2 = _split(v)
    assert np.array_equal(_split(p2)[1], np.zeros_like(v))  # p2 is a bf16
    assert np.array_equal(p0.astype(np.float64) + p1 + p2, v.astype(np.float64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_is_as_accurate_as_float32_numpy(emu_ops, fmt):
    """Against the float64 product, the GEMM is within what float32 numpy gives (x in three
    bf16 parts keeps all 24 bits); two parts of x (16 bits) would be ~1e-5 off."""
    rng = np.random.default_rng(40 + FORMATS.index(fmt))
    w, wf = random_weight(fmt, 64, 512, rng)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    got = emu_ops.linear(emu_ops.asarray(x), emu_ops.prepare_weight(w))
    exact = x.astype(np.float64) @ wf.astype(np.float64).T
    p0, p1, _ = _split(x)
    assert rel_err((p0 + p1).astype(np.float64) @ wf.astype(np.float64).T, exact) > 4e-6
    assert rel_err(got, exact) < max(1e-6, 2 * rel_err(x @ wf.T, exact)), fmt


def _bf16(a: np.ndarray) -> np.ndarray:
    from atlas_cli.backend.ops.native.array import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(a))


# ---- the first-use self-check ----------------------------------------------------------------


class FakeDevice(runtime_emu.EmuRuntime):
    """The emulator presenting itself as a CUDA device. Both builds of gemm.cu are the
    portable code here, so `broken` makes the tensor-core build wrong: after each of its
    launches one output element is off by 1."""

    name = "cuda"
    target = "sm_90"
    toolchain = "fake-nvrtc"

    def __init__(self, cache_dir: Path, broken: bool):
        super().__init__(cache_dir)
        self.broken = broken
        self.gemm_launches: list[bool] = []  # per gemm launch: was it the portable build?
        self._portable: set[int] = set()

    def compile(self, file: str, defines: dict | None = None):
        if file == "gemv_mma.cu" and defines is None:  # a CUDA device's: the fragment code
            defines = {"ATLAS_EMU_MMA": 1}
        mod = super().compile(file, defines)
        if file in gemm_check.FILES.values() and defines == gemm_check.PORTABLE:
            self._portable.add(id(mod.lib))
        return mod

    def launch(self, fn, grid, block, args) -> None:
        super().launch(fn, grid, block, args)
        if fn.name.startswith("gemm_") and not fn.name.startswith("gemm_x_"):
            portable = id(fn.lib) in self._portable
            self.gemm_launches.append(portable)
            if self.broken and not portable:
                # y's argument: after W, S, gs, x (fast: xb, ld; fp4: xq, xs, xg), bias
                out = 7 if fn.name.startswith("gemm_fp4_") else 6 if "fast" in fn.name else 5
                ctypes.c_float.from_address(args[out].value).value += 1.0


def _device_ops(tmp_path: Path, broken: bool):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    return NativeOps(FakeDevice(tmp_path, broken), weight_dtype="f32", prefill="exact")


def _prefill(ops) -> np.ndarray:
    rng = np.random.default_rng(2)
    w, wf = random_weight("bf16", 40, 96, rng)
    x = rng.standard_normal((12, 96)).astype(np.float32)
    got = ops.linear(ops.asarray(x), ops.prepare_weight(w)).numpy()
    return rel_err(got, ref.linear(x, wf))


@pytest.mark.slow  # about 3 minutes on two cores: two emulator builds of the whole GEMM
def test_a_wrong_tensor_core_kernel_falls_back_to_the_portable_one(tmp_path):
    ops = _device_ops(tmp_path, broken=True)
    assert _prefill(ops) < 2e-5  # the first GEMM checked, found the mismatch, ran portable
    choice = ops.gemm_choice()
    assert choice.kernel == "portable" and choice.defines == gemm_check.PORTABLE
    assert "disagreed with the portable one on random bf16 data" in choice.reason
    # the check ran both builds on its first case, then every GEMM took the portable one
    assert ops.rt.gemm_launches[:2] == [False, True] and ops.rt.gemm_launches[2:] == [True]
    verdict = gemm_check.verdict_path(ops.rt, "exact")
    assert verdict.parent == tmp_path and verdict.exists()

    again = _device_ops(tmp_path, broken=True)  # a new process: the cached verdict, no check
    assert _prefill(again) < 2e-5 and again.rt.gemm_launches == [True]
    info = again.warmup()
    assert info["gemm"] == {"kind": "exact", "kernel": "portable", "reason": choice.reason}


def test_a_right_tensor_core_kernel_is_used_and_the_verdict_keyed_like_the_cache(tmp_path):
    ops = _device_ops(tmp_path, broken=False)
    assert _prefill(ops) < 2e-5
    choice = ops.gemm_choice()
    assert choice.kernel == "tensor-core" and choice.defines is None
    assert choice.reason.startswith("self-check passed (max difference ")
    n_checked = 2 * len(gemm_check.CASES)
    assert ops.rt.gemm_launches == [False, True] * len(gemm_check.CASES) + [False]
    assert len(ops.rt.gemm_launches) == n_checked + 1

    other = FakeDevice(tmp_path, broken=False)
    other.toolchain = "fake-nvrtc-2"  # a new toolchain: a new key, checked again
    assert gemm_check.verdict_path(other, "exact") != gemm_check.verdict_path(ops.rt, "exact")


def test_a_torn_verdict_is_checked_again(tmp_path):
    ops = _device_ops(tmp_path, broken=False)
    path = gemm_check.verdict_path(ops.rt, "exact")
    path.write_text('{"ok": tr')
    assert ops.gemm_choice().kernel == "tensor-core"
    assert ops.rt.gemm_launches  # it ran the check rather than trusting the file


def test_the_emulator_runs_the_portable_path_without_a_check(emu_ops):
    choice = gemm_check.choose(emu_ops, "exact")
    assert (choice.kernel, choice.defines) == ("portable", None)
    assert "emu runtime" in choice.reason


def test_atlas_hw_says_which_gemm_runs(tmp_path, monkeypatch):
    """`atlas hw` prints the verdict of a real check (on the fake device whose tensor-core
    kernel is wrong) under the device's kernel report."""
    from typer.testing import CliRunner

    from atlas_cli.backend.ops.native import device as native
    from atlas_cli.backend.ops.native import runtime as rt
    from atlas_cli.cli import app

    ops = _device_ops(tmp_path, broken=True)
    choice, verify = ops.gemm_choice(), ops.gemm_choice("verify")
    stats = rt.CompileStats()
    for file in rt.KERNEL_FILES:
        stats.record(file, 0.01, True, "sm_90")

    def kernel_report(device):
        info = {"runtime": device, "device": "fake", "target": "sm_90", **stats.summary()}
        return {**info, "gemm": choice.report(), "verify": verify.report()}

    monkeypatch.setattr(native, "probe", lambda d: {"runtime": d, "available": d == "cuda"})
    monkeypatch.setattr(native, "kernel_report", kernel_report)
    r = CliRunner().invoke(app, ["hw"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if "prefill gemm" in x)
    want = "  prefill gemm (exact): portable kernel, the tensor-core kernel disagreed"
    assert line.startswith(want)
    line = next(x for x in r.stdout.splitlines() if "verify gemv" in x)
    assert line.startswith("  verify gemv: tensor-core kernel, self-check passed"), line
