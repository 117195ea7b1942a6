"""The fused decode step's GEMV (kernels/decode.cu dgemv_<fmt>, built by
ops/native_decoder.dgemv) for every weight format on the CPU emulator, against numpy: each of
its bodies (no prologue, x times a vector, RMSNorm; the SwiGLU pair), stacked matrices, rows
that leave the last block part empty, rows whose last tiles are partial (the 16-byte path
reads the row's last unit there, against zeros of x), and the fallback for an x that is not
16-byte aligned."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from atlas_cli.backend.ops import native_decoder as nd
from atlas_cli.backend.ops import runtime_emu
from tests.gpu.checks import FORMATS, random_weight

EPS = 1e-6
# x is staged 8,192 columns at a time (decode.cu DG_CHUNK_TILES): two chunks, the second with
# a partial last iteration (2 x 32 units per iteration of a single-row body, 32 units of the
# SwiGLU pair's). K-quants: whole 256-element blocks.
COLS = {"q4_k": 9472, "q5_k": 9472, "q6_k": 9472}
DEFAULT_COLS = 8192 + 1024 + 96


@pytest.fixture(scope="module")
def emu_rt():
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    return runtime_emu.EmuRuntime(cache)


def _run(ops, launches) -> None:
    for launch in launches:
        ops._launch(launch.file, launch.name, launch.grid, launch.block, launch.args)


def _check(got, xp: np.ndarray, w: np.ndarray, want: np.ndarray, what: str) -> None:
    """`got` against `want` (float64), relative to the sum of |x' w| of each row (one wrong
    weight of ~9,000 would be ~1e-4 of it)."""
    scale = np.abs(w).astype(np.float64) @ np.abs(xp).astype(np.float64)
    err = np.max(np.abs(np.asarray(got, np.float64) - want) / scale)
    assert err < 1e-6, f"{what}: {err:.2e} of the sum of |x w|"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte", "fallback"])
def test_every_body_matches_numpy(emu_rt, fmt, aligned):
    """Every body on the 16-byte path, and on the fallback (x 4 bytes off 16-byte alignment)."""
    from atlas_cli.backend.ops.native import NativeOps

    ops = NativeOps(emu_rt, weight_dtype="f32" if fmt == "f32" else "bf16")
    ops.poison = True  # an output row the kernel forgets is NaN
    rng = np.random.default_rng(3)
    cols = COLS.get(fmt, DEFAULT_COLS)
    (w1, f1), (w2, f2), (w3, f3) = (random_weight(fmt, n, cols, rng) for n in (21, 16, 21))
    d1, d2, d3 = (ops.prepare_weight(w) for w in (w1, w2, w3))
    x = rng.standard_normal(cols).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    gate = rng.uniform(0, 1, cols).astype(np.float32)
    buf = ops.asarray(np.concatenate([np.zeros(1, np.float32), x]) if not aligned else x)
    dx = SimpleNamespace(ptr=buf.ptr + (0 if aligned else 4))
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt(np.mean(x64 * x64) + EPS) * norm_w

    # RMSNorm over two stacked matrices, the normed x written out, the counter advanced
    y, xn_out, bump = ops.zeros((37,)), ops.zeros((cols,)), ops.zeros((1,), np.int32)
    stacked = nd.stack(ops, [d1, d2])
    args = (nd.PRO_NORM, ops.asarray(norm_w), nd.EPI_STORE)
    _run(ops, nd.dgemv(stacked, 21, cols, dx, y, *args, xn=xn_out, bump=bump, eps=EPS))
    w12 = np.concatenate([f1, f2])
    _check(y.numpy(), xn, w12, w12.astype(np.float64) @ xn, f"{fmt} norm")
    np.testing.assert_allclose(xn_out.numpy(), xn, rtol=1e-6)
    assert bump.numpy()[0] == 1

    # x * gate added into y (the attention output)
    y0 = rng.standard_normal(21).astype(np.float32)
    y = ops.asarray(y0)
    xg = x64 * gate
    args = (nd.PRO_MUL, ops.asarray(gate), nd.EPI_ADD)
    _run(ops, nd.dgemv(nd.stack(ops, [d1]), 21, cols, dx, y, *args))
    _check(y.numpy() - y0, xg, f1, f1.astype(np.float64) @ xg, f"{fmt} gate + add")

    # SwiGLU: silu(W1 xn) * (W3 xn), both rows of a warp read against one staged x
    y = ops.zeros((21,))
    args = (nd.PRO_NORM, ops.asarray(norm_w), nd.EPI_SWIGLU)
    _run(ops, nd.dgemv(nd.stack(ops, [d1, d3]), 21, cols, dx, y, *args, eps=EPS))
    g, u = f1.astype(np.float64) @ xn, f3.astype(np.float64) @ xn
    sig = 0.5 * (1 + np.tanh(g / 2))
    # the errors of g and u carry over with weights |u| sig' (sig' <= 1.1) and |silu(g)|
    bound = np.abs(f1) @ np.abs(xn) * np.abs(u) * 1.1 + np.abs(g * sig) * (np.abs(f3) @ np.abs(xn))
    err = np.abs(y.numpy() - g * sig * u) / bound
    assert err.max() < 1e-6, f"{fmt} swiglu: {err.max():.2e} of the bound"

    # no prologue
    y = ops.zeros((16,))
    _run(ops, nd.dgemv(nd.stack(ops, [d2]), 16, cols, dx, y))
    _check(y.numpy(), x64, f2, f2.astype(np.float64) @ x64, f"{fmt} plain")
