"""A static model of the decode GEMV: the fraction of copy bandwidth a kernel should reach on a
device, from what its compiled code holds, calibrated on the H200 run in docs/performance.md.

    python benchmarks/gemv_model.py [--arch sm_90] [--json]

Each warp makes passes over its row: it issues the loads of a pass (4 lane units of 32
weights per lane: N = 4,096 weights a warp), waits the memory latency L, then runs c
instructions per weight (ptxas's count, per lane), sharing the SM's four schedulers with the
SM's other W warps. Per SM that is X = W N / (L + W N c / (128 eta)) weights per cycle: latency-
bound (X ~ W N / L: bytes in flight, Little's law) with few warps or small passes, issue-bound
(X ~ 128 eta / c) with many. W follows from the registers (65,536 per SM, 256-thread blocks,
at most 8 blocks) and the shared memory; a partial last wave scales the result. The fraction
of copy bandwidth is X x bytes per weight x SMs x clock / copy rate, at most 1.

L is the memory's latency (HBM ~630 ns, LPDDR5X ~880: the bytes in flight an SM needs, ~23
KB on an H200, ~5 KB on a GB10). eta is fitted (least squares on log ratios) to the H200's
eight T = 1 GEMV figures with the code of that run (commit 2f63eb1: its ptxas registers and SASS
counts, in `CALIBRATION`): 0.57, residuals within -25% / +21%, printed. Those eight kernels all
ran 16 warps per SM, so they cannot tell L (fitting both, the error changes by a quarter
between 100 and 1,000 ns): which side binds on a GPU is the next run's question. The current
code's registers and instruction counts are read from NVRTC and cuobjdump
(tests/machine_code.py); nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PASS_WEIGHTS = 4 * 32 * 32  # a warp's pass: 4 lane units of 32 weights, 32 lanes
THREADS = 256
# bytes per weight as stored on the device (codes and scales)
BYTES_PER_WEIGHT = {
    "bf16": 2.0, "f16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "nvfp4": 18 / 32, "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256,
    "q5_0": 22 / 32, "q5_1": 24 / 32, "q3_k": 110 / 256, "iq4_nl": 18 / 32, "iq4_xs": 136 / 256,
}  # fmt: skip


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    clock_ghz: float
    copy_gbs: float  # device-to-device copy, read + written
    latency_ns: float  # memory latency under load
    smem_per_sm: int


DEVICES = {
    # measured copy rate (docs/performance.md)
    "H200": Device("H200", 132, 1.98, 4284, 630, 228 * 1024),
    # HBM3 3.35 TB/s at the H200's copy-to-peak ratio (4,284 / 4,800)
    "H100": Device("H100", 132, 1.98, 3350 * 4284 / 4800, 630, 228 * 1024),
    # LPDDR5X 273 GB/s at the same ratio
    "GB10": Device("GB10", 48, 2.4, 273 * 4284 / 4800, 880, 100 * 1024),
}


@dataclass(frozen=True)
class Kernel:
    fmt: str
    registers: int
    smem: int  # bytes per block
    per_weight: float  # instructions per weight per lane in the weight loop


# The H200 run (commit 2f63eb1, sm_90): gemv_<fmt> at T = 1, 16384 x 16384, its fraction of
# copy bandwidth, and that commit's ptxas registers and weight-loop instructions per weight.
CALIBRATION = [
    (Kernel("bf16", 121, 0, 2.77), 1.00),
    (Kernel("q8_0", 124, 0, 4.65), 0.75),
    (Kernel("q4_1", 116, 0, 4.01), 0.55),
    (Kernel("nvfp4", 109, 0, 4.76), 0.52),
    (Kernel("q4_0", 114, 0, 4.02), 0.49),
    (Kernel("q6_k", 117, 0, 5.33), 0.44),
    (Kernel("q5_k", 127, 0, 5.92), 0.39),
    (Kernel("q4_k", 111, 0, 4.75), 0.33),
]


def warps_per_sm(k: Kernel, dev: Device) -> int:
    """Resident warps: blocks of 256 threads as the registers (allocated in 8s) and shared
    memory allow, at most 8 blocks (64 warps)."""
    regs = -(-k.registers // 8) * 8
    by_regs = 65536 // (regs * THREADS)
    by_smem = dev.smem_per_sm // k.smem if k.smem else 8
    return 8 * max(0, min(8, by_regs, by_smem))


def fraction(k: Kernel, dev: Device, eta: float, rows: int = 16384) -> float:
    """The predicted fraction of `dev`'s copy bandwidth for a `rows`-row matrix."""
    w = warps_per_sm(k, dev)
    lat = dev.latency_ns * dev.clock_ghz  # cycles
    x = w * PASS_WEIGHTS / (lat + w * PASS_WEIGHTS * k.per_weight / (128 * eta))
    rows_per_wave = dev.sms * w  # a warp per row (gemv.cu; dgemv's two rows each are alike)
    waves = rows / rows_per_wave
    x *= waves / math.ceil(waves)
    gbs = x * BYTES_PER_WEIGHT[k.fmt] * dev.sms * dev.clock_ghz
    return min(1.0, gbs / dev.copy_gbs)


def calibrate() -> tuple[float, list[tuple[str, float, float]]]:
    """eta fitted to CALIBRATION; each format's (predicted, measured)."""
    h200 = DEVICES["H200"]

    def error(eta: float) -> float:
        return sum(math.log(fraction(k, h200, eta) / m) ** 2 for k, m in CALIBRATION)

    eta = min((e / 100 for e in range(10, 101)), key=error)
    return eta, [(k.fmt, fraction(k, h200, eta), m) for k, m in CALIBRATION]


def compiled_kernels(arch: str) -> list[Kernel]:
    """gemv_<fmt> (T = 1) of the current kernels/gemv.cu: registers from ptxas, the weight
    loop's instructions per weight from the SASS, as tests/test_kernels_sass.py reads them."""
    from atlas_cli.backend.ops.native import nvrtc
    from atlas_cli.backend.ops.native import runtime as rt
    from tests import machine_code
    from tests.test_kernels_sass import FAST_PATHS, _decode_loop

    out = nvrtc.compile_source(
        rt.expand_source("gemv.cu"), "gemv.cu", arch, extra_options=["--ptxas-options=-v"]
    )
    regs = dict(
        re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", out.log, re.S)
    )
    sass = machine_code.sass(out.binary)
    kernels = []
    for fmt, _, _ in FAST_PATHS:
        loop, weights = _decode_loop(sass, f"gemv_{fmt}")
        kernels.append(Kernel(fmt, int(regs[f"gemv_{fmt}"]), 0, sum(loop.values()) / weights))
    return kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="what to compile the current code for")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    eta, fits = calibrate()
    kernels = compiled_kernels(args.arch)
    rows = [
        {"fmt": k.fmt, "registers": k.registers, "per_weight": round(k.per_weight, 2)}
        | {d: round(fraction(k, dev, eta), 2) for d, dev in DEVICES.items()}
        for k in kernels
    ]
    if args.json:
        print(json.dumps({"eta": eta, "fit": fits, "rows": rows}))
        return
    print(f"fit on the H200 (commit 2f63eb1): issue efficiency eta {eta}")
    print("| format | predicted | measured |\n|---|---|---|")
    for fmt, pred, meas in fits:
        print(f"| {fmt} | {pred:.2f} | {meas:.2f} |")
    print(f"\ngemv T = 1, this code ({args.arch}): predicted fraction of copy bandwidth")
    print("| format | registers | instr/weight | " + " | ".join(DEVICES) + " |")
    print("|---|---|---|" + "---|" * len(DEVICES))
    for r in rows:
        cells = " | ".join(f"{r[d]:.2f}" for d in DEVICES)
        print(f"| {r['fmt']} | {r['registers']} | {r['per_weight']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
