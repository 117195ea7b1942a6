"""The prefill products of Q4_K/Q5_K on AMX tiles (cpu_amx.py).

What runs everywhere: the row codes rebuild gguf's dequantized rows, the two int8 planes are
the decode path's rounding, and the choice (ATLAS_CPU_AMX=0, a CPU without AMX, a failed
self-check) falls back to the int16 products. Where the CPU has AMX: the products against a
numpy model of the same arithmetic (x in two int8 planes per 256 columns, the weights exact)
to float32 rounding, with offsets against float64 within the rounding of x, and the compiled
kernel holds the tile instructions.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from atlas_cli.backend.loaders import quant
from atlas_cli.backend.ops.cpu import amx as cpu_amx
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu import kernels as cpu_kernels
from atlas_cli.backend.ops.cpu import prefill as cpu_prefill
from tests.test_cpu_fast import packed, random_blocks, rel_err

TYPES = cpu_amx.AMX_TYPES
IDS = [quant.GGML_TYPES[t].name for t in TYPES]
needs_amx = pytest.mark.skipif(not cpu_amx.checked(), reason="this CPU has no (working) AMX")


def planes_model(x: np.ndarray) -> np.ndarray:
    """numpy's version of quantize_planes per 256 columns, as the float64 values it stands for."""
    n_tok, cols = x.shape
    g = x.reshape(n_tok, cols // 256, 256).astype(np.float32)
    d = (np.abs(g).max(axis=2) / np.float32(127.0))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    hi = np.clip(np.rint(g * inv), -127, 127)
    lo = np.clip(np.rint((g - hi * d) * inv * np.float32(256.0)), -127, 127)
    unit = (d / np.float32(256.0)).astype(np.float64)
    return ((256 * hi + lo) * unit).reshape(n_tok, cols)


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
def test_row_codes_rebuild_the_dequantized_row(type_id):
    rng = np.random.default_rng(type_id)
    rows, cols = 3, 512
    blocks = random_blocks(type_id, rows, cols, rng)
    want = quant.dequantize(blocks, type_id, (rows, cols))
    for r in range(rows):
        wc = np.zeros(cols, np.int8)
        ws, wm = np.zeros(cols // 32, np.float32), np.zeros(cols // 32, np.float32)
        cpu_amx._row_codes(type_id, blocks.reshape(-1), r * blocks.shape[1], 2, wc, ws, wm)
        got = np.repeat(ws, 32) * wc.astype(np.float32) + np.repeat(wm, 32)
        assert wc.min() >= 0 and wc.max() < (16 if type_id == cpu_amx.Q4_K else 32)
        np.testing.assert_allclose(got, want[r], rtol=1e-6, atol=1e-9)


def test_the_two_planes_are_the_decode_paths_rounding():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 256)) * rng.uniform(1e-3, 100, (3, 1))).astype(np.float32)
    x[1, 40:72] = 0.0  # an all-zero group
    xh, xl = (np.zeros(x.shape, np.int8) for _ in range(2))
    xd = np.zeros((3, 8), np.float32)
    cpu_amx.quantize_planes(x, 32, xh, xl, xd)
    for t in range(3):
        xq, xf = np.zeros(512, np.int8), np.zeros(cpu_kernels.XF * 8, np.float32)
        cpu_kernels.quantize_x(x[t], xq, xf)
        np.testing.assert_array_equal(xh[t], xq[:256])
        np.testing.assert_array_equal(xl[t], xq[256:])
        np.testing.assert_array_equal(xd[t], xf[:8])


@needs_amx
@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
@pytest.mark.parametrize("n_tok", [5, 21])
def test_amx_products_match_their_model(type_id, n_tok, monkeypatch):
    rng = np.random.default_rng(type_id * 100 + n_tok)
    rows, cols = 42, 768  # rows: two tasks and a partial one; tokens: partial tiles
    blocks = random_blocks(type_id, rows, cols, rng)
    no_offsets = blocks.copy()
    no_offsets.reshape(rows, -1, quant.GGML_TYPES[type_id].block_bytes)[:, :, 2:4] = 0  # dmin
    perm = rng.permutation(rows).astype(np.int64)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    x[:, 7] = 25.0  # an outlier in one super-block
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "int8")
    monkeypatch.delenv(cpu_amx.AMX_ENV, raising=False)
    exact = quant.dequantize(no_offsets, type_id, (rows, cols))[perm].astype(np.float64)
    got = cpu_fast.linear(x, packed(type_id, no_offsets, perm))
    assert rel_err(got, planes_model(x) @ exact.T) < 2e-6
    dense = quant.dequantize(blocks, type_id, (rows, cols))[perm].astype(np.float64)
    assert rel_err(cpu_fast.linear(x, packed(type_id, blocks, perm)), x @ dense.T) < 1e-3


@needs_amx
def test_the_kernel_holds_the_tile_instructions():
    """On a copy compiled here (numba cannot show the assembly of cached code)."""
    kernel = numba.njit(parallel=True, fastmath=True)(cpu_amx.gemm_amx.py_func)
    blocks = cpu_amx.random_rows(cpu_amx.Q4_K, 16, 256, np.random.default_rng(0)).reshape(-1)
    x = np.ones((3, 256), np.float32)
    kernel(cpu_amx.Q4_K, blocks, 0, 144, 1, np.arange(16), x, np.empty((3, 16), np.float32))
    asm = "\n".join(kernel.inspect_asm().values())
    for op in ("ldtilecfg", "tileloadd", "tdpbssd", "tilestored", "tilerelease"):
        assert op in asm, op


def _linear_int16(type_id, blocks, perm, x) -> np.ndarray:
    w = packed(type_id, blocks, perm)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    cpu_prefill.gemm_int16(*w.kernel_args, w.perm, x, out)
    return out


@pytest.mark.parametrize("why", ["env", "no amx", "disagrees"])
def test_without_amx_the_int16_products_run(why, monkeypatch, capsys):
    rng = np.random.default_rng(3)
    blocks = random_blocks(cpu_amx.Q4_K, 32, 512, rng)
    perm = np.arange(32, dtype=np.int64)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "int8")
    checked = cpu_amx.checked
    monkeypatch.setattr(cpu_amx, "checked", pytest.fail)  # must not be reached with "env"
    if why == "env":
        monkeypatch.setenv(cpu_amx.AMX_ENV, "0")
    else:
        monkeypatch.delenv(cpu_amx.AMX_ENV, raising=False)
        monkeypatch.setattr(cpu_amx, "checked", checked.__wrapped__)  # not the cached answer
        monkeypatch.setattr(cpu_amx, "_host_has_amx", lambda: why != "no amx")
        monkeypatch.setattr(cpu_amx, "_request_permission", lambda: True)
        monkeypatch.setattr(cpu_amx, "agrees_with_int16", lambda t: False)
    assert not cpu_amx.ready()
    got = cpu_fast.linear(x, packed(cpu_amx.Q4_K, blocks, perm))
    np.testing.assert_array_equal(got, _linear_int16(cpu_amx.Q4_K, blocks, perm, x))
    said = capsys.readouterr().err
    assert ("disagree" in said) == (why == "disagrees")


def test_a_cpu_forced_to_avx2_never_reaches_the_tiles(monkeypatch):
    monkeypatch.setenv("ATLAS_CPU_ISA", "avx2")
    assert not cpu_amx._host_has_amx()
