"""ATLAS_LM_HEAD: an untied float lm_head requantized at load to Q8_0 or NVFP4 on a native
device (backend/requantize.py): the quantizers against the references (gguf's dequantizer,
the E4M3 table), the device model's head in the new format, its logits close to the stored
head's, and a bad value as a one-line error."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend import load
from atlas_cli.backend.loaders import quant
from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.backend.requantize import e4m3_codes, requantize
from tests.gpu.checks import E4M3, e4m3_encode_ref
from tests.test_gemm_fast_models import log_softmax
from tests.test_native_qwen35 import FIXTURES


def test_q8_0_is_llama_cpps_and_round_trips():
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    q = requantize(w, "q8_0")
    back = quant.dequantize(q.blocks, q.type_id, q.shape)  # gguf's own dequantizer
    step = np.abs(w).reshape(6, 3, 32).max(-1, keepdims=True) / 127
    assert (np.abs(back - w).reshape(6, 3, 32) <= step * 0.5 + 1e-3 * step).all()


def test_nvfp4_scales_are_the_nearest_e4m3_codes():
    x = np.abs(np.random.default_rng(1).standard_normal(4000)).astype(np.float32) * 50
    x[:4] = [0.0, 448.0, 1e4, E4M3[37]]
    np.testing.assert_array_equal(e4m3_codes(x), e4m3_encode_ref(x))
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    back = requantize(w, "nvfp4").dequantize()
    blockmax = np.abs(w).reshape(4, 4, 16).max(-1, keepdims=True)
    assert (np.abs(back - w).reshape(4, 4, 16) <= blockmax / 6 + 1e-6).all()


@pytest.mark.parametrize("fmt", ["q8_0", "nvfp4"])
def test_the_device_model_takes_the_requantized_head(monkeypatch, fmt):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native import device

    path = FIXTURES / "qwen3-gqa4-f16"  # an untied f16 lm_head
    prompt = np.random.default_rng(3).integers(3, 60, 24)
    monkeypatch.setenv("ATLAS_PREFILL", "exact")
    monkeypatch.delenv("ATLAS_LM_HEAD", raising=False)
    stored = load(path, device="emu", ops=device.open_device("emu")).engine
    monkeypatch.setenv("ATLAS_LM_HEAD", fmt)
    ops = device.open_device("emu")
    requantized = load(path, device="emu", ops=ops).engine
    assert requantized.model.w["lm_head.weight"].fmt == fmt
    assert stored.model.w["lm_head.weight"].fmt == "f16"
    want = np.asarray(stored.logits(prompt))
    got = np.asarray(requantized.logits(prompt))
    # then the fused decode step (its lm_head GEMV in the new format), fed the same tokens
    feed = [int(t) for t in np.random.default_rng(4).integers(3, 60, 6)]
    want = np.concatenate([want, [np.asarray(stored.step(t)) for t in feed]])
    got = np.concatenate([got, [np.asarray(requantized.step(t)) for t in feed]])
    lp, lq = log_softmax(want), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    assert 0 < kl.mean() < (1e-4 if fmt == "q8_0" else 2e-2), kl.mean()
    assert kl[-len(feed) :].max() < (1e-3 if fmt == "q8_0" else 1e-1), kl[-len(feed) :]


def test_a_bad_value_is_one_line(monkeypatch):
    from atlas_cli.backend.ops.native import device
    from atlas_cli.errors import UsageError

    monkeypatch.setenv("ATLAS_LM_HEAD", "fp8")
    with pytest.raises(UsageError, match="ATLAS_LM_HEAD must be stored, q8_0, nvfp4, got 'fp8'"):
        device.lm_head_format()
