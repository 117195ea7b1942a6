"""benchmarks/gemv_model.py, the static model of the decode GEMV: occupancy from registers, the
two regimes of its formula, its fit to the H200's figures, and (slow half) the facts it reads
from the compiled kernels."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "gemv_model.py"
_spec = importlib.util.spec_from_file_location("gemv_model", _path)
gm = importlib.util.module_from_spec(_spec)
sys.modules["gemv_model"] = gm  # its dataclasses look their module up
_spec.loader.exec_module(gm)

H200 = gm.DEVICES["H200"]


def test_warps_follow_registers_and_shared_memory():
    k = gm.Kernel
    assert gm.warps_per_sm(k("q4_k", 128, 0, 4), H200) == 16  # two 256-thread blocks
    assert gm.warps_per_sm(k("q5_k", 168, 0, 4), H200) == 8
    assert gm.warps_per_sm(k("q4_k", 64, 0, 4), H200) == 32
    assert gm.warps_per_sm(k("q4_k", 64, 100 * 1024, 4), H200) == 16  # two blocks' memory


def test_the_regimes():
    k = gm.Kernel
    # issue-bound with many warps: twice the instructions, half the rate
    a = gm.fraction(k("q4_0", 32, 0, 4.0), H200, eta=0.5)
    b = gm.fraction(k("q4_0", 32, 0, 8.0), H200, eta=0.5)
    assert 1.8 < a / b < 2.05
    # latency-bound with few warps: half the warps, about half the rate
    slow = H200.__class__(**{**H200.__dict__, "latency_ns": 20000})
    c = gm.fraction(k("q4_0", 255, 0, 1.0), slow, eta=1.0)  # 8 warps
    d = gm.fraction(k("q4_0", 128, 0, 1.0), slow, eta=1.0)  # 16
    assert 1.8 < d / c < 2.05
    assert gm.fraction(k("bf16", 128, 0, 2.0), H200, eta=1.0) == 1.0  # capped at the copy rate


def test_the_fit_to_the_h200():
    eta, fits = gm.calibrate()
    assert 0.3 < eta < 0.9
    assert len(fits) == len(gm.CALIBRATION)
    assert all(abs(math.log(pred / meas)) < math.log(1.35) for _, pred, meas in fits), fits


@pytest.mark.slow  # compiles gemv.cu through NVRTC and reads its SASS
def test_facts_from_the_compiled_code():
    from tests.test_kernels_sass import FAST_PATHS

    kernels = gm.compiled_kernels("sm_90")
    assert [k.fmt for k in kernels] == [f for f, _, _ in FAST_PATHS]
    for k, (_, _, bound) in zip(kernels, FAST_PATHS, strict=True):
        assert 32 < k.registers <= 255 and k.per_weight <= bound, k


@pytest.mark.slow  # compiles gemv.cu with NVRTC and reads its SASS
def test_gpu_bench_prints_the_prediction_beside_the_measurement(tmp_path):
    """scripts/gpu_bench.py's gemv section ends with the model's fraction per format for the
    device it runs on (an H100 here, by name), computed from the code compiled for its target;
    a device the model does not know gets none."""
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_bench

    def bench(name: str):
        rt = SimpleNamespace(device_name=name, target="sm_90a")
        return SimpleNamespace(ops=SimpleNamespace(rt=rt), size={"gemv": 16384})

    predicted = gpu_bench.gemv_predictions(bench("NVIDIA H100 80GB HBM3"))
    if not predicted:
        pytest.skip("NVRTC or cuobjdump not installed")
    assert set(predicted) >= {"nvfp4", "q4_k", "bf16"}
    assert all(0 < f <= 1 for f in predicted.values()), predicted
    assert predicted["bf16"] >= predicted["q4_k"]  # fewer instructions per byte
    assert gpu_bench.gemv_predictions(bench("NVIDIA A100-SXM4-80GB")) == {}
