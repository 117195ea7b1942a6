"""Bit-exactness of atlas's numpy dequantizers against the reference ``gguf.quants``."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from atlas_cli.backend.loaders.quant import (
    GGML_TYPES,
    UnsupportedQuantError,
    dequantize,
    dequantize_blocks,
)

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
BLOCK_TYPES += ["IQ4_NL", "IQ4_XS"]
ROW_COUNTS = [1, 3, 17, 64]

# Byte offsets of the f16 scale fields (d, dmin, m) inside one block of each block type.
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}

TYPE_IDS = {qt.name: tid for tid, qt in GGML_TYPES.items()}


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def _random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random block bytes [rows, bytes_per_row] with finite, reasonable f16 scale fields."""
    qt = GGML_TYPES[TYPE_IDS[name]]
    rng = np.random.default_rng(seed)
    n = rows * blocks_per_row
    blocks = rng.integers(0, 256, size=(n, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        # Mixed signs and magnitudes, including exact zeros and subnormals, never inf/NaN.
        scale = rng.standard_normal(n) * np.exp(rng.uniform(-12.0, 2.0, n))
        scale[:: max(1, n // 7)] = 0.0
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, blocks_per_row * qt.block_bytes)


def _check(data: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    ref = ref_dequantize(data, _qtype(name))
    ours = dequantize(data, TYPE_IDS[name], shape)
    assert ours.dtype == np.float32
    assert ours.shape == shape
    np.testing.assert_array_equal(ours, ref.reshape(shape))
    # assert_array_equal treats -0.0 == 0.0 and NaN == NaN; compare the bits as well.
    np.testing.assert_array_equal(ours.view(np.uint32), ref.reshape(shape).view(np.uint32))
    return ours


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_random_blocks_exact(name: str, rows: int) -> None:
    qt = GGML_TYPES[TYPE_IDS[name]]
    blocks_per_row = 3 if qt.block_elems == 256 else 5
    data = _random_blocks(name, rows, blocks_per_row, seed=rows * 101 + TYPE_IDS[name])
    _check(data, name, (rows, blocks_per_row * qt.block_elems))


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16"])
def test_quantized_floats_exact(name: str, rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 160)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    data = ref_quantize(x, _qtype(name))
    _check(data, name, x.shape)
    # Sanity: the round trip is close to the input, so the test data is meaningful.
    err = np.abs(dequantize(data, TYPE_IDS[name], x.shape) - x)
    frac = {"Q4_0": 0.15, "Q4_1": 0.1, "Q5_0": 0.07, "Q5_1": 0.05, "Q8_0": 0.01, "BF16": 0.005}
    frac = frac[name]
    assert np.all(err <= frac * np.abs(x).max(axis=1, keepdims=True))


# f16 scale fields gguf reads like any other: infinities, NaNs (a quiet and a signalling
# payload), the largest finite value, the smallest subnormal and both zeros.
EXTREME_F16 = np.array(
    [0x7C00, 0xFC00, 0x7E00, 0xFD55, 0x7BFF, 0xFBFF, 0x0001, 0x8000, 0x0000], dtype=np.uint16
)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_extreme_scales_exact(name: str) -> None:
    """inf * 0, inf - inf and NaN payloads come out with gguf's bits: the same float
    operations on the same operands, in the same order."""
    qt = GGML_TYPES[TYPE_IDS[name]]
    rng = np.random.default_rng(TYPE_IDS[name])
    n = 4 * len(EXTREME_F16) ** 2  # every pair of (d, m) values, several times
    blocks = rng.integers(0, 256, size=(n, qt.block_bytes), dtype=np.uint8)
    for k, off in enumerate(F16_FIELDS[name]):
        values = EXTREME_F16[(np.arange(n) // len(EXTREME_F16) ** k) % len(EXTREME_F16)]
        blocks[:, off : off + 2] = values.view(np.uint8).reshape(n, 2)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = _check(blocks.reshape(1, -1), name, (1, n * qt.block_elems))
    assert np.isnan(ours).any() and np.isinf(ours).any() and (ours == 0).any()


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_float_types_exact(rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    _check(x, "F32", x.shape)
    _check(x.astype(np.float16), "F16", x.shape)
    # F32 and F16 given as raw bytes, the way a hand-rolled reader might hand them over.
    np.testing.assert_array_equal(dequantize(x.view(np.uint8), 0, x.shape), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(dequantize(h.view(np.uint8), 1, x.shape), h.astype(np.float32))


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_bf16_random_bits_exact(rows: int) -> None:
    """All 16-bit patterns are valid BF16 input, NaNs and infs included; bits must survive."""
    rng = np.random.default_rng(rows)
    raw = rng.integers(0, 1 << 16, size=(rows, 64), dtype=np.uint16)
    _check(raw.view(np.uint8), "BF16", raw.shape)
    # The uint16 array itself (not its bytes) is accepted too.
    ours = dequantize(raw, TYPE_IDS["BF16"], raw.shape)
    expected = raw.astype(np.uint32) << 16
    np.testing.assert_array_equal(ours.view(np.uint32), expected)


@pytest.mark.parametrize("name", BLOCK_TYPES + ["F16", "BF16"])
def test_dequantize_blocks_matches_reference(name: str) -> None:
    qt = GGML_TYPES[TYPE_IDS[name]]
    if name in F16_FIELDS:
        blocks = _random_blocks(name, 7, 1, seed=7)
    else:
        x = np.random.default_rng(7).standard_normal(7).astype(np.float32)
        blocks = ref_quantize(x, _qtype(name)).view(np.uint8).reshape(7, qt.block_bytes)
    out = dequantize_blocks(blocks, TYPE_IDS[name])
    assert out.shape == (7, qt.block_elems)
    assert out.dtype == np.float32
    ref = ref_dequantize(blocks.reshape(1, -1), _qtype(name)).reshape(7, qt.block_elems)
    np.testing.assert_array_equal(out, ref)
    # A row range of blocks dequantizes to the same row range of values.
    np.testing.assert_array_equal(dequantize_blocks(blocks[2:5], TYPE_IDS[name]), ref[2:5])


def test_multidim_and_flat_input() -> None:
    data = _random_blocks("Q4_K", 6, 2, seed=3)  # 6 rows x 512 columns
    ref = ref_dequantize(data, _qtype("Q4_K"))
    np.testing.assert_array_equal(dequantize(data.reshape(-1), 12, (6, 512)), ref)
    np.testing.assert_array_equal(dequantize(data, 12, (2, 3, 512)), ref.reshape(2, 3, 512))


def test_large_tensor_chunking() -> None:
    """More blocks than one internal chunk: the chunk seams must not show."""
    data = _random_blocks("Q8_0", 1000, 18, seed=11)  # 1000 x 576
    _check(data, "Q8_0", (1000, 576))


@pytest.mark.parametrize(("type_id", "name"), [(9, "Q8_1"), (16, "IQ2_XXS"), (99, "unknown")])
def test_unsupported_type(type_id: int, name: str) -> None:
    data = np.zeros((1, 256), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantError, match=name) as exc:
        dequantize(data, type_id, (1, 256))
    assert f"id {type_id}" in str(exc.value)
    assert "Q4_K" in str(exc.value)  # lists the supported types
    assert isinstance(exc.value, ValueError)
    with pytest.raises(UnsupportedQuantError, match=name):
        dequantize_blocks(data, type_id)


def test_partial_block_rejected() -> None:
    data = np.zeros(34 * 3 + 5, dtype=np.uint8)
    with pytest.raises(ValueError, match="not a whole number of 34-byte blocks"):
        dequantize(data, 8, (1, 96))
    with pytest.raises(ValueError, match="not a whole number"):
        dequantize_blocks(data, 8)


def test_shape_mismatch_rejected() -> None:
    data = np.zeros((2, 2 * 18), dtype=np.uint8)  # 2 rows x 64 Q4_0 values
    with pytest.raises(ValueError, match="needs"):
        dequantize(data, 2, (3, 64))
    with pytest.raises(ValueError, match="columns"):
        dequantize(data, 2, (4, 48))


def test_real_smollm2_tensors(smollm2_path: Path) -> None:
    reader = gguf.GGUFReader(smollm2_path)
    picked: dict[str, list[gguf.ReaderTensor]] = {"Q4_1": [], "Q8_0": [], "F32": []}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in picked and len(picked[kind]) < 3:
            picked[kind].append(t)
    for kind, tensors in picked.items():
        assert tensors, f"no {kind} tensor in {smollm2_path.name}"
        for t in tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            ours = dequantize(t.data, int(t.tensor_type), shape)
            ref = ref_dequantize(t.data, t.tensor_type)
            np.testing.assert_array_equal(ours, ref.reshape(shape), err_msg=t.name)
            if t.name == "token_embd.weight":
                assert shape == (49152, 576)
