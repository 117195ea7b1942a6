"""Whole-model parity on the GPU: tiny random checkpoints of every model type the backend
supports (Llama, Qwen3, qwen3_5), logits and greedy decoding against
the numpy backend; and the real default model (SmolLM2 Q4_1 GGUF) when it is available."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend import MODEL_CLASSES
from atlas_cli.backend.sample import SamplingOverrides

from . import models

TINY_TYPES = sorted({"llama", "qwen3", "qwen3_5"} & set(MODEL_CLASSES))


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_tiny_model_matches_numpy(gpu_ops, model_type, kv_dtype):
    if kv_dtype == "fp8":
        pytest.skip("FP8 KV needs calibrated scales; covered per kernel in test_kernels_gpu")
    models.check_model(gpu_ops, model_type, np.random.default_rng(), kv_dtype=kv_dtype)


def test_default_model_greedy_matches_numpy(gpu_device, smollm2_path):
    """SmolLM2-135M Q4_1: the France prompt, greedy, on the GPU and on the numpy reference."""
    from atlas_cli.session import open_model

    ref = open_model(str(smollm2_path), device="cpu-ref")
    dev = open_model(str(smollm2_path), device=gpu_device)
    ids = ref.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    want = ref.logits(ids)
    got = dev.logits(ids)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < 3e-2, f"logits relative error {err:.2e}"
    text = "".join(
        e.text for e in dev.generate(ids, max_tokens=12, sampling=SamplingOverrides(temperature=0))
    )
    assert "Paris" in text, text
