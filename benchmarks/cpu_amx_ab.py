"""A/B of the prefill products of Q4_K/Q5_K: AMX tiles (cpu_amx.py) against int16 (cpu_prefill).

Both in one process on the same matrices of a GGUF file, interleaved, medians reported (the
machine's load changes from second to second). Per Q4_K/Q5_K projection shape of layer 0, N
tokens (--pp); then a whole prefill of N tokens with ATLAS_CPU_AMX=0 and unset, alternated.

    ATLAS_THREADS=1 python benchmarks/cpu_amx_ab.py --model qwen3-0.6b-Q4_K_M.gguf --pp 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

SIDES = ("int16", "amx")


def _seconds(kernel, m, x, out, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel(*m.kernel_args, m.perm, x, out)
    return (time.perf_counter() - t0) / reps


def per_shape(model, rounds: int, n_tok: int) -> None:
    from atlas_cli.backend.ops.cpu import amx as cpu_amx
    from atlas_cli.backend.ops.cpu import fast as cpu_fast
    from atlas_cli.backend.ops.cpu import prefill as cpu_prefill

    seen = {}
    for name, m in model.engine.model.w.items():
        packed = isinstance(m, cpu_fast.PackedMatrix) and m.type_id in cpu_amx.AMX_TYPES
        if "layers.0." in name and packed:
            seen.setdefault((name.split(".")[-2], m.shape, m.type_id), m)
    rng = np.random.default_rng(0)
    print(f"{n_tok} tokens per product")
    print(f"{'matrix':<12} {'shape':>14} {'type':>5} {'int16 ms':>9} {'amx ms':>9} {'ratio':>6}")
    kernels = (cpu_prefill.gemm_int16, cpu_amx.gemm_amx)
    for (short, shape, _type), m in sorted(seen.items(), key=str):
        x = rng.standard_normal((n_tok, shape[1])).astype(np.float32)
        out = np.empty((n_tok, shape[0]), np.float32)
        reps = max(1, int(1e9 / (shape[0] * shape[1] * n_tok)))
        times = {side: [] for side in SIDES}
        for kern in kernels:
            kern(*m.kernel_args, m.perm, x, out)  # load
        for _ in range(rounds):
            for side, kern in zip(SIDES, kernels, strict=True):
                times[side].append(_seconds(kern, m, x, out, reps))
        a, b = (statistics.median(times[side]) * 1e3 for side in SIDES)
        print(f"{short:<12} {str(shape):>14} {m.format.name:>5} {a:9.2f} {b:9.2f} {a / b:6.2f}")


def end_to_end(model, rounds: int, pp: int) -> None:
    engine, rates = model.engine, {side: [] for side in SIDES}
    for _ in range(rounds):
        for side in SIDES:
            os.environ["ATLAS_CPU_AMX"] = "0" if side == "int16" else "1"
            engine.reset()
            t0 = time.perf_counter()
            engine.prefill(list(range(1000, 1000 + pp)))
            rates[side].append(pp / (time.perf_counter() - t0))
    medians = {side: statistics.median(rates[side]) for side in SIDES}
    for side, r in rates.items():
        print(f"pp{pp} {side:>6}: median {medians[side]:6.1f} tok/s ({min(r):.1f}-{max(r):.1f})")
    print(f"pp{pp} amx / int16: {medians['amx'] / medians['int16']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file with Q4_K or Q5_K matrices")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pp", type=int, default=512, help="tokens per product and per prefill")
    args = ap.parse_args()
    from atlas_cli.backend.ops.cpu import amx as cpu_amx
    from atlas_cli.session import open_model

    if not cpu_amx.checked():
        raise SystemExit("this CPU has no (working) AMX: nothing to compare")
    print(
        f"load average {os.getloadavg()[0]:.1f}, threads {os.environ.get('ATLAS_THREADS', 'all')}"
    )
    model = open_model(args.model, device="cpu", ctx_size=args.pp + 16)
    per_shape(model, args.rounds, args.pp)
    end_to_end(model, args.rounds, args.pp)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
