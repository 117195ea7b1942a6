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
