"""The tensor-core prefill attention (kernels/attention_mma.cuh): on the CPU emulator against
numpy_ref.attention, in both fragment layouts (NVIDIA mma.sync m16n8k16 and, built with
-DATLAS_EMU_WMMA, AMD WMMA 16x16x16), with the MMA emulated on the same fragments; and in the
machine code, that the sm_90 / sm_121 cubins use HMMA without local memory and the gfx1151
code object uses v_wmma without scratch. Where a toolchain is missing the test skips."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops.native import attention as native_attention
from atlas_cli.backend.ops.native import runtime_emu
from tests import machine_code
from tests.gpu import checks

PREFILL = [
    f"attn_prefill_{kv}_hd{hd}" for hd in (16, 32, 64, 128, 256) for kv in ("bf16", "fp8", "f32")
]


class _EmuWithDefines(runtime_emu.EmuRuntime):
    """The emulator building every kernel file with extra defines (the AMD fragment layout)."""

    def __init__(self, cache: Path, defines: dict):
        super().__init__(cache)
        self.extra = defines

    def compile(self, file, defines=None):
        return super().compile(file, {**(defines or {}), **self.extra})


def _ops(defines: dict):
    if not runtime_emu.available():
        if os.environ.get("CI"):
            pytest.fail("g++ is missing in CI")
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"  # keyed by source and defines
    cache.mkdir(exist_ok=True)
    ops = NativeOps(_EmuWithDefines(cache, defines), weight_dtype="f32")
    ops.poison = True  # an output element the kernel forgets is NaN
    launched = []
    launch = ops._launch

    def spy(file, name, grid, block, args):
        launched.append(name)
        ops.grids.append((name, tuple(grid), tuple(block)))
        launch(file, name, grid, block, args)

    ops._launch = spy
    ops.launched, ops.grids = launched, []
    return ops


@pytest.fixture(scope="module")
def nv_ops():
    return _ops({})


@pytest.fixture(scope="module")
def amd_ops():
    return _ops({"ATLAS_EMU_WMMA": 1})


def _case(ops, t, nh, nkv, hd, start, kv, nsplit=None) -> float:
    """checks._attention_case (asserts rel. error < 2e-5 against numpy_ref.attention on what
    the cache holds) and returns the error it measured; the prefill kernel must have run."""
    errs = []
    measure = checks.rel_err

    def record(a, b):
        errs.append(measure(a, b))
        return errs[-1]

    ops.launched.clear()
    checks.rel_err = record
    try:
        checks._attention_case(
            ops, np.random.default_rng(t * 131 + hd), t, nh, nkv, hd, start, kv, nsplit
        )
    finally:
        checks.rel_err = measure
    assert f"attn_prefill_{kv}_hd{hd}" in ops.launched, ops.launched
    assert ("attn_combine" in ops.launched) == (nsplit not in (None, 1)), ops.launched
    return errs[-1]


# (T, nh, nkv, hd, start, kv dtype, nsplit): odd T, cached prefixes, GQA 1..8, split-K
NV_CASES = [
    (9, 2, 2, 16, 0, "f32", None),  # the tiny fixtures' prompt, MHA
    (70, 2, 1, 16, 0, "bf16", None),  # GQA 2 over more than one 64-row block
    (13, 4, 4, 32, 0, "f32", None),
    (37, 9, 3, 64, 0, "fp8", None),  # SmolLM2 geometry, GQA 3
    (33, 6, 1, 64, 100, "f32", 3),  # after a cached prefix, split-K + combine
    (23, 8, 1, 128, 5, "bf16", None),  # GQA 8: 184 rows of one KV head
    (40, 4, 2, 128, 7, "f32", None),
    (11, 4, 2, 256, 5, "f32", None),  # head_dim 256: two warps per 16 rows
    (20, 6, 1, 256, 100, "bf16", 2),  # Qwen3.5 geometry (GQA 6), split-K
    (17, 4, 2, 256, 0, "fp8", None),
]


@pytest.mark.parametrize("case", NV_CASES, ids=lambda c: "-".join(map(str, c)))
def test_prefill_nvidia_layout_matches_numpy(nv_ops, case):
    assert _case(nv_ops, *case) < 2e-5


AMD_CASES = [
    (9, 2, 2, 16, 0, "fp8", None),
    (37, 9, 3, 64, 0, "bf16", None),  # two warps per 16 rows on AMD
    (33, 6, 1, 64, 100, "f32", 3),
    (40, 4, 2, 128, 7, "f32", None),  # four warps per 16 rows
    (20, 6, 1, 256, 100, "bf16", 2),
]


@pytest.mark.parametrize("case", AMD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_prefill_amd_layout_matches_numpy(amd_ops, case):
    assert _case(amd_ops, *case) < 2e-5


def test_short_batches_keep_the_row_kernel(nv_ops):
    """Decode and verify batches (T <= 8) and head_dim 8 run attn_<kv>_hd<N>."""
    rng = np.random.default_rng(3)
    for t, hd in ((1, 64), (native_attention.PREFILL_MIN_T - 1, 64), (12, 8)):
        nv_ops.launched.clear()
        checks._attention_case(nv_ops, rng, t, 4, 2, hd, 3, "bf16", None)
        attn = [name for name in nv_ops.launched if name.startswith("attn")]
        assert attn == [f"attn_bf16_hd{hd}"], nv_ops.launched


@pytest.mark.parametrize(
    "t,nh,nkv,hd,start,kv",
    [(1, 12, 2, 128, 50, "bf16"), (1, 16, 2, 64, 90, "fp8"), (3, 6, 1, 256, 20, "f32")],
)
def test_decode_reads_each_kv_head_once_per_group(nv_ops, t, nh, nkv, hd, start, kv):
    """GQA 6 and 8: one block per KV head (and split) covers the whole group."""
    nv_ops.grids.clear()
    checks._attention_case(nv_ops, np.random.default_rng(nh), t, nh, nkv, hd, start, kv, 1)
    (name, grid, block), *_ = nv_ops.grids[-1:]
    g = nh // nkv
    assert name == f"attn_{kv}_hd{hd}" and grid[:2] == (-(-(t * g) // 8), nkv), grid
    assert block == (32 * min(8, t * g),), block


class _EmuAsDevice(_EmuWithDefines):
    name = "cuda"  # so that the launcher runs its first-use check


@pytest.mark.parametrize("broken", [False, True])
def test_first_use_check_against_the_portable_build(nv_ops, monkeypatch, tmp_path, broken):
    """On a device the first prefill compares attn_prefill_* with its ATLAS_PORTABLE build; a
    mismatch turns the tensor-core prefill off for that KV type and head dim, and attention
    stays correct on the row kernel."""
    from atlas_cli.backend.ops.native import attention_check

    ops = _ops({})
    ops.rt = _EmuAsDevice(nv_ops.rt.cache_dir, {})
    monkeypatch.setattr(attention_check, "_verdict_path", lambda *a: tmp_path / "verdict.json")
    if broken:
        monkeypatch.setattr(attention_check, "compare", lambda *a: 0.5)
    else:
        # on the emulator both builds emulate the MMA: they agree to the last bit
        assert attention_check.compare(ops, "fp8", 32) == 0.0
    checks._attention_case(ops, np.random.default_rng(1), 12, 4, 2, 32, 3, "fp8", None)
    assert ops._prefill_checked == {("fp8", 32): not broken}
    assert ("attn_prefill_fp8_hd32" in ops.launched) != broken, ops.launched
    assert bool(ops.__dict__.get("prefill_check_failures")) == broken
    verdict = json.loads((tmp_path / "verdict.json").read_text())  # cached for the next run
    assert verdict == {"rel_err": 0.5 if broken else 0.0}


@pytest.mark.parametrize("broken", [False, True])
def test_atlas_hw_reports_the_prefill_attention_check(nv_ops, monkeypatch, tmp_path, broken):
    """The kernel report (`atlas hw`) runs the first-use check for the families' head sizes
    and says which prefill kernel runs, with the failures' reasons."""
    from atlas_cli.backend.ops.native import attention_check
    from atlas_cli.commands.models import kernel_lines

    ops = _ops({})
    assert "runs the portable MMA" in ops.prefill_report()["reason"]  # the emulator: no check
    ops.rt = _EmuAsDevice(nv_ops.rt.cache_dir, {})
    monkeypatch.setattr(attention_check, "_verdict_path", lambda *a: tmp_path / "v.json")
    monkeypatch.setattr(attention_check, "compare", lambda *a: 0.5 if broken else 1e-7)
    report = ops.prefill_report()
    assert sorted(ops._prefill_checked) == [(ops.kv_dtype, hd) for hd in (64, 128, 256)]
    if broken:
        assert report["kernel"] == "row"
        assert f"attn_prefill_{ops.kv_dtype}_hd256: 5.00e-01 off" in report["reason"]
    else:
        assert report == {
            "kernel": "tensor-core",
            "reason": f"matches the portable build ({ops.kv_dtype} KV, head dims 64/128/256)",
        }
    lines = kernel_lines(
        "cuda",
        {"kernels": {}, "compiled": 0, "compile_s": 0.0, "cache_hits": 0, "attention": report},
    )
    assert lines[-1] == f"  prefill attention: {report['kernel']} kernel, {report['reason']}"


# ---- machine code ------------------------------------------------------------------------


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("arch", ["sm_90", "sm_121"])
def test_prefill_sass_uses_hmma_without_local_memory(arch):
    fns = machine_code.opcodes(machine_code.cubin("attention.cu", arch, nvrtc_too=False))
    for name in PREFILL:
        ops = fns[name]
        hmma = [op for op in ops if op.startswith("HMMA.16816.F32.BF16")]
        # S = Q K^T (hi, lo of Q) and O += P V (hi, lo of P), plus the f32 cache's cross terms
        assert len(hmma) >= 32, f"{name}: {len(hmma)} HMMA"
        assert not [op for op in ops if op.startswith(("LDL", "STL"))], f"{name}: local memory"
    # the row kernel stays FP32 and stages K/V with 16-byte loads
    row = fns["attn_bf16_hd128"]
    assert not [op for op in row if op.startswith("HMMA")]
    assert [op for op in row if op.startswith("LDG.E.128")], "attn_bf16_hd128: no 16-byte loads"
    assert not [op for op in row if op.startswith("LDG.E.U16")], "attn_bf16_hd128: 2-byte loads"


@pytest.fixture(scope="module")
def gfx1151() -> str:
    return machine_code.gfx1151_asm("attention.cu")


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_gfx1151_prefill_uses_wmma_without_scratch(gfx1151):
    for name in PREFILL:
        body = machine_code.amd_function(gfx1151, name)
        wmma = re.findall(r"\bv_wmma_f32_16x16x16_bf16\b", body)
        assert len(wmma) >= 8, f"{name}: {len(wmma)} v_wmma"
        assert "scratch_" not in body, f"{name}: scratch memory"
        meta = gfx1151[gfx1151.index(f".amdhsa_kernel {name}") :]
        size = re.search(r"\.amdhsa_private_segment_fixed_size (\d+)", meta)
        assert size and size.group(1) == "0", f"{name}: private segment {size and size.group(1)}"
