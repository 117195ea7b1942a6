"""Decode steps of an earlier revision and of this checkout, in one process, interleaved.

    python benchmarks/cpu_decode_ab.py --base HEAD~1 --model qwen35-0.8b-Q4_K_M.gguf -t 1 -t 2

This machine's speed drifts by a third within minutes, so two processes measured one after the
other can disagree by more than a change is worth. Here both versions load the same GGUF in one
process: the base revision's `atlas_cli` is extracted with `git archive` into a temporary folder
and renamed to `atlas_base` (its imports rewritten), so both packages live side by side with
their own numba caches. Each round times `--steps` decode steps (`engine.step`: the fused step
and the lm_head) of one version, then of the other, on the same token at growing positions
after a `--depth`-token prompt; the table has the per-round medians, their median, and the
largest logit difference of the last step (0 when the change keeps the results bit for bit).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_PACKAGE = "atlas_base"


def extract_base(rev: str, into: Path) -> None:
    """`rev`'s atlas_cli as the package atlas_base under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "atlas_cli"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / BASE_PACKAGE
    (into / "atlas_cli").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\batlas_cli\b", BASE_PACKAGE, text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare against")
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("-t", "--threads", type=int, action="append", help="repeatable (default 1)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round and version")
    ap.add_argument("--depth", type=int, default=3, help="prompt tokens before the steps")
    ap.add_argument("--ctx-size", type=int, default=1024)
    args = ap.parse_args()
    if args.depth + 4 + args.rounds * args.steps > args.ctx_size:
        sys.exit("--ctx-size is too small for --rounds x --steps")
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(args.base, Path(tmp))
        sys.path[:0] = [tmp, str(REPO)]
        import numba
        import numpy as np
        from atlas_base.session import open_model as open_base

        from atlas_cli.session import open_model as open_this

        engines = {
            f"{args.base}": open_base(args.model, device="cpu", ctx_size=args.ctx_size).engine,
            "this checkout": open_this(args.model, device="cpu", ctx_size=args.ctx_size).engine,
        }
        for threads in args.threads or [1]:
            numba.set_num_threads(threads)
            times = {name: [] for name in engines}
            last = {}
            for e in engines.values():
                e.reset()
                e.prefill([100 + (i * 37) % 20_000 for i in range(args.depth)])
                e.step(5)  # first calls load the cached kernels: not timed
            for _ in range(args.rounds):
                for name, e in engines.items():
                    steps = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        last[name] = e.step(5)
                        steps.append(time.perf_counter() - t0)
                    times[name].append(1000 * statistics.median(steps))
            print(f"\n{Path(args.model).name}, {threads} thread(s): ms per decode step")
            for name, per_round in times.items():
                rounds = " ".join(f"{v:.1f}" for v in per_round)
                print(f"  {name:16s} median {statistics.median(per_round):7.2f}   rounds {rounds}")
            a, b = (np.asarray(v, np.float64) for v in last.values())
            print(f"  logits: max |difference| {np.abs(a - b).max():.3g} of max |logit| "
                  f"{np.abs(a).max():.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
