"""GGUF loading: metadata, name mapping, Q/K un-permutation, header cache and bad files."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from atlas_cli.backend.loaders import gguf as loader
from atlas_cli.errors import CorruptModelError, UnsupportedModelError
from atlas_cli.session import open_model


def write_tiny_gguf(path: Path, arch: str = "llama", qtype=gguf.GGMLQuantizationType.F32):
    """A one-block model with random weights; `qtype` for the 2-D weights."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ff, vocab = 64, 4, 2, 128, 32
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    hd = hidden // heads
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (heads * hd, hidden),
        "blk.0.attn_k.weight": (kv_heads * hd, hidden),
        "blk.0.attn_v.weight": (kv_heads * hd, hidden),
        "blk.0.attn_output.weight": (hidden, heads * hd),
        "blk.0.ffn_gate.weight": (ff, hidden),
        "blk.0.ffn_up.weight": (ff, hidden),
        "blk.0.ffn_down.weight": (hidden, ff),
    }
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_config(smollm2_path, tmp_path):
    gf = loader.open_gguf(smollm2_path, cache_dir=tmp_path)
    config = loader.config_from_metadata(gf.metadata, set(gf.tensors))
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert gf.tensors["token_embd.weight"].shape == (49152, 576)
    assert gf.metadata["tokenizer.ggml.model"] == "gpt2"


def test_header_cache_round_trip(smollm2_path, tmp_path):
    first = loader.open_gguf(smollm2_path, cache_dir=tmp_path)
    assert list(tmp_path.glob("gguf-*.json")), "header cache not written"
    second = loader.open_gguf(smollm2_path, cache_dir=tmp_path)
    assert second.tensors == first.tensors
    assert second.metadata == first.metadata


def test_every_tensor_gets_a_hf_name(smollm2_path, tmp_path):
    gf = loader.open_gguf(smollm2_path, cache_dir=tmp_path)
    names = {loader.hf_name(n) for n in gf.tensors}
    assert None not in names
    assert "model.layers.29.mlp.down_proj.weight" in names
    assert "model.embed_tokens.weight" in names


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    n_head, hd, cols = 3, 8, 5
    hf = rng.standard_normal((n_head * hd, cols)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf permute, written from its description
    permuted = hf.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(loader.unpermute_rows(permuted, n_head), hf)
    # the same on quantized rows (bytes): rows move whole
    raw = rng.integers(0, 255, size=(n_head * hd, 20), dtype=np.uint8)
    permuted_raw = raw.reshape(n_head, 2, hd // 2, 20).swapaxes(1, 2).reshape(raw.shape)
    np.testing.assert_array_equal(loader.unpermute_rows(permuted_raw, n_head), raw)


def test_tiny_quantized_model_loads(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    gf = loader.open_gguf(path)
    config = loader.config_from_metadata(gf.metadata, set(gf.tensors))
    weights = loader.load_weights(gf, config)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == np.float32


def test_missing_file(tmp_path):
    with pytest.raises(CorruptModelError, match="no such file"):
        loader.open_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        loader.open_gguf(path)


def test_truncated_file(smollm2_path, tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(smollm2_path.stat().st_size // 2))
    with pytest.raises(CorruptModelError, match="truncated"):
        loader.open_gguf(path)


def test_truncated_file_with_stale_cache(smollm2_path, tmp_path):
    """A header cached from the full file must not hide a later truncation."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, path)
    loader.open_gguf(path, cache_dir=tmp_path / "cache")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(CorruptModelError, match="truncated"):
        loader.open_gguf(path, cache_dir=tmp_path / "cache")


def test_damaged_header(tmp_path):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="cannot parse GGUF header"):
        loader.open_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        open_model(str(path), device="cpu-ref")


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", qtype=gguf.GGMLQuantizationType.MXFP4)
    with pytest.raises(UnsupportedModelError, match=r"GGML type 39 \(MXFP4\)"):
        open_model(str(path), device="cpu-ref")


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_tiny_model_in_a_newer_format_loads(tmp_path, qtype):
    """What once refused a file (token_embd.weight has GGML type 6) reads it."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType[qtype])
    gf = loader.open_gguf(path)
    config = loader.config_from_metadata(gf.metadata, set(gf.tensors))
    weights = loader.load_weights(gf, config)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    want = gguf.quants.dequantize(reader.data, reader.tensor_type)
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], want)
