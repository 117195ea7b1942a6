"""Qwen3 and Qwen3.5 against transformers: logits of tiny random checkpoints (bf16/fp16/fp32
safetensors, NVFP4, GGUF), prefill and 32 cached decode steps, within 1e-4 relative.

The checkpoints and the transformers logits are made by scripts/make_qwen_fixtures.py (which
needs torch); these tests need only numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.loaders import safetensors as st
from atlas_cli.session import open_model

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
TOLERANCE = 1e-4  # max |ours - transformers| / max |transformers|

CHECKPOINTS = {
    # name: (model_type we run, stored format)
    "qwen3-tied-bf16": ("qwen3", "bf16"),
    "qwen3-gqa4-f16": ("qwen3", "f16"),
    "qwen3-mha-f32": ("qwen3", "f32"),
    "qwen3-gguf": ("qwen3", "Q8_0"),
    "qwen2-bf16": ("qwen2", "bf16"),
    "qwen2-gguf": ("qwen2", "Q8_0"),
    "qwen35-text-bf16": ("qwen3_5_text", "bf16"),
    "qwen35-vlm-bf16": ("qwen3_5", "bf16"),
    "qwen35-f32": ("qwen3_5_text", "f32"),
    "qwen35-nvfp4": ("qwen3_5", "nvfp4"),
    "qwen35-gguf": ("qwen3_5_text", "Q8_0"),
}


def model_path(name: str) -> Path:
    d = FIXTURES / name
    return d / "model.gguf" if (d / "model.gguf").is_file() else d


def reference(name: str):
    return np.load(FIXTURES / name / "reference.npz")


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def models():
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = open_model(str(model_path(name)), device="cpu-ref")
        return loaded[name]

    return get


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_transformers(models, name):
    ref = reference(name)
    model = models(name)
    model_type, fmt = CHECKPOINTS[name]
    assert model.info.config["model_type"] == model_type
    assert model.info.file_type == fmt
    t = len(ref["prompt"])
    prefill = model.engine.logits(ref["prompt"])
    assert prefill.shape == (t, ref["logits"].shape[1])
    assert rel_err(prefill, ref["logits"][:t]) < TOLERANCE
    steps = np.stack([model.engine.step(int(tok)) for tok in ref["decode"]])
    assert len(steps) == 32
    assert rel_err(steps, ref["logits"][t:]) < TOLERANCE


@pytest.mark.parametrize("name", ["qwen35-text-bf16", "qwen3-tied-bf16"])
def test_prefill_in_pieces(models, name, monkeypatch):
    """A prompt prefilled in several chunks (the GDN state and conv window carried between
    them, and across a 64-token GDN chunk) gives the same logits as transformers."""
    from atlas_cli.backend import engine as engine_mod

    ref = reference(name)
    model = models(name)
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 5)
    model.engine.reset()
    last, cached = model.engine.prefill([int(i) for i in ref["prompt"]])
    t = len(ref["prompt"])
    assert cached == 0
    assert rel_err(last, ref["logits"][t - 1]) < TOLERANCE


def test_qwen35_layer_patterns_and_rotary(models):
    """The fixtures cover the layer patterns and partial rotary factors they claim to."""
    text = models("qwen35-text-bf16").engine.model.args
    vlm = models("qwen35-vlm-bf16").engine.model.args
    f32 = models("qwen35-f32").engine.model.args
    lin, full = "linear_attention", "full_attention"
    assert text.layer_types == (lin, lin, lin, full)  # from full_attention_interval = 4
    assert vlm.layer_types == (lin, full, lin)
    assert f32.layer_types == (full, lin)
    assert (text.partial_rotary_factor, vlm.partial_rotary_factor) == (0.25, 0.5)
    assert f32.partial_rotary_factor == 1.0
    assert vlm.linear_num_value_heads == 2 * vlm.linear_num_key_heads
    assert text.tie_word_embeddings and not vlm.tie_word_embeddings
    gguf_args = models("qwen35-gguf").engine.model.args
    assert gguf_args.layer_types == vlm.layer_types
    assert gguf_args.partial_rotary_factor == 0.5
    assert gguf_args.mtp_num_hidden_layers == 1


# -- safetensors layouts -------------------------------------------------------------------------


def test_vlm_layout_names():
    """`model.language_model.` becomes `model.`, `model.visual.*` is dropped, `mtp.*` stays;
    the tensors come from both shards of the index."""
    d = FIXTURES / "qwen35-vlm-bf16"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    weights = st.load_weights(d)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in weights
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    assert not any(k.startswith(("model.language_model.", "model.visual")) for k in weights)
    assert "mtp.fc.weight" in weights and "mtp.layers.0.self_attn.q_proj.weight" in weights
    expected = {st.hf_name(k) for k in index} - {None}
    assert set(weights) == expected


def test_bf16_widening_is_exact():
    """Reading bf16 by shifting the bits equals the bf16 value; fp16 and fp32 are read as is."""
    bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F7F, 0x8000], np.uint16)
    assert st.bf16_to_f32(bits).tolist() == [1.0, -2.0, 2.0**-133, 3.3895313892515355e38, -0.0]
    from safetensors.numpy import load_file

    d = FIXTURES / "qwen3-gqa4-f16"
    ours = st.load_weights(d)
    for name, value in load_file(d / "model.safetensors").items():
        assert np.array_equal(ours[name], value.astype(np.float32)), name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen3-tied-bf16", "bf16"),
        ("qwen3-gqa4-f16", "f16"),
        ("qwen35-f32", "f32"),
        ("qwen35-vlm-bf16", "bf16"),
        ("qwen35-nvfp4", "nvfp4"),
    ],
)
def test_dominant_dtype(name, expected):
    assert st.dominant_dtype(FIXTURES / name) == expected


def test_corrupt_checkpoints_are_user_errors(tmp_path):
    from atlas_cli.errors import CorruptModelError, UnsupportedModelError

    with pytest.raises(UnsupportedModelError):
        st.load_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(CorruptModelError):
        st.load_weights(tmp_path)
    good = (FIXTURES / "qwen3-mha-f32" / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptModelError, match="truncated"):
        st.load_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CorruptModelError, match="missing"):
        st.load_weights(tmp_path)


# -- NVFP4 ---------------------------------------------------------------------------------------


def _read_raw(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Tensor bytes straight from the file, per the safetensors spec (for the independent
    dequantization below: the `safetensors` numpy API cannot return fp8)."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: (
            v["dtype"],
            tuple(v["shape"]),
            blob[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]],
        )
        for k, v in header.items()
    }


def _e4m3(byte: int) -> float:
    """float8_e4m3fn, from the OCP FP8 spec: s.eeee.mmm, bias 7, subnormals at e = 0."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def _e2m1(code: int) -> float:
    """FP4 E2M1: s.ee.m, bias 1, e = 0 subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def independent_nvfp4(packed: bytes, shape, scale: bytes, scale2: float) -> np.ndarray:
    """W[o, i] = e2m1(nibble) * float32(float32(e4m3 scale[o, i // 16]) * scale_2)."""
    out, half = shape
    q = np.frombuffer(packed, np.uint8).reshape(out, half)
    codes = np.stack([q & 15, q >> 4], axis=-1).reshape(out, 2 * half)
    e2m1 = np.array([_e2m1(c) for c in range(16)], np.float32)
    e4m3 = np.array([_e4m3(b) for b in range(256)], np.float32)
    s = e4m3[np.frombuffer(scale, np.uint8).reshape(out, -1)] * np.float32(scale2)
    return e2m1[codes] * np.repeat(s, 16, axis=1)


def test_nvfp4_dequantization_is_exact():
    d = FIXTURES / "qwen35-nvfp4"
    raw = {}
    for f in d.glob("*.safetensors"):
        raw.update(_read_raw(f))
    weights = st.load_weights(d)
    nvfp4 = {k: v for k, v in weights.items() if isinstance(v, st.NVFP4Tensor)}
    assert len(nvfp4) >= 10
    for name, tensor in nvfp4.items():
        src = "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        base = src[: -len(".weight")]
        dtype, shape, packed = raw[src]
        assert dtype == "U8" and raw[base + ".weight_scale"][0] == "F8_E4M3"
        scale2 = float(np.frombuffer(raw[base + ".weight_scale_2"][2], np.float32)[0])
        expected = independent_nvfp4(packed, shape, raw[base + ".weight_scale"][2], scale2)
        assert np.array_equal(tensor.dequantize(), expected), name
    # and against modelopt's formula run in torch by the fixture script
    ref = reference("qwen35-nvfp4")
    key = "model.language_model.layers.2.linear_attn.in_proj_qkv.weight"
    ours = weights["model.layers.2.linear_attn.in_proj_qkv.weight"].dequantize()
    assert np.array_equal(ours, ref["dequant_" + key])


def test_nvfp4_mixed_precision_is_decided_per_tensor():
    weights = st.load_weights(FIXTURES / "qwen35-nvfp4")
    # excluded modules stay bf16 (read as float32); one MLP weight is FP8 with a tensor scale
    for name in (
        "lm_head.weight",
        "mtp.fc.weight",
        "model.layers.0.linear_attn.in_proj_qkv.weight",
    ):
        assert isinstance(weights[name], np.ndarray) and weights[name].dtype == np.float32, name
    assert isinstance(weights["model.layers.0.mlp.up_proj.weight"], st.NVFP4Tensor)
    fp8 = weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(fp8, st.FP8Tensor)
    key = "dequant_model.language_model.layers.1.mlp.down_proj.weight"
    assert np.array_equal(fp8.dequantize(), reference("qwen35-nvfp4")[key])
    # the scale tensors are consumed, not left behind as weights
    assert not any(k.endswith(("weight_scale", "weight_scale_2", "input_scale")) for k in weights)


def test_e4m3_table_matches_spec():
    expected = np.array([_e4m3(b) for b in range(256)], np.float32)
    assert np.array_equal(st.E4M3_VALUES, expected, equal_nan=True)
    assert st.E4M3_VALUES[0x7E] == 448.0 and st.E4M3_VALUES[0x01] == 2.0**-9


# -- GGUF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-gguf", "qwen35-gguf"])
def test_gguf_dequantization_matches_gguf_package(name):
    import gguf as gguf_pkg

    from atlas_cli.backend.loaders import gguf, quant

    path = model_path(name)
    gf = gguf.open_gguf(path)
    reader = gguf_pkg.GGUFReader(path)
    types = set()
    for t in reader.tensors:
        info = gf.tensors[t.name]
        ours = quant.dequantize(gf.raw(t.name), info.type_id, info.shape)
        theirs = gguf_pkg.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        assert np.array_equal(ours, theirs), t.name
        types.add(quant.GGML_TYPES[info.type_id].name)
    assert "Q8_0" in types and "F32" in types


def test_gguf_qwen35_undoes_llama_cpp_layout():
    """Our weights from the GGUF equal the safetensors ones it was written from: exactly for
    the F32 tensors, within Q8_0 error for quantized ones. A wrong value-head order, a missed
    w + 1 or -exp(A_log) would be far off."""
    from atlas_cli.backend.loaders import gguf

    gf = gguf.open_gguf(model_path("qwen35-gguf"))
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    ours = gguf.load_weights(gf, config)
    source = st.load_weights(FIXTURES / "qwen35-vlm-bf16")
    assert set(ours) == set(source) - {"model.visual.patch_embed.proj.weight"}
    for name, theirs in source.items():
        if name not in ours:
            continue
        w = ours[name]
        assert w.shape == theirs.shape, name
        info = gf.tensors[next(k for k in gf.tensors if gguf.hf_name(k, 3) == name)]
        if info.type_id == 0:  # F32: only the float32 arithmetic of w + 1 - 1 and log(exp)
            assert np.allclose(w, theirs, rtol=1e-6, atol=1e-6), name
        else:
            assert rel_err(w, theirs) < 1e-2, name
    assert config["mtp_num_hidden_layers"] == 1 and config["num_hidden_layers"] == 3


def test_gguf_qwen3_has_no_qk_permutation():
    """llama.cpp permutes Q/K rows only for the llama arch: qwen3 rows are as in HF."""
    from atlas_cli.backend.loaders import gguf

    gf = gguf.open_gguf(model_path("qwen3-gguf"))
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    ours = gguf.load_weights(gf, config)
    source = st.load_weights(FIXTURES / "qwen3-gqa4-f16")
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert rel_err(ours[name], source[name]) < 1e-2
    assert config["head_dim"] == 8 and config["num_key_value_heads"] == 1


def test_gguf_keep_quantized_rows():
    """With keep_quantized, value-head rows are reordered as whole Q8_0 rows; dequantizing
    later gives the same weights."""
    from atlas_cli.backend.loaders import gguf

    gf = gguf.open_gguf(model_path("qwen35-gguf"))
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    packed = gguf.load_weights(gf, config, keep_quantized=True)
    plain = gguf.load_weights(gf, config)
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    assert isinstance(packed[name], gguf.QuantizedTensor)
    for k, v in packed.items():
        w = v.dequantize() if hasattr(v, "dequantize") else v
        assert np.array_equal(w, plain[k]), k


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file by hand (the numpy API cannot write fp8)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_fp8_weights_with_tensor_row_and_block_scales(tmp_path):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaNs
    values = np.array([[_e4m3(int(b)) for b in row] for row in codes], np.float32)
    tensor = np.float32(0.5)
    rows = rng.random((4, 1), dtype=np.float32)
    blocks = rng.random((2, 2), dtype=np.float32)  # 2x3 tiles (the last may be partial)
    f32 = lambda a: np.ascontiguousarray(a, np.float32).tobytes()  # noqa: E731
    _write_safetensors(
        tmp_path / "model.safetensors",
        {
            "a.weight": ("F8_E4M3", (4, 6), codes.tobytes()),
            "a.weight_scale": ("F32", (), f32(tensor)),
            "b.weight": ("F8_E4M3", (4, 6), codes.tobytes()),
            "b.weight_scale": ("F32", (4, 1), f32(rows)),
            "c.weight": ("F8_E4M3", (4, 6), codes.tobytes()),
            "c.weight_scale_inv": ("F32", (2, 2), f32(blocks)),
            "norm.weight": ("BF16", (2,), np.array([0x3F80, 0x4000], np.uint16).tobytes()),
        },
    )
    weights = st.load_weights(tmp_path)
    assert set(weights) == {"a.weight", "b.weight", "c.weight", "norm.weight"}
    assert np.array_equal(weights["a.weight"].dequantize(), values * tensor)
    assert np.array_equal(weights["b.weight"].dequantize(), values * rows)
    tiles = np.repeat(np.repeat(blocks, 2, axis=0), 3, axis=1)
    assert np.array_equal(weights["c.weight"].dequantize(), values * tiles)
    assert weights["norm.weight"].tolist() == [1.0, 2.0]
    assert st.dominant_dtype(tmp_path) == "fp8"


def test_gguf_qwen35_reads_the_per_layer_flags():
    """llama.cpp writes `qwen35.attention.recurrent_layers` (one bool per block, MTP last);
    an irregular pattern must win over `full_attention_interval`."""
    from atlas_cli.backend.loaders import gguf
    from atlas_cli.errors import CorruptModelError

    gf = gguf.open_gguf(model_path("qwen35-gguf"))
    metadata = dict(gf.metadata)
    layers = gguf.config_from_metadata(metadata, set(gf.tensors))["num_hidden_layers"]
    flags = [i != 0 for i in range(layers)] + [False]  # layer 0 full attention, the rest linear
    metadata["qwen35.attention.recurrent_layers"] = flags
    config = gguf.config_from_metadata(metadata, set(gf.tensors))
    assert config["layer_types"][0] == "full_attention"
    assert set(config["layer_types"][1:]) == {"linear_attention"}
    metadata["qwen35.attention.recurrent_layers"] = flags[:1]
    with pytest.raises(CorruptModelError, match="recurrent_layers"):
        gguf.config_from_metadata(metadata, set(gf.tensors))
