"""The Gated DeltaNet prefill on the CPU: the token loop against the chunked forms.

One process, random inputs of a Qwen3.5 linear-attention layer (16 value heads on 16 key heads
of 128, as the 0.8B model has them; `--heads`, `--dim`), T tokens; interleaved rounds, medians:

- token loop: numpy_ref.gated_delta_rule, one token at a time (what a prefill without the
  chunked form does);
- numpy chunked: numpy_ref.gated_delta_rule_chunked (BLAS matmuls, on one BLAS thread);
- atlas chunked: cpu_gdn.gated_delta_rule_chunked (numba, the fast path's).

    ATLAS_THREADS=1 python benchmarks/cpu_gdn_prefill.py --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from atlas_cli.backend.ops import numpy_ref as ref
    from atlas_cli.backend.ops.cpu import fast as cpu_fast
    from atlas_cli.backend.ops.cpu import gdn as cpu_gdn

    rng = np.random.default_rng(0)
    t, h, d = args.tokens, args.heads, args.dim
    q = ref.l2norm(rng.standard_normal((t, h, d)).astype(np.float32))
    k = ref.l2norm(rng.standard_normal((t, h, d)).astype(np.float32))
    v = rng.standard_normal((t, h, d)).astype(np.float32)
    a_log = rng.uniform(0, 2, h).astype(np.float32)  # log-decays as the model makes them
    g = -np.exp(a_log) * ref.softplus(rng.standard_normal((t, h)).astype(np.float32))
    beta = ref.sigmoid(rng.standard_normal((t, h)).astype(np.float32))
    state = np.zeros((h, d, d), np.float32)
    inputs = (q, k, v, g, beta, state)

    def numpy_chunked(*a):
        with cpu_fast.single_blas_thread():
            return ref.gated_delta_rule_chunked(*a)

    ways = {
        "token loop": ref.gated_delta_rule,
        "numpy chunked": numpy_chunked,
        "atlas chunked": cpu_gdn.gated_delta_rule_chunked,
    }
    cpu_gdn.gated_delta_rule_chunked(*(x[:2] for x in inputs[:5]), state)  # load the kernel
    times = {name: [] for name in ways}
    outs = {}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            outs[name] = fn(*inputs)
            times[name].append(time.perf_counter() - t0)
    print(
        f"{t} tokens, {h} heads of {d}, threads {os.environ.get('ATLAS_THREADS', 'all')}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    loop = statistics.median(times["token loop"])
    for name, ts in times.items():
        med = statistics.median(ts)
        err = float(np.abs(outs[name][0] - outs["token loop"][0]).max())
        print(
            f"{name:>14}: median {med * 1e3:8.1f} ms [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}]"
            f"  {loop / med:5.2f}x the token loop  max |out - loop's| {err:.1e}"
        )


if __name__ == "__main__":
    main()
