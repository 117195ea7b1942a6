"""NaN and Inf in weights: refused at load with the tensor named (loaders/finite.py)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend import formats
from atlas_cli.backend.loaders import finite, quant
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.errors import CorruptModelError
from tests.model_mutations import FIXTURES, load_and_run, read_gguf, write_gguf

# GGUF types of the fixtures: bytes per block and where its float16 scale is (llama.cpp's
# ggml-common.h), written down here rather than read from formats.py, which is under test
F32, Q4_0, Q8_0 = 0, 2, 8
BLOCKS = {Q4_0: (18, 0), Q8_0: (34, 0)}


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    """Header caches of damaged files go to a home of their own; the compiled kernels stay the
    suite's (compiling them again takes minutes)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(jit.kernel_cache_dir()))
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "home"))


def gguf_with_value(tmp_path: Path, fixture: str, tensor: str, index: int, value: float) -> Path:
    """The fixture with element `index` of an F32 tensor, or the scale of block `index` of a
    quantized one, set to `value`."""
    kvs, tensors, data, total = read_gguf(FIXTURES / fixture / "model.gguf")
    _, type_id, _, offset = next(t for t in tensors if t[0] == tensor)
    data = bytearray(data)
    if type_id == F32:
        data[offset + 4 * index : offset + 4 * index + 4] = struct.pack("<f", value)
    else:
        block_bytes, scale_at = BLOCKS[type_id]
        at = offset + index * block_bytes + scale_at
        data[at : at + 2] = np.float16(value).tobytes()
    path = tmp_path / "model.gguf"
    write_gguf(path, kvs, tensors, bytes(data), total)
    return path


def safetensors_with_bytes(tmp_path: Path, fixture: str, tensor: str, index: int, raw: bytes):
    """A copy of the fixture directory with element `index` of `tensor` (its checkpoint name)
    replaced by the bytes `raw`."""
    model = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, model, ignore=shutil.ignore_patterns("*.npz"))
    for shard in model.glob("*.safetensors"):
        blob = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + n])
        if tensor in header:
            at = 8 + n + header[tensor]["data_offsets"][0] + index * len(raw)
            blob[at : at + len(raw)] = raw
            shard.write_bytes(bytes(blob))
            return model
    raise AssertionError(f"{fixture} has no tensor {tensor}")


# -- refused at load ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "tensor", "index", "value", "message"),
    [
        ("qwen3-gguf", "blk.0.attn_norm.weight", 3, np.nan, "holds NaN or Inf at element 3"),
        ("qwen3-gguf", "output_norm.weight", 0, -np.inf, "holds NaN or Inf at element 0"),
        ("qwen3-gguf", "blk.1.attn_k.weight", 2, np.inf, "NaN or Inf scale in block 2"),
        ("qwen3-gguf", "blk.0.ffn_up.weight", 5, -np.inf, "NaN or Inf scale in block 5"),
        ("qwen35-gguf", "blk.0.ssm_out.weight", 0, np.nan, "NaN or Inf scale in block 0"),
        ("qwen35-gguf", "blk.2.ssm_a", 1, 0.5, r"holds a value >= 0 \(expected ssm_a"),
    ],
)
def test_gguf_nonfinite_weights_are_refused_at_load(tmp_path, fixture, tensor, index, value,
                                                    message):  # fmt: skip
    path = gguf_with_value(tmp_path, fixture, tensor, index, value)
    with pytest.raises(CorruptModelError, match=f"model.gguf: tensor {tensor} .*{message}"):
        load_and_run(path)


def test_gguf_nan_norm_is_refused_before_the_fast_kernels_run(tmp_path):
    """The fuzzer's case: a NaN norm weight on --device cpu reached a softmax whose sum was 0."""
    path = gguf_with_value(tmp_path, "qwen3-gguf", "blk.0.attn_norm.weight", 0, np.nan)
    with pytest.raises(CorruptModelError, match="attn_norm.weight holds NaN or Inf"):
        load_and_run(path, device="cpu")


LAYER0 = "model.language_model.layers.0."
NVFP4_UP = LAYER0 + "mlp.up_proj."


@pytest.mark.parametrize(
    ("fixture", "tensor", "index", "raw"),
    [
        ("qwen3-mha-f32", "model.layers.0.self_attn.q_proj.weight", 7, struct.pack("<f", np.nan)),
        ("qwen3-gqa4-f16", "model.norm.weight", 0, np.float16(np.inf).tobytes()),
        ("qwen35-text-bf16", "model.layers.0.linear_attn.A_log", 1, b"\xc0\x7f"),  # bf16 NaN
        ("qwen35-nvfp4", NVFP4_UP + "weight_scale", 9, b"\x7f"),  # E4M3 NaN
        ("qwen35-nvfp4", NVFP4_UP + "weight_scale_2", 0, struct.pack("<f", np.inf)),
        ("qwen35-nvfp4", "model.language_model.layers.1.mlp.down_proj.weight", 4, b"\xff"),  # FP8
    ],
)
def test_safetensors_nonfinite_weights_are_refused_at_load(tmp_path, fixture, tensor, index, raw):
    model = safetensors_with_bytes(tmp_path, fixture, tensor, index, raw)
    name = tensor.replace("model.language_model.", "model.")
    with pytest.raises(CorruptModelError, match=rf"tensor {name} holds NaN or Inf at element"):
        load_and_run(model)


def test_every_quantized_format_names_its_float16_scales():
    """Each scale offset is one the dequantizer multiplies by: a NaN written there makes that
    block NaN, and no other."""
    rng = np.random.default_rng(0)
    for fmt in formats.GGML.values():
        if not fmt.quantized:
            assert fmt.f16_scales == ()
            continue
        assert fmt.f16_scales, fmt.name
        for offset in fmt.f16_scales:
            blocks = rng.integers(0, 256, (3, fmt.block_bytes), dtype=np.uint8)
            for b in range(3):  # small finite scales everywhere
                for at in fmt.f16_scales:
                    blocks[b, at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            blocks[1, offset : offset + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
            values = quant.dequantize_blocks(blocks, fmt.ggml_type)
            assert np.isnan(values[1]).any() and np.isfinite(values[[0, 2]]).all(), fmt.name
            with pytest.raises(CorruptModelError, match="NaN or Inf scale in block 1"):
                finite.check_block_scales("f", "t", blocks, fmt)


def test_the_check_finds_the_first_bad_element_past_a_chunk(monkeypatch):
    monkeypatch.setattr(finite, "CHUNK", 1000)
    values = np.ones(5000, np.float32)
    finite.check_values("f", "t", values, "F32")
    values[[2500, 4000]] = [np.inf, np.nan]
    with pytest.raises(CorruptModelError, match="at element 2,500"):
        finite.check_values("f", "t", values, "F32")
    assert finite.first_all_ones(values.view(np.uint32)[3000:], 0x7F80_0000) == 1000
