"""What the compiler makes of the prefill GEMM (kernels/gemm.cu), read from the machine code: the
sm_90 and sm_121 SASS (NVRTC, then cuobjdump -sass) and the gfx1151 ISA (clang-19 -S). Every
entry point multiplies on the tensor cores with exactly the split products gemm.cu keeps
(x in three bf16 parts, the weight in one, two or three), and nothing spills. Where a toolchain
is missing the test skips.
"""

from __future__ import annotations

import collections
import re

import pytest

from atlas_cli.backend.ops.native import nvrtc
from atlas_cli.backend.ops.native import runtime as rt
from tests import machine_code
from tests.gpu.checks import FORMATS

pytestmark = pytest.mark.slow  # builds the kernels with NVRTC / clang to read their instructions

GEMM_FORMATS = FORMATS
# bf16 parts of the dequantized weight (gemm.cu gm_wparts): exact in one for bf16 and NVFP4
# (E2M1 x E4M3), in two for f16, Q4_0 and Q5_0
WEIGHT_PARTS = {"bf16": 1, "nvfp4": 1, "f16": 2, "q4_0": 2, "q5_0": 2}
# products x_i w_j with i + j <= 2, x in three parts: 3, 5 or 6 per output tile and k16 slice
PRODUCTS = {1: 3, 2: 5, 3: 6}


def products(fmt: str) -> int:
    return PRODUCTS[WEIGHT_PARTS.get(fmt, 3)]


def _disassemble(cubin: bytes) -> dict[str, collections.Counter]:
    """Entry point -> its SASS opcodes (with modifiers), counted."""
    return {name: collections.Counter(ops) for name, ops in machine_code.opcodes(cubin).items()}


@pytest.fixture(scope="module", params=["sm_90", "sm_121"])
def gemm_build(request) -> tuple[str, str, dict[str, collections.Counter]]:
    """gemm.cu for one target, through NVRTC (what atlas compiles with at run time): the
    target, ptxas's verbose log and each entry point's SASS."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc)")
    arch = request.param
    out = nvrtc.compile_source(
        rt.expand_source("gemm.cu"), "gemm.cu", arch, extra_options=["--ptxas-options=-v"]
    )
    return arch, out.log, _disassemble(out.binary)


def test_gemm_uses_tensor_cores(gemm_build):
    """Per 64-column step and warp: 4 k16 slices x 4 (m16 x n8) tiles x the kept products."""
    arch, _, fns = gemm_build
    for fmt in GEMM_FORMATS:
        c = fns[f"gemm_{fmt}"]
        want = 16 * products(fmt)
        assert c["HMMA.16816.F32.BF16"] == want, f"{arch} gemm_{fmt}: {c}"
        # the per-step sums (16 FADDs) and the epilogue; no FMA inner loop is left
        assert c["FFMA"] < 8, f"{arch} gemm_{fmt}: an FMA inner loop is left"


def test_gemm_has_no_spills(gemm_build):
    arch, log, fns = gemm_build
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len(GEMM_FORMATS), log
    assert all(s == ("0", "0") for s in spills), f"{arch}: {log}"
    for name, c in fns.items():
        assert not any(op.startswith(("LDL", "STL")) for op in c), f"{arch} {name}: {c}"
    # the tiles: three x parts and one to three weight parts of 8 KB, within the 48 KB limit
    smem = [int(b) for b in re.findall(r"(\d+) bytes smem", log)]
    assert sorted(set(smem)) == [32768, 40960, 49152], log


def test_gemm_portable_build_has_no_tensor_core_instruction():
    """ATLAS_PORTABLE builds the fallback the first-use check compares against (and that runs
    after a mismatch): plain FMAs on the same tiles."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc)")
    src = rt.expand_source("gemm.cu")
    out = nvrtc.compile_source(src, "gemm.cu", "sm_90", defines={"ATLAS_PORTABLE": 1})
    for name, c in _disassemble(out.binary).items():
        assert not any(op.startswith("HMMA") for op in c) and c["FFMA"] >= 64, f"{name}: {c}"


def test_gfx1151_gemm_uses_wmma_without_scratch():
    asm = machine_code.gfx1151_asm("gemm.cu")
    for fmt in GEMM_FORMATS:
        body = machine_code.amd_function(asm, f"gemm_{fmt}")
        # the k16 slices are a loop (unrolled, their LDS loads would not fit the VGPRs): one
        # slice's 2 tiles x the kept products
        want = 2 * products(fmt)
        assert body.count("v_wmma_f32_16x16x16_bf16") == want, fmt
        assert "scratch_" not in body, f"gemm_{fmt} spills to scratch"


# ---- gemm_fast.cu: one bf16 MMA per product, ldmatrix, a 3-stage cp.async ring ------------


@pytest.fixture(scope="module", params=["sm_90", "sm_90a", "sm_121", "sm_121a"])
def fast_build(request) -> tuple[str, str, dict[str, list[str]]]:
    """gemm_fast.cu for one target through NVRTC: the target, ptxas's log and each entry
    point's SASS lines."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc)")
    arch = request.param
    out = nvrtc.compile_source(
        rt.expand_source("gemm_fast.cu"), "gemm_fast.cu", arch, extra_options=["--ptxas-options=-v"]
    )
    lines = {name: [op for _, op in ins] for name, ins in machine_code.sass(out.binary).items()}
    return arch, out.log, lines


def test_fast_gemm_multiplies_each_product_once(fast_build):
    """Per 64-column step and warp (32 tokens x 32 rows): 4 k16 slices x 8 (m16 x n8) tiles =
    32 MMAs, fed by 4 ldmatrix.x4 per slice (two for x, two for the weights), so every product
    is one MMA (gemm.cu takes 3-6); x arrives by cp.async with two steps' copies in flight
    while the third is read (a 3-slot ring); nothing multiplies outside the tensor cores."""
    arch, _, fns = fast_build
    for fmt in GEMM_FORMATS:
        ops = fns[f"gemm_fast_{fmt}"]
        c = collections.Counter(op.split()[0] for op in ops)
        mma, ldsm = c["HMMA.16816.F32.BF16"], c["LDSM.16.M88.4"]
        assert mma and mma % 32 == 0 and mma == 2 * ldsm, f"{arch} gemm_fast_{fmt}: {c}"
        assert c["FFMA"] == 0, f"{arch} gemm_fast_{fmt}: an FMA product loop"
        assert c["LDGSTS.E.BYPASS.128"] >= 4, f"{arch} gemm_fast_{fmt}: no 16-byte cp.async"
        waits = [op for op in ops if op.startswith("DEPBAR")]
        # (ptxas unrolls some formats' step loop twice: one wait per step)
        assert waits and set(waits) == {"DEPBAR.LE SB0, 0x2"}, f"{arch} gemm_fast_{fmt}: {waits}"


def test_fast_gemm_has_no_spills_and_two_blocks_fit_an_sm(fast_build):
    arch, log, fns = fast_build
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), f"{arch}: {log}"
    for name, ops in fns.items():
        assert not any(op.startswith(("LDL", "STL")) for op in ops), f"{arch} {name}"
    # the x ring (3 x 8 KB) and the weight tile (16 KB) ...
    smem = {int(b) for b in re.findall(r"(\d+) bytes smem", log)} - {0}
    assert smem == {40960}, log
    # ... and <= 128 registers: two 256-thread blocks per SM
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 128, f"{arch}: {regs}"


def test_gfx1151_fast_gemm_uses_one_wmma_per_product_without_scratch():
    asm = machine_code.gfx1151_asm("gemm_fast.cu")
    for fmt in GEMM_FORMATS:
        body = machine_code.amd_function(asm, f"gemm_fast_{fmt}")
        # one k16 slice of the loop: a wave's 16 tokens x 64 rows = four 16 x 16 tiles
        assert body.count("v_wmma_f32_16x16x16_bf16") == 4, fmt
        assert "scratch_" not in body, f"gemm_fast_{fmt} spills to scratch"


# ---- gemm_fp4.cu: W4A4 on the block-scaled FP4 MMA (sm_120a / sm_121a) --------------------


@pytest.mark.parametrize("arch", ["sm_121a", "sm_120a", "sm_121", "sm_90"])
def test_w4a4_gemm_uses_the_block_scaled_fp4_mma_where_it_exists(arch):
    """Per 128-column step and warp on sm_121a (GB10) and sm_120a: 2 k64 slices x 8 (m16 x
    n8) tiles = 16 OMMA.SF.16864 (E2M1 x E2M1, UE4M3 scales per 16), 4 ldmatrix.x4 per slice,
    codes and scales by cp.async (a 3-slot ring), no float multiply in the loop, no spill.
    Plain sm_121 and sm_90 have no such MMA: the portable loop, which atlas does not send
    NVFP4 weights to there (gemm_check.FP4_TARGETS)."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc)")
    out = nvrtc.compile_source(
        rt.expand_source("gemm_fp4.cu"), "gemm_fp4.cu", arch, extra_options=["--ptxas-options=-v"]
    )
    ops = [op for _, op in machine_code.sass(out.binary)["gemm_fp4_nvfp4"]]
    c = collections.Counter(op.split()[0] for op in ops)
    omma = c["OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"]
    if arch.endswith("a"):
        assert omma == 16 and c["LDSM.16.M88.4"] == 8 and c["FFMA"] == 0, f"{arch}: {c}"
    else:
        assert omma == 0 and c["FFMA"] > 0, f"{arch}: {c}"
    assert c["LDGSTS.E.BYPASS.128"] >= 3 and c["LDGSTS.E.64"] >= 2, f"{arch}: {c}"
    assert {op for op in ops if op.startswith("DEPBAR")} == {"DEPBAR.LE SB0, 0x2"}
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.log)
    assert spills and all(s == ("0", "0") for s in spills), out.log
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
