"""Each kernel against its numpy reference on the GPU (see checks.py for what each covers), at
larger sizes than the CPU emulator runs, with fresh random inputs every run."""

from __future__ import annotations

import numpy as np
import pytest

from . import checks


@pytest.mark.parametrize("name", list(checks.ALL_CHECKS))
def test_kernel_matches_reference(gpu_ops, name):
    seed = np.random.SeedSequence().entropy  # fresh inputs; printed on failure
    rng = np.random.default_rng(seed)
    try:
        checks.ALL_CHECKS[name](gpu_ops, rng, scale=4)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (seed {seed})") from None
    gpu_ops.rt.synchronize()


@pytest.mark.parametrize("fmt", checks.FORMATS)
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte", "fallback"])
def test_fused_gemv_matches_reference(gpu_ops, fmt, aligned):
    """The fused decode step's GEMV, every body (decode.cu dgemv_<fmt>)."""
    seed = np.random.SeedSequence().entropy
    try:
        checks.check_fused_gemv(gpu_ops, np.random.default_rng(seed), fmt, aligned)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (seed {seed})") from None


def test_portable_fp8_decode_matches_hardware_path(gpu_ops):
    """The guarded sm_89+ conversion and its portable fallback agree on all 256 codes."""
    np.testing.assert_array_equal(gpu_ops.fp8_decode(np.arange(256, dtype=np.uint8)), checks.E4M3)


def test_graph_capture_replays_a_decode_like_sequence(gpu_ops):
    rng = np.random.default_rng(0)
    x = gpu_ops.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    w, wf = checks.random_weight("q4_k", 512, 256, rng)
    dw = gpu_ops.prepare_weight(w)
    gpu_ops.poison = False  # buffers made during capture must not launch fills
    try:
        out = gpu_ops.linear(x, dw)  # compile outside the capture
        spare = gpu_ops.linear(x, dw)
        del spare  # the pool now holds a free block of this size for the captured launch
        with gpu_ops.rt.capture() as graph:
            y = gpu_ops.linear(x, dw)
        gpu_ops.rt.synchronize()
        graph.replay()
        gpu_ops.rt.synchronize()
        np.testing.assert_allclose(y.numpy(), out.numpy(), rtol=1e-6, atol=1e-6)
    finally:
        gpu_ops.poison = True


def test_compile_report_names_every_kernel_file(gpu_device):
    from atlas_cli.backend.ops.native import device as native
    from atlas_cli.backend.ops.native import runtime

    info = native.kernel_report(gpu_device)
    assert set(info["kernels"]) == set(runtime.KERNEL_FILES)
    again = native.kernel_report(gpu_device)
    assert again["cache_hits"] == len(runtime.KERNEL_FILES)  # the second time, all from disk
