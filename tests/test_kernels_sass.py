"""What the compiler makes of the decode GEMV (kernels/gemv.cu), read from the machine code: the
sm_90 SASS (nvcc or NVRTC, then cuobjdump -sass) and the gfx1151 ISA (clang-19 -S). The inner
loop of each fast path is found as a backward branch's body; the decode-step loop (T == 1) is
the one that reads x from shared memory with exactly 8 16-byte loads (32 floats). Where a
toolchain is missing the test skips. The misaligned-row fallback is checked on the emulator.
"""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from atlas_cli.backend.ops.native import nvrtc, runtime_emu
from atlas_cli.backend.ops.native import runtime as rt
from benchmarks.gemv_model import BYTES_PER_WEIGHT
from tests import machine_code
from tests.gpu.checks import col_step


@pytest.fixture(scope="module")
def sass() -> dict[str, list[tuple[int, str]]]:
    """gemv.cu for sm_90: entry point -> its instructions (predicates dropped)."""
    return machine_code.sass(machine_code.cubin("gemv.cu", "sm_90"))


def _sass_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    loops = []
    for addr, op in ins:
        m = re.match(r"BRA\b.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append([o for a, o in ins if start <= a <= addr])
    return loops


def _ops(body: list[str]) -> collections.Counter:
    return collections.Counter(op.split()[0] for op in body)


def _decode_loop(fns, name: str) -> tuple[collections.Counter, int]:
    """The T == 1 loop over whole tiles of the 16-byte path (the smallest loop with a barrier
    whose x loads are all 16-byte: the T <= 8 and deq32 bodies also read an unaligned x with
    4-byte loads) and the weights a lane multiplies per iteration (32 per 8 LDS.128 of x)."""
    loops = map(_ops, _sass_loops(fns[name]))
    found = [c for c in loops if c["BAR.SYNC.DEFER_BLOCKING"] and not c["LDG.E"]]
    assert found, f"{name}: no loop with x in shared memory"
    c = min(found, key=lambda c: sum(c.values()))
    assert c["LDS.128"] % 8 == 0 and c["LDS.128"], c
    return c, 4 * c["LDS.128"]


# (format, lane units per T == 1 iteration, instruction bound per weight at T == 1)
# Measured (sm_90, nvcc 13.0) per weight: NVFP4 4.54, Q4_K 4.39, Q5_K 4.80, Q4_0 3.67, Q4_1 3.67,
# Q8_0 4.34, Q6_K 4.81, bf16/f16 2.61, f32 1.81, in the loop over whole tiles (no bounds checks),
# weights read with explicit non-coherent loads (quant.cuh ld_u4_readonly: f32 and bf16 then
# recompute the row's address in the loop, from 1.73 and 2.55). Before that loop was split from
# the last, partial tiles: 4.76, 4.75, 5.92 with Q5_K's stored bit layout, 4.02, 4.01, 4.65,
# 5.33, 2.77, 1.98. With Q4_0/Q4_1/Q8_0/Q6_K blocks copied whole through shared memory (their
# scales in the row, one unit per lane): 6.06, 6.16, 7.53, 7.84; with deq32's byte loads for
# every GGUF format: NVFP4 5.69, Q4_0 7.7, Q4_1 9.6, Q8_0 6.4, Q4_K 10.8, Q5_K 14.8, Q6_K 14.0,
# bf16/f16 3.47, f32 2.5. Q5_0 4.16 and Q5_1 4.09 (Q4_0's decode plus Q5_K's two bit selects
# and rotates per 8 weights, and Q5_0's three 2-byte loads of d and qh). Q3_K 4.58 (4.80 with
# the hmask word rotated per lane in the loop rather than the code word at upload). The bounds
# leave ~2% for compiler drift and never exceed MAX_PER_WEIGHT.
MAX_PER_WEIGHT = 5.0
# IQ4_NL and IQ4_XS codes index a table of 16 non-linear values, which no mask turns into f16
# halves: every 4 weights take three byte permutes (a lookup in each half of the table, then a
# pick by each code's top bit that also puts the zero byte above each value) and ~2 more
# instructions for their selectors, ~1.1 per weight above Q4_0's decode. Measured 5.88 and
# 6.28 (IQ4_XS: its 6-bit scale per lane unit), of which ~0.45 are moves of the table's
# register operands into each permute (ptxas keeps the constants in uniform registers).
TABLE_FORMATS = {"iq4_nl", "iq4_xs"}
MAX_PER_WEIGHT_TABLE = 6.5
FAST_PATHS = [
    ("nvfp4", 4, 4.63),
    ("q4_k", 4, 4.48),
    ("q5_k", 4, 4.90),
    ("q4_0", 4, 3.75),
    ("q4_1", 4, 3.75),
    ("q8_0", 4, 4.43),
    ("q6_k", 4, 4.91),
    ("q5_0", 4, 4.24),
    ("q5_1", 4, 4.18),
    ("q3_k", 4, 4.67),
    ("iq4_nl", 4, 6.00),
    ("iq4_xs", 4, 6.41),
    ("bf16", 4, 2.66),
    ("f16", 4, 2.66),
    ("f32", 2, 1.85),
]
assert all(
    bound <= (MAX_PER_WEIGHT_TABLE if fmt in TABLE_FORMATS else MAX_PER_WEIGHT)
    for fmt, _, bound in FAST_PATHS
)
# 16-byte weight loads per 32 weights, straight from the row (Q6_K: ql and qh; its scales: below)
ROW_LOADS = {"nvfp4": 1, "q4_0": 1, "q4_1": 1, "q8_0": 2, "q4_k": 2, "q5_k": 3, "q6_k": 2}
ROW_LOADS |= {"bf16": 4, "f16": 4, "f32": 8, "q5_0": 1, "q5_1": 1, "q3_k": 2}
ROW_LOADS |= {"iq4_nl": 1, "iq4_xs": 1}
# 2-byte loads of block scales per 32 weights (Q6_K: the lane's two int8 scales and d; Q5_0:
# d and the two halves of qh, 6 bytes a block; Q3_K: the two bytes of each of the lane's two
# scales' low and high bits, d)
SCALE_LOADS = {"nvfp4": 1, "q4_0": 1, "q8_0": 1, "q6_k": 2, "q5_0": 3, "q3_k": 3, "iq4_nl": 1}
# 4-byte loads of them (Q4_1's d and m; Q5_1's d and m, and qh; IQ4_XS's d and scales_h, and
# scales_l)
WORD_LOADS = {"q4_1": 1, "q5_1": 2, "iq4_xs": 2}


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt,units,bound", FAST_PATHS)
def test_sm90_decode_loop_uses_128_bit_loads(sass, fmt, units, bound):
    c, weights = _decode_loop(sass, f"gemv_{fmt}")
    assert weights == 32 * units, c
    assert not c["LDG.E.U8.CONSTANT"] and not c["LDG.E.S8.CONSTANT"], c  # no byte loads
    x_loads = units  # one 16-byte load of x per staged tile
    assert c["LDG.E.128.CONSTANT"] == units * ROW_LOADS[fmt] + x_loads, c
    assert c["LDG.E.U16.CONSTANT"] == units * SCALE_LOADS.get(fmt, 0), c
    assert c["LDG.E.CONSTANT"] == units * WORD_LOADS.get(fmt, 0), c
    # one FFMA per weight, plus the halves' multipliers and offsets/mins once per 16 weights
    per_unit = 0 if fmt in ("bf16", "f16", "f32") else 2 if fmt == "nvfp4" else 4
    assert c["FFMA"] <= weights + units * per_unit + 2, c
    total = sum(c.values())
    assert total <= bound * weights, f"gemv_{fmt}: {total / weights:.2f} instructions per weight"


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt,units", [(f, u) for f, u, _ in FAST_PATHS])
def test_sm90_verify_gemv_keeps_t1_loads_in_flight(sass, fmt, units):
    """gemv_t8_<fmt> (2 <= T <= 8, an MTP verify): its pass over whole tiles issues as many
    16-byte weight loads as the T == 1 loop's (four lane units, two for f32), where one unit
    per pass had a quarter of T == 1's bytes in flight; x is staged a tile (8 tokens) at a
    time between the units' multiplies."""
    loops = [c for c in map(_ops, _sass_loops(sass[f"gemv_t8_{fmt}"])) if c["LDG.E.128.CONSTANT"]]
    staged = [c for c in loops if c["BAR.SYNC.DEFER_BLOCKING"]]
    assert staged, f"gemv_t8_{fmt}: no loop staging x"
    c = max(staged, key=lambda c: c["LDG.E.128.CONSTANT"])
    x_loads = units * 8  # one 16-byte load of each of 8 tokens' x per tile
    assert c["LDG.E.128.CONSTANT"] == units * ROW_LOADS[fmt] + x_loads, c
    assert c["BAR.SYNC.DEFER_BLOCKING"] == 2 * units, c  # each tile's staging between two
    assert not any(k.startswith(("LDL", "STL")) for k in c), c


# gemv_mma.cu's loop per tile and lane: four lane units (one tile of four rows, T == 1's bytes
# in flight), 8 x-fragment loads (the warp's 8 slices), 2 groups x 8 slices x 2 parts of MMAs.
# Measured (sm_90, nvcc 13.0) per weight at any T <= 8: NVFP4 4.51, Q4_0 4.26, Q4_1 4.28, Q8_0
# 4.02, Q4_K 4.21, Q5_K 4.78, Q6_K 4.75, Q5_0 4.64, Q5_1 4.61, Q3_K 4.88, IQ4_NL 6.41, IQ4_XS
# 6.75: 0.93-1.17 of the T == 1 loop's (gemv_t8: T FFMAs a weight). A first version that
# checked the row's end per lane and recomputed the swizzled addresses per tile: 1.02-1.50.
MMA_VERIFY_RATIO = 1.2


@pytest.fixture(scope="module")
def mma_sass() -> dict[str, list[tuple[int, str]]]:
    return machine_code.sass(machine_code.cubin("gemv_mma.cu", "sm_90"))


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt", [f for f, _, _ in FAST_PATHS if f not in ("bf16", "f16", "f32")])
def test_sm90_verify_gemv_costs_what_t1_costs(sass, mma_sass, fmt):
    """gemv_mma_<fmt> (2 <= T <= 8 on the tensor cores): one loop, whose pass over a tile issues
    T == 1's weight loads (four lane units) and 16 HMMA per group of 16 rows (one per 16 x 16
    x 8 weights and x part), and costs at most 1.2x the T == 1 loop's instructions per weight;
    no local memory."""
    loops = [c for c in map(_ops, _sass_loops(mma_sass[f"gemv_mma_{fmt}"])) if c["HMMA.16816.F32"]]
    assert len(loops) == 1, f"gemv_mma_{fmt}: {len(loops)} loops with MMAs"
    c = loops[0]
    assert c["HMMA.16816.F32"] == 32, c
    assert c["LDSM.16.M88.4"] == 16, c  # one A fragment per slice and group
    assert c["LDG.E.128.CONSTANT"] == 4 * ROW_LOADS[fmt] + 8, c  # weights, x fragments
    assert c["BAR.SYNC.DEFER_BLOCKING"] == 4, c
    assert not any(k.startswith(("LDL", "STL")) for k in c), c
    t1, t1_weights = _decode_loop(sass, f"gemv_{fmt}")
    per_weight, t1_per_weight = sum(c.values()) / 128, sum(t1.values()) / t1_weights
    assert per_weight <= MMA_VERIFY_RATIO * t1_per_weight, (per_weight, t1_per_weight)


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_sm90_nvfp4_decode_has_no_compare_select(sass):
    c, weights = _decode_loop(sass, "gemv_nvfp4")
    assert not c["FSEL"] and not c["I2FP.F32.U32"] and not c["ISETP.GE.U32.AND"], c
    assert c["HADD2.F32"] == weights + weights // 16, c  # codes + block scales, exact from f16


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize(
    "fmt",
    ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"],
)
def test_sm90_gguf_decode_is_branch_free(sass, fmt):
    """The nibbles are masked into f16 halves: no int-to-float conversion per weight, no
    compare/select; the block scales are the only integers converted."""
    c, weights = _decode_loop(sass, f"gemv_{fmt}")
    conversions = sum(n for op, n in c.items() if op.startswith(("I2F", "I2FP")))
    assert conversions <= weights // 8, c
    assert c["HADD2.F32"] >= weights and not c["FSEL"], c


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_sm90_gemv_uses_no_local_memory(sass):
    for name, ins in sass.items():
        ops = _ops([o for _, o in ins])
        assert not any(k.startswith(("LDL", "STL")) for k in ops), name


@pytest.fixture(scope="module")
def decode_sass(sass) -> dict[str, list[tuple[int, str]]]:
    """decode.cu (the fused decode step) for sm_90, as `sass` reads gemv.cu."""
    return machine_code.sass(machine_code.cubin("decode.cu", "sm_90", nvrtc_too=False))


# The fused step's GEMV (decode.cu dgemv_<fmt>) has three 16-byte bodies: no prologue, x times
# a vector (the RMSNorm weight or the gate's sigmoid) and the SwiGLU pair. x is staged in
# shared memory 8,192 columns at a time (with the prologue), and then the weight loop runs
# over them without barriers. Each warp takes 2 output rows, so a single-row body's loop takes
# 2 tiles per iteration, 4 lane units, and the pair's (gate and up of each row) 1 tile, 4 lane
# units; f32 one output row at a time: 2 lane units. Per body: (lane units, tiles).
DG_BODIES = {"none": (4, 2), "mul": (4, 2), "pair": (4, 1)}
DG_BODIES_F32 = {"none": (2, 2), "mul": (2, 2), "pair": (2, 1)}
# Measured per weight (sm_90, nvcc 13.0), single-row bodies, pair, with each iteration asking L2 for
# bytes ahead (gv_prefetch: one instruction and its address per row and 64 units, ~0.1-0.2 per
# weight; in the pair's loop every other iteration runs it), held to 128 registers (two blocks per
# SM) but Q4_0 and Q4_1 (decode.cu DG_MIN_BLOCKS). The staging of x (16-byte loads, the prologue,
# the sums of 16) runs outside the loop, once per block and chunk for the block's 16 output rows:
# ~0.15 per weight more without a prologue, ~0.3 with one (~half that in the pair). Without the
# prefetch: NVFP4 4.38 / 4.36, Q4_K 4.03 / 4.07, Q5_K 4.50 / 4.91, Q6_K 4.55 / 4.95 (pairs at 168
# and 147 registers unbounded: 4.62, 4.65), Q3_K 4.36 / 4.53 (150 registers), Q4_0 3.29 / 3.26.
# Before that (one row per warp, one lane unit per iteration, the prologue chosen per element, x
# staged with 4-byte loads and bounds checks in the loop): NVFP4 14.0, Q4_K 15.3, Q5_K 16.5, Q4_0
# 13.2, Q8_0 14.6, Q6_K 17.2, bf16/f16 10.7, f32 8.9.
DG_MEASURED = {
    "nvfp4": (4.63, 4.73),
    "q4_k": (4.14, 4.33),
    "q5_k": (4.63, 5.09),
    "q4_0": (3.53, 3.62),
    "q4_1": (3.53, 3.62),
    "q8_0": (4.16, 4.26),
    "q6_k": (4.78, 5.26),
    "q5_0": (3.95, 4.05),
    "q5_1": (3.88, 4.00),
    "q3_k": (4.66, 5.34),
    "iq4_nl": (5.73, 5.84),
    "iq4_xs": (6.03, 6.15),
    "bf16": (2.51, 2.53),
    "f16": (2.52, 2.53),
    "f32": (1.92, 1.94),
}
# the K-quant pairs' four rows in 128 registers: past gemv.cu's ceiling
DG_MAX_PER_WEIGHT = 5.5


def _dg_bound(fmt: str, pair: bool) -> float:
    """2% over the measured count for compiler drift, never past the format's ceiling."""
    ceiling = MAX_PER_WEIGHT_TABLE if fmt in TABLE_FORMATS else DG_MAX_PER_WEIGHT
    return min(DG_MEASURED[fmt][pair] * 1.02, ceiling)


assert all(
    m <= (MAX_PER_WEIGHT_TABLE if fmt in TABLE_FORMATS else DG_MAX_PER_WEIGHT)
    for fmt, ms in DG_MEASURED.items()
    for m in ms
)
# What a warp asks of L2 ahead of its multiplies (two blocks of decode.cu's DG_AHEAD units of
# each of its 2 rows) times the warps an SM holds must cover the bytes in flight an H200 / H100
# needs per SM at its copy rate (Little's law: ~23 KB at ~630 ns, benchmarks/gemv_model.py).
DG_AHEAD_UNITS = 64
DG_IN_FLIGHT_MIN = 24 * 1024


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt", [f for f, _, _ in FAST_PATHS])
def test_sm90_dgemv_bodies(decode_sass, fmt):
    """The fused decode step's GEMV: each 16-byte body's weight loop (no barrier, x from
    shared memory; the deq32 fallback's read bytes) reads the weights with non-coherent
    16-byte loads straight from the row, within 2% of its measured instructions per weight;
    x and the prologue's vector are staged with 16-byte loads; no local memory."""
    loops = list(map(_ops, _sass_loops(decode_sass[f"dgemv_{fmt}"])))
    assert not any(k.startswith(("LDL", "STL")) for c in loops for k in c), fmt
    inner = [
        c
        for c in loops
        if not c["BAR.SYNC.DEFER_BLOCKING"] and c["LDS.128"] and c["LDG.E.128.CONSTANT"]
    ]
    bodies = DG_BODIES_F32 if fmt == "f32" else DG_BODIES
    want = sorted((ROW_LOADS[fmt] * units, 8 * tiles) for units, tiles in bodies.values())
    found = sorted((c["LDG.E.128.CONSTANT"], c["LDS.128"]) for c in inner)
    assert found == want, f"dgemv_{fmt}: {found}, want {want}"
    for c in inner:
        pair = c["LDS.128"] == 8 * bodies["pair"][1]  # its one tile; the others' two
        units = bodies["pair" if pair else "none"][0]
        assert not any(op.startswith(("LDG.E.U8", "LDG.E.S8", "LD.E")) for op in c), c
        assert c["LDG.E"] == 0 and c["LDG.E.CONSTANT"] == units * WORD_LOADS.get(fmt, 0), c
        assert c["LDG.E.U16.CONSTANT"] == units * SCALE_LOADS.get(fmt, 0), c
        per_weight = sum(c.values()) / (32 * units)
        bound = _dg_bound(fmt, pair)
        assert per_weight <= bound, f"dgemv_{fmt}: {per_weight:.2f} per weight, bound {bound:.2f}"
    # the staging: x (and the vector) with 16-byte loads in the loops that wait at barriers
    staging = [c for c in loops if c["BAR.SYNC.DEFER_BLOCKING"] and c["STS.128"]]
    assert any(c["LDG.E.128.CONSTANT"] and not c["LDG.E"] for c in staging), fmt


@pytest.fixture(scope="module")
def decode_ptxas() -> str:
    """ptxas's verbose log of decode.cu for sm_90 through NVRTC (what atlas compiles with)."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc)")
    src = rt.expand_source("decode.cu")
    return nvrtc.compile_source(src, "decode.cu", "sm_90", extra_options=["--ptxas-options=-v"]).log


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt", [f for f, _, _ in FAST_PATHS])
def test_sm90_dgemv_keeps_24kb_of_weights_in_flight(decode_sass, decode_ptxas, fmt):
    """Each 16-byte body's weight loop asks L2 for what follows (prefetch.global.L2: the codes,
    and the block scales where the format has them; decode.cu asks two blocks of DG_AHEAD units
    ahead, so where ptxas places the request in an iteration does not matter); the warps an SM
    holds (from ptxas's registers, NVRTC's build) times each one's 2 rows x 2 blocks ahead are
    >= 24 KB of weights."""
    inner = [
        [op.split()[0] for op in body]
        for body in _sass_loops(decode_sass[f"dgemv_{fmt}"])
        if not any(op.startswith("BAR.SYNC") for op in body)
        and any(op.startswith("LDS.128") for op in body)
        and any(op.startswith("LDG.E.128.CONSTANT") for op in body)
    ]
    assert len(inner) == 3, f"dgemv_{fmt}: {len(inner)} 16-byte bodies"
    for ops in inner:
        assert ops.count("CCTL.E.PF2") >= 2, f"dgemv_{fmt}: {ops.count('CCTL.E.PF2')} prefetches"
    entry = next(e for e in decode_ptxas.split("Compiling entry function") if f"'dgemv_{fmt}'" in e)
    registers = int(re.search(r"Used (\d+) registers", entry).group(1))
    warps = 8 * min(8, 65536 // (-(-registers // 8) * 8 * 256))  # 256-thread blocks
    ahead = 2 * 2 * DG_AHEAD_UNITS * 32 * BYTES_PER_WEIGHT[fmt]  # 2 rows, 2 blocks of units
    assert warps * ahead >= DG_IN_FLIGHT_MIN, f"dgemv_{fmt}: {warps} warps x {ahead:.0f} bytes"


# ---- gfx1151 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gfx1151() -> str:
    return machine_code.gfx1151_asm("gemv.cu")


def _amd_loops(asm: str, name: str) -> list[collections.Counter]:
    lines = machine_code.amd_function(asm, name).splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        if m := re.match(r"(\.LBB\w+):", line):
            labels[m.group(1)] = i
        m = re.match(r"\s+(s_cbranch_\w+|s_branch)\s+(\.LBB\w+)", line)
        if m and m.group(2) in labels:
            body = lines[labels[m.group(2)] : i + 1]
            ops = [x.split()[0] for x in body if x.startswith("\t") and x.split()[0][0] != "."]
            loops.append(collections.Counter(ops))
    return loops


def _amd_decode_loop(asm: str, fmt: str, units: int) -> collections.Counter:
    """The T == 1 loop: a barrier, 8 ds_load_b128 of x per lane unit and no byte or 16-bit
    loads but the block scales' (deq32's loops have them); the largest such loop (the branch
    targets inside it make smaller ones)."""
    fast = [
        c
        for c in _amd_loops(asm, f"gemv_{fmt}")
        if c["s_barrier"]
        and c["ds_load_b128"] == 8 * units
        and not c["global_load_u8"]
        and c["global_load_u16"] <= units * SCALE_LOADS.get(fmt, 0)
    ]
    assert fast, f"gemv_{fmt}: no loop with x staged in LDS"
    return max(fast, key=lambda c: sum(c.values()))


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt,units,bound", FAST_PATHS)
def test_gfx1151_loops_use_128_bit_loads(gfx1151, fmt, units, bound):
    c = _amd_decode_loop(gfx1151, fmt, units)
    assert c["global_load_b128"] + c["global_load_dwordx4"] >= units + 1, c
    # no byte loads of codes; Q6_K's two int8 scales of a unit clang may load as two
    # sign-extending bytes (global_load_i8) rather than one u16 and two extracts (it does for
    # one of the four units once the thread ids are inlined: amd_device_lib)
    assert not c["global_load_u8"], c
    assert c["global_load_i8"] <= (2 * units if fmt == "q6_k" else 0), c
    assert not any(op.startswith("scratch_") for op in c), c


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
def test_gfx1151_nvfp4_loop_is_branch_free_with_128_bit_loads(gfx1151):
    """The NVFP4 decode-step loop: one 16-byte load of codes and one 2-byte load of scales per
    lane unit, x from LDS, no byte loads, no branch but the loop's (before: 16 byte loads, 43
    branches per 32 weights; then 10 per 128 weights, the E4M3 block scales' portable decode,
    before quant.cuh e4m3x2_to_f32 took the f16 route)."""
    c = _amd_decode_loop(gfx1151, "nvfp4", 4)
    assert c["global_load_b128"] >= 5 and c["global_load_u16"] == 4, c
    branches = sum(n for op, n in c.items() if op.startswith("s_cbranch"))
    assert branches <= 1, f"{branches} conditional branches per 128 weights"


# ---- the fallback for rows that are not 16-byte aligned, on the emulator --------------------


@pytest.fixture(scope="module")
def emu_ops():
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    return NativeOps(runtime_emu.EmuRuntime(cache), weight_dtype="bf16")


def _shifted(ops, buf_bytes: np.ndarray, shift: int) -> SimpleNamespace:
    """The bytes uploaded `shift` bytes past an aligned start: a misaligned device pointer."""
    buf = ops._upload_bytes(np.concatenate([np.zeros(shift, np.uint8), buf_bytes]))
    return SimpleNamespace(ptr=buf.ptr + shift, keep=buf)


@pytest.mark.parametrize("t", [1, 3])
def test_misaligned_rows_take_the_fallback(emu_ops, t):
    from tests.gpu.checks import random_weight

    rng = np.random.default_rng(5)
    x = rng.standard_normal((t, 96)).astype(np.float32)
    for fmt in ("bf16", "nvfp4"):
        w, wf = random_weight(fmt, 19, 96, rng)
        dw = emu_ops.prepare_weight(w)
        want = emu_ops.linear(emu_ops.asarray(x), dw).numpy()
        raw = np.empty(dw.rows * dw.row_bytes, np.uint8)
        emu_ops.rt.d2h(raw, dw.data)
        moved = {"data": _shifted(emu_ops, raw, 2)}
        if fmt == "nvfp4":
            sraw = np.empty(dw.rows * dw.srow_bytes, np.uint8)
            emu_ops.rt.d2h(sraw, dw.scales)
            moved["scales"] = _shifted(emu_ops, sraw, 1)
        got = emu_ops.linear(emu_ops.asarray(x), type(dw)(**{**vars(dw), **moved})).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=fmt)
        np.testing.assert_allclose(got, x @ wf.T, rtol=2e-4, atol=2e-4, err_msg=fmt)


# ---- every format against numpy on the emulator: T = 1..8, odd row sizes, shifted buffers ---

# Wide enough for the T == 1 loop over whole tiles (4 tiles of 32 units: 4,096 columns) and
# then the last, partial tiles; K-quants: whole 256-element blocks
_EMU_COLS = {f: 4608 for f, _, _ in FAST_PATHS if col_step(f) == 256}


@pytest.mark.parametrize("fmt", [f for f, _, _ in FAST_PATHS])
def test_every_format_matches_numpy(emu_ops, fmt):
    """The 16-byte path (its loop over whole tiles and the last tiles), and the deq32 fallback
    (the codes shifted off 16-byte alignment, or
    the scales off the alignment of their loads: 2 bytes for Q4_1's and Q5_1's 4-byte loads, 1
    for the 2-byte ones), match x @ W^T of numpy's dequantization for T = 1, 2, 5, 8."""
    from atlas_cli.backend.ops.native.device import NativeOps
    from tests.gpu.checks import random_weight

    if fmt == "f32":  # emu_ops rounds float weights to bf16
        emu_ops = NativeOps(emu_ops.rt, weight_dtype="f32")
    rng = np.random.default_rng(11)
    cols = _EMU_COLS.get(fmt, 4096 + 96)
    w, wf = random_weight(fmt, 19, cols, rng)
    dw = emu_ops.prepare_weight(w)
    raw = np.empty(dw.rows * dw.row_bytes, np.uint8)
    emu_ops.rt.d2h(raw, dw.data)
    moved = [type(dw)(**{**vars(dw), "data": _shifted(emu_ops, raw, 2)})]
    if dw.srow_bytes:
        sraw = np.empty(dw.rows * dw.srow_bytes, np.uint8)
        emu_ops.rt.d2h(sraw, dw.scales)
        for shift in (1, 2) if fmt in WORD_LOADS else (1,):
            moved.append(type(dw)(**{**vars(dw), "scales": _shifted(emu_ops, sraw, shift)}))
    for t in (1, 2, 5, 8):
        x = rng.standard_normal((t, cols)).astype(np.float32)
        want = x.astype(np.float64) @ wf.T.astype(np.float64)
        # float32 sums of ~4,600 products, relative to the sum of their magnitudes (one wrong
        # weight of 4,600 would be ~2e-4)
        scale = np.abs(x).astype(np.float64) @ np.abs(wf).T.astype(np.float64)
        for weight in (dw, *moved):
            got = emu_ops.linear(emu_ops.asarray(x), weight).numpy()
            err = np.max(np.abs(got - want) / scale)
            assert err < 2e-7, f"{fmt} T={t}: {err:.2e} of the sum of |x w|"  # measured <= 2.2e-8


@pytest.fixture(scope="module")
def decode_gfx1151() -> str:
    return machine_code.gfx1151_asm("decode.cu")


@pytest.mark.slow  # builds the kernels with nvcc / clang to read their instructions
@pytest.mark.parametrize("fmt", [f for f, _, _ in FAST_PATHS])
def test_gfx1151_dgemv_loops_read_global_128_bit(decode_gfx1151, fmt):
    """The fused step's weight loops on gfx1151 (one per body or more: clang unswitches): the
    row's pointers come from a table in memory, so without the global address space
    (quant.cuh ld_u4_readonly) they were flat_load_b128; now global_load_b128 for the codes, x
    from LDS, no byte loads, no scratch."""
    loops = _amd_loops(decode_gfx1151, f"dgemv_{fmt}")
    inner = [c for c in loops if not c["s_barrier"] and c["ds_load_b128"] >= 8]
    fast = [c for c in inner if c["global_load_b128"]]  # not the fallback (deq32's loads)
    assert len(fast) >= 3, f"dgemv_{fmt}: {len(fast)} loops with 16-byte global loads"
    for c in fast:
        assert c["global_load_b128"] >= ROW_LOADS[fmt] and not c["flat_load_b128"], c
        assert not any(op.endswith(("load_u8", "load_i8")) for op in c), c
    assert "scratch_" not in machine_code.amd_function(decode_gfx1151, f"dgemv_{fmt}")


@pytest.mark.parametrize("shift", [0, 1])
def test_nvfp4_every_block_scale_code(emu_ops, shift):
    """NVFP4's block scales through the GEMV's decode (quant.cuh e4m3x2_to_f32: the f16 route,
    which gfx1151, sm_80/86 and the emulator take): all 256 E4M3 codes, one per 16 weights,
    exact against the E4M3 table; a block with a NaN code makes its row NaN (shift 1 puts the
    NaN codes in the low byte of a lane's pair of scales, 0 in the high one)."""
    from tests.gpu.checks import E4M3, NVFP4

    rng = np.random.default_rng(2)
    rows, cols = 16, 256  # 16 blocks per row
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes = np.roll(np.arange(256, dtype=np.uint8), shift)
    w = NVFP4(packed, codes.reshape(rows, cols // 16), np.float32(1.0))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    got = emu_ops.linear(emu_ops.asarray(x), emu_ops.prepare_weight(w)).numpy()[0]
    nan_rows = sorted({int(np.flatnonzero(codes == c)[0]) // 16 for c in (0x7F, 0xFF)})
    finite = [r for r in range(rows) if r not in nan_rows]
    wf = w.dequantize()[finite].astype(np.float64)
    want, mag = x.astype(np.float64) @ wf.T, np.abs(x).astype(np.float64) @ np.abs(wf).T
    assert np.all(np.abs(got[finite] - want[0]) <= 1e-6 * mag[0]), (got[finite], want)
    assert np.isnan(got[nan_rows]).all() and np.isnan(E4M3[[0x7F, 0xFF]]).all()
