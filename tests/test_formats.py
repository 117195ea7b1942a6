"""The weight-format registry (backend/formats.py) is the one statement of each format's facts:
the kernels' header, the numpy dequantizers, the fast CPU path and the native launchers agree
with it."""

from __future__ import annotations

import re
from pathlib import Path

import gguf as gguf_package
import numpy as np
import pytest

import atlas_cli.backend.formats as formats
from atlas_cli.backend.loaders import gguf, quant
from atlas_cli.backend.loaders.safetensors import FP8Tensor, NVFP4Tensor
from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import ir as cpu_ir
from atlas_cli.backend.ops.cpu import kernels as cpu_kernels
from atlas_cli.backend.ops.cpu import packed as cpu_packed
from atlas_cli.backend.ops.native import runtime
from atlas_cli.session import open_model
from tests.model_mutations import read_gguf, write_gguf

HEADER = (runtime.kernels_dir() / "quant.cuh").read_text()


def _defines(prefix: str) -> dict[str, int]:
    return {
        m.group(1).lower(): int(m.group(2))
        for m in re.finditer(rf"^#define {prefix}(\w+) (\d+)$", HEADER, re.M)
    }


def test_header_formats_are_the_native_formats():
    native = {f.kernel for f in formats.FORMATS.values() if f.native}
    ids = _defines("FMT_")
    assert set(ids) == native
    assert sorted(ids.values()) == list(range(len(ids)))  # dense: a template parameter each
    body = HEADER[HEADER.index("#define ATLAS_FOR_EACH_FORMAT(X)") :].split("\n\n")[0]
    listed = dict(re.findall(r"X\((\w+), FMT_(\w+)\)", body))
    assert listed == {k: k.upper() for k in native}


def test_header_block_sizes_match_the_registry():
    elems, nbytes = _defines("BLOCK_ELEMS_"), _defines("BLOCK_BYTES_")
    for f in formats.FORMATS.values():
        if f.native:
            assert (elems[f.kernel], nbytes[f.kernel]) == (f.block_elems, f.block_bytes), f.name
    split = {f.kernel: f.device_split[1] for f in formats.FORMATS.values() if f.device_split}
    assert _defines("SCALE_BYTES_") == split


def test_split_blocks_moves_each_blocks_scales_to_the_second_buffer():
    rng = np.random.default_rng(1)
    for f in formats.FORMATS.values():
        if f.device_split is None:
            continue
        rows = rng.integers(0, 256, (3, 2 * f.block_bytes), dtype=np.uint8)
        codes, scales = formats.split_blocks(f, rows)
        if f.device_repack is not None:  # the bit layout first (Q5_0, Q5_1), then the split
            rows = f.device_repack(rows.reshape(3, 2, -1)).reshape(3, -1)
        code_bytes, scale_bytes = f.device_block_bytes
        assert codes.shape == (3, 2 * code_bytes) and scales.shape == (3, 2 * scale_bytes)
        assert code_bytes % 16 == 0, f.name  # 16-byte units straight from the row
        off, size = f.device_split
        order = list(f.device_order or range(f.block_bytes))
        assert sorted(order) == list(range(f.block_bytes))  # a permutation
        for b in range(2):
            block = rows[:, b * f.block_bytes : (b + 1) * f.block_bytes][:, order]
            assert (scales[:, b * size : (b + 1) * size] == block[:, off : off + size]).all()
            rest = np.concatenate([block[:, :off], block[:, off + size :]], axis=1)
            assert (codes[:, b * code_bytes : (b + 1) * code_bytes] == rest).all()


def test_every_ggml_format_has_every_kernel():
    for tid, f in formats.GGML.items():
        assert quant.GGML_TYPES[tid] is f
        assert tid in quant._KERNELS, f"no numpy dequantizer for {f.name}"
        if f.cpu:
            assert tid in cpu_kernels.BLOCKS and tid in cpu_ir._EMITTERS
            elems, nbytes = cpu_kernels.BLOCKS[tid]
            assert nbytes * f.block_elems == elems * f.block_bytes  # same bytes per element


def test_registry_ids_and_names_are_unique():
    assert len({f.name for f in formats.FORMATS.values()}) == len(formats.FORMATS)
    assert formats.ggml_type_name(12) == "Q4_K"
    assert formats.ggml_type_name(6) == "Q5_0" and formats.ggml_type_name(999) == "unknown"
    assert not set(formats.GGML) & set(formats.UNSUPPORTED_GGML_NAMES)
    with pytest.raises(AssertionError):
        formats.register(formats.WeightFormat("X", "q4_0", None, 1, 1, cpu=False, native=False))


def test_quantized_weights_share_one_interface():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 34), dtype=np.uint8)
    blocks[:, :2] = np.array([0.01], np.float16).view(np.uint8)
    weights = [
        gguf.QuantizedTensor(8, (2, 32), blocks),
        NVFP4Tensor(rng.integers(0, 256, (2, 16), np.uint8), np.full((2, 2), 0x30, np.uint8), 0.5),
        FP8Tensor(np.full((2, 32), 0x38, np.uint8), np.float32(2.0)),
    ]
    for w in weights:
        assert isinstance(w, formats.QuantizedWeight)
        assert w.format in formats.FORMATS.values()
        dense = w.dequantize()
        assert dense.shape == w.shape and dense.dtype == np.float32
        np.testing.assert_array_equal(numpy_ref.prepare_weight(w), dense)  # the array protocol
    assert weights[0].stored().data is blocks
    with pytest.raises(TypeError, match="dequantize"):
        weights[2].stored()


# ---------------------------------------------------------------------------------------------
# Formats end to end: the tiny Qwen3 GGUF fixture with its quantized tensors in another format

FIXTURE = Path(__file__).parent / "fixtures" / "qwen" / "qwen3-gguf"


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> IQ4_NL blocks (rows, cols / 32 * 18), which gguf cannot make:
    per 32 values d = max|x| / 127 and each code the nearest of d * IQ4_VALUES."""
    groups = values.reshape(-1, 32)
    d = (np.abs(groups).max(axis=1, keepdims=True) / 127).astype(np.float16)
    grid = d.astype(np.float32)[:, :, None] * quant.IQ4_VALUES
    codes = np.abs(grid - groups[:, :, None]).argmin(axis=2).astype(np.uint8)
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    blocks = np.concatenate([d.view(np.uint8), qs], axis=1)
    return blocks.reshape(values.shape[0], -1)


def requantized_fixture(path: Path, name: str) -> Path:
    """The Qwen3 GGUF fixture (Q8_0 and Q4_0 matrices, F32 norms) written to `path` with every
        block-quantized tensor dequantized and quantized again to `name` (by gguf's quantizer where
    it has one)."""
    kvs, tensors, data, _ = read_gguf(FIXTURE / "model.gguf")
    qtype = gguf_package.GGMLQuantizationType[name]
    out = bytearray()
    for t in tensors:
        _, type_id, dims, offset = t
        fmt, shape = formats.GGML[type_id], tuple(reversed(dims))
        nbytes = int(np.prod(shape)) // fmt.block_elems * fmt.block_bytes
        raw = np.frombuffer(data, np.uint8, nbytes, offset)
        if fmt.quantized:
            values = quant.dequantize(raw, type_id, shape)
            if name == "IQ4_NL":
                raw = quantize_iq4_nl(values)
            else:
                raw = gguf_package.quants.quantize(values, qtype)
            t[1] = int(qtype)
        t[3] = len(out)
        out += raw.tobytes() + b"\0" * (-raw.nbytes % 32)
    target = path / "model.gguf"
    write_gguf(target, kvs, tensors, bytes(out), len(out))
    return target


def _logits(model, ref) -> np.ndarray:
    """The prompt's logits, then 8 decode steps' (the GEMVs on the blocks)."""
    prefill = model.engine.logits(ref["prompt"])
    steps = [model.engine.step(int(t)) for t in ref["decode"][:8]]
    return np.concatenate([prefill, np.stack(steps)])


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "IQ4_NL"])
def test_a_model_in_the_format_runs_on_the_cpu_paths(tmp_path, name, monkeypatch):
    """Loaded on the reference (dequantized at load, as gguf dequantizes) and on the fast CPU
    path (kept in its blocks where the format has CPU kernels, else dequantized at load): the
    same logits, to float32 rounding with float32 activations and to the rounding of x with
    the default int8 ones (a float32 KV cache: the float16 one is held to its own bounds)."""
    fmt = formats.GGML[int(gguf_package.GGMLQuantizationType[name])]
    path = requantized_fixture(tmp_path, name)
    tensors = gguf_package.GGUFReader(path).tensors
    tensor = next(t for t in tensors if t.name == "blk.0.ffn_gate.weight")
    assert tensor.tensor_type.name == name
    ref = np.load(FIXTURE / "reference.npz")
    want = _logits(open_model(str(path), device="cpu-ref"), ref)
    for activations, bound in (("float32", 1e-5), ("int8", 3e-4)):
        monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", activations)
        model = open_model(str(path), device="cpu", kv_dtype="f32")
        gate = model.engine.model.w["model.layers.0.mlp.gate_proj.weight"]
        assert isinstance(gate, cpu_packed.PackedMatrix) == fmt.cpu
        weight = gate.dequantize() if fmt.cpu else gate
        np.testing.assert_array_equal(
            weight, gguf_package.quants.dequantize(tensor.data, tensor.tensor_type)
        )
        got = _logits(model, ref)
        assert np.abs(got - want).max() < bound * np.abs(want).max(), activations
