"""The chunked Gated DeltaNet prefill kernels (kernels/gdn.cu gdn_chunk_prep + gdn_chunk_scan)
on the CPU emulator: against the recurrent kernel and numpy_ref for several lengths (chunk
boundaries, a padded last chunk), key/value head groupings, head sizes, gates near 0 and
strongly negative, a non-zero initial state; the dispatch between the two kernels; the tiny
Qwen3.5 fixture end to end through the chunked path; and what the compilers make of the
kernels (no local memory on sm_90 and gfx1151)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.native import gdn as native_gdn
from atlas_cli.backend.ops.native import runtime_emu
from tests import machine_code

TOL = 1e-5  # max|diff| / max|ref|, outputs and final state
CHUNKED = ("gdn_chunk_prep", "gdn_chunk_scan")


@pytest.fixture(scope="module")
def emu_ops(tmp_path_factory):
    if not runtime_emu.available():
        if os.environ.get("CI"):
            pytest.fail("g++ is missing in CI")
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    ops = NativeOps(runtime_emu.EmuRuntime(tmp_path_factory.mktemp("kernels")), weight_dtype="f32")
    ops.poison = True  # scratch or output a kernel forgets to write is NaN
    return ops


@pytest.fixture
def always_chunked(monkeypatch):
    """The chunked kernels for every length (the dispatch sends short runs elsewhere)."""
    monkeypatch.setattr(native_gdn, "CHUNKED_MIN_T", 1)


def launches(ops, monkeypatch) -> list[str]:
    names: list[str] = []
    real = ops._launch

    def record(file, name, *args):
        names.append(name)
        return real(file, name, *args)

    monkeypatch.setattr(ops, "_launch", record)
    return names


def inputs(rng, t, nk, nv, dk, dv, gates="model"):
    q = numpy_ref.l2norm(rng.standard_normal((t, nk, dk)).astype(np.float32))
    k = numpy_ref.l2norm(rng.standard_normal((t, nk, dk)).astype(np.float32))
    v = rng.standard_normal((t, nv, dv)).astype(np.float32)
    if gates == "model":  # -exp(A_log) * softplus(a + dt_bias), as the model makes them
        a = rng.standard_normal((t, nv)).astype(np.float32)
        g = -np.exp(rng.uniform(0, 2, nv)).astype(np.float32) * numpy_ref.softplus(a)
    elif gates == "near0":  # hardly any decay: the UT solve sees its largest entries
        g = -rng.uniform(0, 1e-4, (t, nv)).astype(np.float32)
    else:  # strongly negative: e^cum underflows to 0 within a chunk
        g = -rng.uniform(5, 40, (t, nv)).astype(np.float32)
    beta = numpy_ref.sigmoid(2 * rng.standard_normal((t, nv)).astype(np.float32))
    state = rng.standard_normal((nv, dk, dv)).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta, state


def rel(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def run_both(ops, args):
    """(chunked out, state), (recurrent kernel out, state), (numpy_ref chunked out, state)."""
    dev = [ops.asarray(a) for a in args]
    chunked = ops.gated_delta_rule_chunked(*dev)
    recurrent = ops.gated_delta_rule(*dev)
    ref = numpy_ref.gated_delta_rule_chunked(*args)
    host = np.asarray(dev[-1])
    assert np.array_equal(host, args[-1]), "the input state was modified"
    return [tuple(np.asarray(x) for x in r) for r in (chunked, recurrent)], ref


def check(ops, args):
    ((out_c, st_c), (out_r, st_r)), (out_n, st_n) = run_both(ops, args)
    assert np.isfinite(out_c).all() and np.isfinite(st_c).all()
    errs = (rel(out_c, out_r), rel(st_c, st_r), rel(out_c, out_n), rel(st_c, st_n))
    assert max(errs) < TOL, f"chunked vs recurrent / numpy: {errs}"
    assert np.abs(out_r).max() > 1e-3  # not trivially zero
    return errs


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize(("nk", "nv"), [(1, 1), (2, 4), (3, 3)])
def test_chunked_equals_recurrent_and_numpy(emu_ops, always_chunked, t, nk, nv):
    rng = np.random.default_rng(100 * t + 10 * nk + nv)
    check(emu_ops, inputs(rng, t, nk, nv, dk=8, dv=8))


@pytest.mark.parametrize("gates", ["near0", "strong"])
@pytest.mark.parametrize("t", [65, 200])
def test_gates_near_zero_and_strongly_negative(emu_ops, always_chunked, gates, t):
    rng = np.random.default_rng(t + len(gates))
    args = inputs(rng, t, 2, 4, dk=16, dv=16, gates=gates)
    check(emu_ops, args)
    if gates == "strong":  # the state forgets within a chunk: the initial one barely shows
        assert np.exp(args[3].sum(0)).max() == 0.0


@pytest.mark.parametrize(
    ("dk", "dv"),
    [(128, 128), (48, 64), (32, 8)],  # the 27B's heads; a partial dk tile; dv < 32
)
def test_head_sizes(emu_ops, always_chunked, dk, dv):
    rng = np.random.default_rng(dk + dv)
    check(emu_ops, inputs(rng, 130, 1, 2, dk, dv))


def test_partial_column_slab_against_numpy(emu_ops, always_chunked):
    """dv = 48: the second 32-column scan block is half empty (the recurrent kernel needs
    dv | 256, so numpy alone is the reference here); dk = 40, a partial key tile."""
    rng = np.random.default_rng(48)
    args = inputs(rng, 100, 2, 4, dk=40, dv=48)
    out, st = emu_ops.gated_delta_rule_chunked(*(emu_ops.asarray(a) for a in args))
    want_out, want_st = numpy_ref.gated_delta_rule(*args)
    assert max(rel(out, want_out), rel(st, want_st)) < TOL


def test_segments_carry_the_state(emu_ops, always_chunked, monkeypatch):
    """T longer than a launch pair's segment: scratch reused, state carried across segments."""
    monkeypatch.setattr(native_gdn, "CHUNK_SEGMENT", 64)
    names = launches(emu_ops, monkeypatch)
    rng = np.random.default_rng(9)
    check(emu_ops, inputs(rng, 200, 2, 4, dk=8, dv=16))
    assert names.count("gdn_chunk_prep") == 4  # 200 tokens in segments of 64


def test_dispatch_by_length(emu_ops, monkeypatch):
    """Short runs take the recurrent kernel, from CHUNKED_MIN_T tokens the chunked pair (one
    pair per segment); key heads wider than the state slab fall back to the recurrent one."""
    names = launches(emu_ops, monkeypatch)
    rng = np.random.default_rng(4)
    for t, dk, want in [
        (native_gdn.CHUNKED_MIN_T - 1, 8, ["gdn_recurrent"]),
        (native_gdn.CHUNKED_MIN_T, 8, list(CHUNKED)),
        (65, 2 * native_gdn.CHUNK_MAX_DK, ["gdn_recurrent"]),
    ]:
        names.clear()
        args = [emu_ops.asarray(a) for a in inputs(rng, t, 1, 1, dk, 8)]
        emu_ops.gated_delta_rule_chunked(*args)
        assert [n for n in names if n.startswith("gdn")] == want, (t, dk)


@pytest.mark.slow  # the emulator: about a minute on two busy cores
def test_qwen35_fixture_prefill_through_the_chunked_kernels(monkeypatch, always_chunked):
    """The tiny f32 Qwen3.5 checkpoint on the emulator with every prefill on the chunked
    kernels: prefill logits and a few cached decode steps as numpy's (f32 bound, 1e-4)."""
    from atlas_cli.backend import load
    from tests.test_native_qwen35 import FIXTURES, greedy, rel_err
    from tests.test_native_qwen35 import emu_ops as qwen_ops

    name = "qwen35-f32"
    prompt = np.load(FIXTURES / name / "reference.npz")["prompt"]
    want = greedy(load(FIXTURES / name, device="cpu-ref").engine, prompt, 4)
    ops = qwen_ops("f32")
    names = launches(ops, monkeypatch)
    got = greedy(load(FIXTURES / name, device="emu", ops=ops).engine, prompt, 4)
    assert "gdn_chunk_scan" in names
    assert rel_err(got[0], want[0]) < 1e-4, "prefill"
    assert got[1] == want[1]
    assert rel_err(got[2], want[2]) < 1e-4, "decode after a chunked prefill"


# ---- machine code ----------------------------------------------------------------------------


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_sm90_gdn_kernels_use_no_local_memory():
    fns = machine_code.opcodes(machine_code.cubin("gdn.cu", "sm_90"))
    for name in (*CHUNKED, "gdn_recurrent"):
        assert name in fns, f"{name} not in the cubin"
        ops = fns[name]
        assert not [op for op in ops if op.startswith(("LDL", "STL"))], f"{name} uses local memory"
        assert [op for op in ops if op.startswith("FFMA")]
    # the barrier-separated tiles: every inner product is float32 FMA, no tensor-core path
    assert not [op for op in fns["gdn_chunk_scan"] if op.startswith("HMMA")]


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_gfx1151_gdn_kernels_use_no_scratch():
    asm = machine_code.gfx1151_asm("gdn.cu")
    # without the device libraries (-nogpulib) the math and id builtins stay calls: these
    # figures are the kernel's own frame and registers
    meta = asm.split("amdhsa.kernels:")[1]
    for name in CHUNKED:
        entry = meta[meta.index(f".name:           {name}") :][:2000]
        entry = entry[: entry.index(".wavefront_size")]
        assert re.search(r"\.private_segment_fixed_size: 0\b", entry), f"{name}: scratch"
        assert re.search(r"\.vgpr_spill_count: 0\b", entry), f"{name}: VGPR spills"
