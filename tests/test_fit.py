"""The fit check: weights + KV cache against memory, refused with numbers and a way out."""

from __future__ import annotations

import pytest

from atlas_cli import fit
from atlas_cli.errors import ModelTooLargeError

GB = 10**9
SMOLLM2 = fit.KVShape(layers=30, kv_heads=3, head_dim=64)


def test_kv_bytes_per_token():
    assert SMOLLM2.bytes_per_token("f32") == 2 * 30 * 3 * 64 * 4
    assert SMOLLM2.bytes_per_token("bf16") == 2 * 30 * 3 * 64 * 2


def test_fits_and_does_not():
    ok = fit.estimate(538_000_000, SMOLLM2, 8192, "f32", 8 * GB, "cpu")
    assert ok.fits
    fit.ensure_fits("smollm2-135m", ok)
    small = fit.estimate(538_000_000, SMOLLM2, 8192, "f32", 1 * GB, "cpu")
    assert not small.fits
    with pytest.raises(ModelTooLargeError) as info:
        fit.ensure_fits("smollm2-135m", small)
    msg = str(info.value)
    assert "smollm2-135m does not fit: it needs 1.2 GB" in msg
    assert "weights 538 MB" in msg and "KV cache 377 MB for 8192 tokens in f32" in msg
    assert "but cpu has 1.0 GB available" in msg
    # the longest context that fits, rounded down to a power of two
    # 1 GB - 538 MB weights - 279 MB overhead leaves room for 3971 tokens: offer 2048
    assert 2048 <= small.max_context() < 4096
    assert "--ctx-size 2048 fits" in msg


def test_weights_alone_too_big_suggests_smaller_variants():
    est = fit.estimate(32 * GB, SMOLLM2, 8192, "bf16", 24 * GB, "cuda")
    with pytest.raises(ModelTooLargeError, match=r"8-bit KV cache.*variant or model \(qwen3-8b:q4"):
        fit.ensure_fits("qwen3-8b:bf16", est, smaller=["qwen3-8b:q4_k_m"])
    assert est.max_context() == 0


def test_shape_from_configs():
    llama = {
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 2048,
    }
    assert fit.shape_from_config(llama) == fit.KVShape(16, 8, 64)
    qwen36 = {
        "text_config": {
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
        }
    }
    shape = fit.shape_from_config(qwen36)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (16, 4, 256)
    assert shape.state_bytes == 48 * 48 * 128 * 128 * 4
    types = ["linear_attention"] * 3 + ["full_attention"]
    cfg = {**qwen36["text_config"], "layer_types": types * 16}
    assert fit.shape_from_config(cfg).layers == 16


def test_load_model_refuses_before_loading(smollm2_path, monkeypatch):
    from atlas_cli import hardware
    from atlas_cli.session import open_model

    monkeypatch.setattr(hardware, "system_memory", lambda: (2 * GB, 1 * GB))
    with pytest.raises(ModelTooLargeError, match=r"does not fit.*--ctx-size \d+ fits"):
        open_model(str(smollm2_path), device="cpu-ref", ctx_size=8192)


def test_refusals_name_smaller_variants_and_models(monkeypatch, tmp_path):
    from atlas_cli import store

    path = tmp_path / "snapshot"
    entry = store.Installed("qwen3-8b", "bf16", "safetensors", "BF16", path, (), 16 * GB, "hub")
    monkeypatch.setattr(store, "installed", lambda: [entry])
    assert store.alternatives(path) == ["qwen3-8b:q4_k_m", "qwen3-4b", "qwen3-1.7b"]
    assert store.alternatives(tmp_path / "other.gguf") == []
