"""A/B of the fast CPU path's products: float32 activations against integer ones.

Both run in one process on the same matrices of a GGUF file, interleaved (float, integer,
float, ...), and the medians are reported: on a shared machine the load changes from second to
second, and alternating exposes both sides to it alike. Per projection shape of layer 0 (each
GGUF type that shape has in the file) and the lm_head: one token (decode: int8 x, the
`gemv_batch_int8` kernel) or, with --pp N, N tokens (prefill: int16 x, `gemm_int16`, for the
K-quants); then end to end, decode over --tg steps after a short prompt and, with --pp, the
prefill of an N-token prompt.

    ATLAS_THREADS=1 python benchmarks/cpu_int8_ab.py --model qwen3-0.6b-Q4_K_M.gguf
    ATLAS_THREADS=1 python benchmarks/cpu_int8_ab.py --model qwen3-0.6b-Q4_K_M.gguf --pp 512
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


def per_shape(model, rounds: int, n_tok: int) -> None:
    from atlas_cli.backend.ops.cpu import fast as cpu_fast
    from atlas_cli.backend.ops.cpu import gemv_int8
    from atlas_cli.backend.ops.cpu import kernels as k
    from atlas_cli.backend.ops.cpu import prefill as cpu_prefill

    if n_tok == 1:
        kernels, integer_types = (k.gemv_batch, gemv_int8.gemv_batch_int8), k.INT8_TYPES
    else:
        kernels, integer_types = (k.gemm, cpu_prefill.gemm_int16), cpu_prefill.INT16_TYPES

    w = model.engine.model.w
    seen = {}
    for name, m in w.items():
        if isinstance(m, cpu_fast.PackedMatrix) and m.type_id in integer_types:
            short = name.split(".")[-2] if "layers." in name else name
            if n_tok > 1 and "layers." not in name:
                continue  # prefill multiplies only the last token by the lm_head
            seen.setdefault((short, m.shape, m.type_id), m)
    rng = np.random.default_rng(0)
    print(f"{n_tok} token(s) per product")
    print(f"{'matrix':<24} {'shape':>14} {'type':>5} {'f32 us':>9} {'int us':>9} {'ratio':>6}")
    for (short, shape, _type), m in sorted(seen.items(), key=str):
        x = rng.standard_normal((n_tok, shape[1])).astype(np.float32)
        out = np.empty((n_tok, shape[0]), np.float32)
        reps = max(1, int(2e8 / (shape[0] * shape[1] * n_tok)))
        times = {mode: [] for mode in MODES}
        for kern in kernels:
            kern(*m.kernel_args, m.perm, x, out)  # load
        for _ in range(rounds):
            for mode, kern in zip(MODES, kernels, strict=True):
                times[mode].append(_time_gemv(kern, m, x, out, reps))
        f, i = (statistics.median(times[mode]) * 1e6 for mode in MODES)
        fmt = m.format.name
        print(f"{short:<24} {str(shape):>14} {fmt:>5} {f:9.1f} {i:9.1f} {f / i:6.2f}")


def end_to_end(model, rounds: int, tg: int, pp: int) -> None:
    engine = model.engine
    rates = {(what, mode): [] for what in ("pp", "tg") for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            os.environ["ATLAS_CPU_ACTIVATIONS"] = mode
            if pp:
                engine.reset()
                t0 = time.perf_counter()
                engine.prefill(list(range(1000, 1000 + pp)))
                rates["pp", mode].append(pp / (time.perf_counter() - t0))
            engine.reset()
            logits, _ = engine.prefill(list(range(1000, 1016)))
            token = int(np.argmax(logits))
            t0 = time.perf_counter()
            for _ in range(tg):
                token = int(np.argmax(engine.step(token)))
            rates["tg", mode].append(tg / (time.perf_counter() - t0))
    for what, n in (("pp", pp), ("tg", tg)):
        if not n:
            continue
        for mode in MODES:
            r = rates[what, mode]
            print(
                f"{what}{n} {mode:>8}: median {statistics.median(r):6.2f} tok/s  "
                f"(min {min(r):.2f}, max {max(r):.2f}, {len(r)} rounds)"
            )
        f, i = (statistics.median(rates[what, mode]) for mode in MODES)
        print(f"{what}{n} integer / float32: {i / f:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--pp", type=int, default=0, help="also time prefill products of N tokens")
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
        per_shape(model, args.rounds, 1)
        if args.pp:
            per_shape(model, args.rounds, args.pp)
    if not args.skip_decode:
        end_to_end(model, args.rounds, args.tg, args.pp)
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}")


if __name__ == "__main__":
    main()
