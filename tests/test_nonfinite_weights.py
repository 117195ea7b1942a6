"""NaN and Inf in weights: refused at load with the tensor named (loaders/finite.py), and where
one gets past the load (the computation makes it), the fast CPU kernels carry it to the logits,
which the engine reports as a damaged model, instead of raising inside numba ("SystemError:
CPUDispatcher(<function attention>) returned a result with an exception set")."""

from __future__ import annotations

import json
import os
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

NAN_LOGITS = "the model produced NaN or Inf logits"
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


def test_a_gguf_file_found_finite_is_not_checked_again(tmp_path, monkeypatch):
    """The check reads a page of every block's scales: once per file (path, size, mtime)."""
    path = gguf_with_value(tmp_path, "qwen3-gguf", "output_norm.weight", 0, 1.0)
    checked = []
    real_check = finite.check_gguf_tensor
    monkeypatch.setattr(
        finite, "check_gguf_tensor", lambda *args: checked.append(args[1]) or real_check(*args)
    )
    load_and_run(path)
    assert "output_norm.weight" in checked
    checked.clear()
    load_and_run(path)
    assert checked == []
    damaged = gguf_with_value(tmp_path, "qwen3-gguf", "output_norm.weight", 0, np.nan)
    os.utime(damaged, ns=(0, path.stat().st_mtime_ns + 10**9))  # a new file: a new mtime
    with pytest.raises(CorruptModelError, match="output_norm.weight holds NaN"):
        load_and_run(damaged)


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


# -- what gets past the load reaches the logits --------------------------------------------------


@pytest.fixture
def without_the_load_check(monkeypatch):
    monkeypatch.setattr(finite, "check_gguf_tensor", lambda *args: None)


@pytest.mark.parametrize("fixture", ["qwen3-gguf", "qwen35-gguf"])
@pytest.mark.parametrize("prompt", ["Hello there", [5]], ids=["prefill", "one-token decode"])
def test_nan_activations_end_in_nan_logits_on_the_fast_path(tmp_path, without_the_load_check,
                                                            fixture, prompt):  # fmt: skip
    from atlas_cli.backend.sample import SamplingOverrides
    from atlas_cli.session import open_model

    path = gguf_with_value(tmp_path, fixture, "blk.0.attn_norm.weight", 0, np.nan)
    model = open_model(str(path), device="cpu")
    with pytest.raises(CorruptModelError, match=NAN_LOGITS):
        for _ in model.generate(prompt, max_tokens=2, sampling=SamplingOverrides(0.0)):
            pass


def test_softmax_of_nonfinite_scores_is_nan():
    from atlas_cli.backend.ops.cpu import kernels

    for bad in ([np.nan, 1.0, 2.0], [np.inf, 1.0, 2.0], [-np.inf] * 3, [np.nan] * 3):
        row = np.array(bad + [0.5] * 30, np.float32)  # past the 16-lane maximum too
        kernels.softmax_row(row, row.size)
        assert np.isnan(row).all(), bad
    row = np.linspace(-3, 3, 37, dtype=np.float32)
    expected = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    kernels.softmax_row(row, row.size)
    np.testing.assert_allclose(row, expected, rtol=1e-5)


def test_attention_over_nan_queries_is_nan_for_those_heads():
    from atlas_cli.backend.ops.cpu import fast

    rng = np.random.default_rng(1)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 5, 16)).astype(np.float32)
    v = rng.standard_normal((2, 5, 16)).astype(np.float32)
    q[2, 1, 3] = np.nan
    out = fast.attention(q, k, v, 0)
    assert np.isnan(out[2, 1]).all()
    assert np.isfinite(np.delete(out.reshape(-1, 16), 2 * 4 + 1, axis=0)).all()


def test_int8_rounding_keeps_nan_and_inf():
    """A NaN activation rounds to int8 garbage; its group's scale is NaN instead, so every
    product with it is NaN."""
    from atlas_cli.backend.ops.cpu import kernels

    x = np.linspace(-1, 1, 128, dtype=np.float32)
    xq, xf = np.empty(256, np.int8), np.empty(128 // 32 * kernels.XF, np.float32)
    kernels.quantize_x(x, xq, xf)
    assert np.isfinite(xf).all()
    x[40], x[100] = np.nan, np.inf  # groups 1 and 3
    kernels.quantize_x(x, xq, xf)
    assert np.isnan(xf[[1, 3]]).all() and np.isfinite(xf[[0, 2]]).all()


def test_norms_of_a_zero_row_with_zero_eps_do_not_raise():
    from atlas_cli.backend.ops.cpu import decode, rows

    x, w = np.zeros((8, 16), np.float32), np.ones(16, np.float32)
    out = np.empty_like(x)
    rows.rms_norm_rows(x, w, 0.0, out)
    rows.l2norm_rows(x, 0.0, out)
    rows.rms_norm_gated_rows(x, x, w, 0.0, out)
    decode.rms_norm_into(x[0], w, 0.0, out[0])
    assert not np.isfinite(out[0]).any()
