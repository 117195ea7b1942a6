"""A/B of the fast CPU path's decode products: float32 activations against int8 ones.

Both run in one process on the same matrices of a GGUF file, interleaved (float, int8, float,
...), and the medians are reported: on a shared machine the load changes from second to
second, and alternating exposes both sides to it alike. Per projection shape of layer 0 (each
GGUF type that shape has in the file) and the lm_head, one token; then end-to-end decode
(tokens per second over --tg steps after a short prompt).

    ATLAS_THREADS=1 python benchmarks/cpu_int8_ab.py --model qwen3-0.6b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

MODES = ("float32", "int8")


def _time_gemv(kernel, m, x, out, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel(*m.kernel_args, m.perm, x, out)
    return (time.perf_counter() - t0) / reps


def per_shape(model, rounds: int) -> None:
    from atlas_cli.backend.ops import cpu_fast
    from atlas_cli.backend.ops import cpu_kernels as k

    w = model.engine.model.w
    seen = {}
    for name, m in w.items():
        if isinstance(m, cpu_fast.PackedMatrix) and m.type_id in k.INT8_TYPES:
            short = name.split(".")[-2] if "layers." in name else name
            seen.setdefault((short, m.shape, m.type_id), m)
    rng = np.random.default_rng(0)
    print(f"{'matrix':<24} {'shape':>14} {'type':>5} {'f32 us':>9} {'int8 us':>9} {'ratio':>6}")
    for (short, shape, _type), m in sorted(seen.items(), key=str):
        x = rng.standard_normal((1, shape[1])).astype(np.float32)
        out = np.empty((1, shape[0]), np.float32)
        reps = max(1, int(2e8 / (shape[0] * shape[1])))
        times = {mode: [] for mode in MODES}
        for kern in (k.gemv_batch, k.gemv_batch_int8):
            kern(*m.kernel_args, m.perm, x, out)  # load
        for _ in range(rounds):
            times["float32"].append(_time_gemv(k.gemv_batch, m, x, out, reps))
            times["int8"].append(_time_gemv(k.gemv_batch_int8, m, x, out, reps))
        f, i = (statistics.median(times[mode]) * 1e6 for mode in MODES)
        fmt = m.format.name
        print(f"{short:<24} {str(shape):>14} {fmt:>5} {f:9.1f} {i:9.1f} {f / i:6.2f}")


def end_to_end(model, rounds: int, tg: int) -> None:
    engine = model.engine
    rates = {mode: [] for mode in MODES}
    prompt = list(range(1000, 1016))
    for _ in range(rounds):
        for mode in MODES:
            os.environ["ATLAS_CPU_ACTIVATIONS"] = mode
            engine.reset()
            logits, _ = engine.prefill(prompt)
            token = int(np.argmax(logits))
            t0 = time.perf_counter()
            for _ in range(tg):
                token = int(np.argmax(engine.step(token)))
            rates[mode].append(tg / (time.perf_counter() - t0))
    for mode in MODES:
        r = rates[mode]
        print(
            f"tg{tg} {mode:>8}: median {statistics.median(r):6.2f} tok/s  "
            f"(min {min(r):.2f}, max {max(r):.2f}, {len(r)} rounds)"
        )
    f, i = (statistics.median(rates[mode]) for mode in MODES)
    print(f"tg{tg} int8 / float32: {i / f:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    from atlas_cli.session import open_model

    print(
        f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}, "
        f"threads {os.environ.get('ATLAS_THREADS', 'all')}"
    )
    model = open_model(args.model, device="cpu")
    if not args.skip_shapes:
        per_shape(model, args.rounds)
    if not args.skip_decode:
        end_to_end(model, args.rounds, args.tg)
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}")


if __name__ == "__main__":
    main()
