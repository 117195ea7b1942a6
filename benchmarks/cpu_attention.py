"""Times the fast CPU path's attention on random arrays: prefill (`cpu_fast.attention`, a block
of new queries after a cached prefix) and the decode step's one GQA group
(`cpu_decode.attend_group`), each checked against numpy_ref.attention first.

    ATLAS_THREADS=1 python benchmarks/cpu_attention.py
    ATLAS_THREADS=1 python benchmarks/cpu_attention.py --queries 256 --heads 16 --kv-heads 8 \
        --head-dim 128 --cached 0,256,2048 --decode-positions 2055
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _median_ms(fn, reps: int) -> float:
    fn()  # load the kernels
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def prefill(args, rng) -> None:
    from atlas_cli.backend.ops import numpy_ref
    from atlas_cli.backend.ops.cpu import fast as cpu_fast

    t, nh, nkv, hd = args.queries, args.heads, args.kv_heads, args.head_dim
    print(f"prefill: {t} queries, {nh} heads, {nkv} KV heads of {hd}, float32 cache")
    for start in args.cached:
        q = rng.standard_normal((t, nh, hd)).astype(np.float32)
        k, v = (rng.standard_normal((nkv, start + t, hd)).astype(np.float32) for _ in range(2))
        want = numpy_ref.attention(q, k, v, start)
        err = np.abs(cpu_fast.attention(q, k, v, start) - want).max() / np.abs(want).max()
        ms = _median_ms(functools.partial(cpu_fast.attention, q, k, v, start), args.reps)
        print(f"  after {start:>6,} cached tokens: {ms:8.1f} ms  (max |diff| / max {err:.1e})")


def decode(args, rng) -> None:
    from atlas_cli.backend.ops import numpy_ref
    from atlas_cli.backend.ops.cpu import decode as cpu_decode
    from atlas_cli.backend.ops.cpu.kernels import kv_bits

    n, g, hd = args.decode_positions, args.heads // args.kv_heads, args.head_dim
    print(f"decode: one GQA group of {g} query heads of {hd} at {n:,} positions")
    for dtype in (np.float16, np.float32):
        q = rng.standard_normal(g * hd).astype(np.float32)
        k, v = (rng.standard_normal((n, hd)).astype(dtype) for _ in range(2))
        scores, out = np.empty((g, n), np.float32), np.empty(g * hd, np.float32)
        scale = np.float32(1.0 / np.sqrt(hd))
        step = functools.partial(
            cpu_decode.attend_group, q, kv_bits(k), kv_bits(v), n, scale, scores, out
        )
        step()
        keys, vals = (a[None].astype(np.float32) for a in (k, v))
        want = numpy_ref.attention(q.reshape(1, g, hd), keys, vals, n - 1).reshape(-1)
        err = np.abs(out - want).max() / np.abs(want).max()
        us = _median_ms(step, 10 * args.reps) * 1e3
        print(f"  {np.dtype(dtype).name} cache: {us:8.0f} us  (max |diff| / max {err:.1e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cached", type=_ints, default=[0, 256, 2048], help="comma-separated")
    ap.add_argument("--decode-positions", type=int, default=2055)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prefill(args, rng)
    decode(args, rng)


if __name__ == "__main__":
    main()
