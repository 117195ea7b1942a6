"""The fast CPU path's prefill products on int16 (cpu_prefill.py, cpu_ir_int16.py).

Per K-quant format, against a numpy model of the same arithmetic (x rounded per token and 256
columns to int16, the weights as gguf's dequantizer gives them) to float32 rounding, on blocks
without the offset term (Q4_K/Q5_K's dmin zeroed: that term is computed on the unrounded x);
with it, against float64 on the unrounded x within the rounding of x; and
`ATLAS_CPU_ACTIVATIONS=float32` keeps the float32 tiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.loaders import quant
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu import ir_int8 as cpu_ir_int8
from atlas_cli.backend.ops.cpu import prefill as cpu_prefill
from tests.test_cpu_fast import packed, random_blocks, rel_err
from tests.test_cpu_int8 import _isas_to_check, run_under_isa

TYPES = cpu_prefill.INT16_TYPES
IDS = [quant.GGML_TYPES[t].name for t in TYPES]


def rounded_x(x: np.ndarray) -> np.ndarray:
    """numpy's version of cpu_prefill.quantize_x16, as the float64 values it stands for."""
    n_tok, cols = x.shape
    g = x.reshape(n_tok, cols // 256, 256).astype(np.float32)
    d = np.abs(g).max(axis=2) / np.float32(cpu_prefill.X16_MAX)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(g * inv[..., None])
    assert np.abs(q).max() <= cpu_prefill.X16_MAX
    return (q * d[..., None].astype(np.float64)).reshape(n_tok, cols)


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
@pytest.mark.parametrize("n_tok", [5, 10])
def test_int16_prefill_matches_its_model(type_id, n_tok, monkeypatch):
    rng = np.random.default_rng(type_id * 100 + n_tok)
    rows, cols = 42, 768  # rows: two tasks and a partial tile; tokens: a partial tile
    blocks = random_blocks(type_id, rows, cols, rng)
    no_offsets = blocks.copy()
    if type_id != cpu_prefill.Q6_K:  # dmin: bytes 2-3 of each block
        nbytes = quant.GGML_TYPES[type_id].block_bytes
        no_offsets.reshape(rows, -1, nbytes)[:, :, 2:4] = 0
    perm = rng.permutation(rows).astype(np.int64)
    w = packed(type_id, blocks, perm)
    dense = quant.dequantize(blocks, type_id, (rows, cols))[perm].astype(np.float64)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    x[:, 7] = 25.0  # an outlier in one super-block
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "int8")
    monkeypatch.setenv("ATLAS_CPU_AMX", "0")  # Q4_K/Q5_K's AMX products: tests/test_cpu_amx.py
    exact = quant.dequantize(no_offsets, type_id, (rows, cols))[perm].astype(np.float64)
    got = cpu_fast.linear(x, packed(type_id, no_offsets, perm))
    assert rel_err(got, rounded_x(x) @ exact.T) < 2e-6
    want = x.astype(np.float64) @ dense.T
    assert rel_err(cpu_fast.linear(x, w), want) < 1e-3
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "float32")
    assert rel_err(cpu_fast.linear(x, w), want) < 1e-5


def test_int16_tile_sums_cannot_overflow():
    """The largest |weight integer| (Q6_K: 128 * 32) times X16_MAX, 16 products per int32 lane
    per super-block (8 pmaddwd steps of 2), stays below 2^31."""
    assert 16 * 128 * 32 * cpu_prefill.X16_MAX < 2**31


@pytest.mark.slow
@pytest.mark.parametrize("isa", _isas_to_check())
def test_every_instruction_set_gives_the_same_products(isa):
    assert isa != cpu_ir_int8.ISA
    run_under_isa(isa, __file__, "matches_its_model", 6)
