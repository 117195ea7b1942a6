#!/usr/bin/env python3
"""Fuzz the model loaders: mutated GGUF files and Hugging Face directories, each loaded and run
for a few tokens in a worker subprocess with a time limit and a memory cap.

    python scripts/fuzz_models.py --cases 1000            # GGUF, HF and the default model's header
    python scripts/fuzz_models.py --cases 200 --kinds hf  # one kind
    python scripts/fuzz_models.py --devices cpu           # the fast CPU path only

Cases come from tests/model_mutations.py (seeded: case i of a kind is the same every run), and
run on the devices in turn (the numpy reference and the fast CPU path's numba kernels, whose
disk cache is compiled once before the cases start). A worker process runs case after case
under RLIMIT_AS (4 GB by default); a case that takes over the timeout (10 s) is a hang, a worker
killed by a signal is a crash, a MemoryError or an allocation refused by the cap is a memory
blow-up, and any exception but an AtlasError is a traceback. Bad cases are kept under --keep
for reproduction. Prints the counts and the slowest case; exits 1 unless tracebacks, hangs,
crashes and blow-ups are all 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BAD = ("traceback", "hang", "crash", "memory blow-up")


def worker(limit_bytes: int) -> None:
    """Read "device<TAB>case path" lines on stdin, answer one JSON line each."""
    from tests.model_mutations import run_case

    for line in sys.stdin:
        device, path = line.rstrip("\n").split("\t")
        try:
            outcome = run_case(Path(path), device)
            reply = {"outcome": "load" if outcome == "load" else "clean error"}
        except MemoryError:
            reply = {"outcome": "memory blow-up", "error": "MemoryError"}
        except BaseException as exc:  # noqa: BLE001  (what the fuzzer is here to find)
            last = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(last.filename).name}:{last.lineno}"
            reply = {"outcome": "traceback", "error": f"{type(exc).__name__}: {exc} at {where}"}
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if peak_kb * 1024 > limit_bytes:
            reply = {"outcome": "memory blow-up", "error": f"peak RSS {peak_kb // 1024} MB"}
        print(json.dumps(reply), flush=True)


class Worker:
    """One worker subprocess under the memory cap; restarted after a hang or a crash."""

    def __init__(self, home: Path, limit_bytes: int, kernel_cache: Path):
        self.home, self.limit, self.proc = home, limit_bytes, None
        self.kernel_cache = kernel_cache

    def start(self) -> None:
        def cap():
            resource.setrlimit(resource.RLIMIT_AS, (self.limit, self.limit))

        env = {
            **os.environ,
            "ATLAS_HOME": str(self.home),
            "NUMBA_CACHE_DIR": str(self.kernel_cache),
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--memory-gb", str(self.limit / 2**30)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            preexec_fn=cap,
            env=env,
        )

    def run(self, device: str, path: Path, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(f"{device}\t{path}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            self.stop()
            return {"outcome": "hang", "error": f"no answer in {timeout:.0f} s"}
        code = self.proc.wait()
        self.proc = None
        if code == -9 or code == 137:  # killed: the kernel's answer to a runaway allocation
            return {"outcome": "memory blow-up", "error": f"killed (exit {code})"}
        return {"outcome": "crash", "error": f"worker exited with {code}"}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def default_model() -> Path | None:
    """The embedded default model's GGUF file, when the store has it (no download)."""
    try:
        from atlas_cli.store import embedded, locate

        return locate.resolve(embedded.DEFAULT_MODEL, offline=True)
    except Exception:  # noqa: BLE001  (no real header to mutate: fuzz the fixtures only)
        return None


def plan(cases: int, kinds: list[str], devices: list[str]) -> list[tuple[str, int, str]]:
    """Case i goes to kind i % len(kinds) ("real" gets a tenth of its share's weight); the
    seeds of each kind take the devices in turn."""
    weights = {"gguf": 9, "hf": 9, "real": 2}
    pool = [k for k in kinds for _ in range(weights[k])]
    seen: collections.Counter = collections.Counter()
    out = []
    for i in range(cases):
        kind = pool[i % len(pool)]
        seed = seen[kind]
        out.append((kind, seed, devices[seed % len(devices)]))
        seen[kind] += 1
    return out


def warm_kernels(devices: list[str], kernel_cache: Path) -> None:
    """Compile the fast CPU path's kernels into their disk cache (minutes, once), so that no
    case's time limit counts the compilation. In a subprocess: numba's thread pool in this
    process would be forked by every worker start."""
    if "cpu" not in devices:
        return
    t0 = time.perf_counter()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(kernel_cache)}
    code = "from tests.model_mutations import warm_kernels; warm_kernels()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
    print(f"kernels ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--kinds", default="gguf,hf,real", help="comma-separated: gguf, hf, real")
    ap.add_argument("--devices", default="cpu-ref,cpu", help="comma-separated: cpu-ref, cpu")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="RLIMIT_AS of each worker")
    ap.add_argument("--keep", type=Path, default=Path("fuzz-failures"), help="bad cases go here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    limit = int(args.memory_gb * 2**30)
    if args.worker:
        worker(limit)
        return 0

    from atlas_cli.backend.ops.cpu.jit import kernel_cache_dir  # (jit imports no numba)
    from tests.model_mutations import make_case

    kinds, devices = args.kinds.split(","), args.devices.split(",")
    real = default_model() if "real" in kinds else None
    if "real" in kinds and real is None:
        print("default model not in the store: skipping the 'real' kind", file=sys.stderr)
        kinds.remove("real")
    todo = plan(args.cases, kinds, devices)
    warm_kernels(devices, kernel_cache_dir())
    counts: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    slowest = (0.0, "")
    lock = threading.Lock()
    scratch = Path(tempfile.mkdtemp(prefix="atlas-fuzz-"))

    def lane(n: int) -> None:
        nonlocal slowest
        w = Worker(scratch / f"home{n}", limit, kernel_cache_dir())
        try:
            for i in range(n, len(todo), args.workers):
                kind, seed, device = todo[i]
                case_dir = scratch / f"case{i}"
                path, what = make_case(kind, seed, case_dir, real_gguf=real)
                t0 = time.perf_counter()
                result = w.run(device, path, args.timeout)
                seconds = time.perf_counter() - t0
                with lock:
                    counts[result["outcome"]] += 1
                    by_kind[(kind, result["outcome"])] += 1
                    slowest = max(slowest, (seconds, f"{kind} #{seed} on {device} ({what})"))
                    if result["outcome"] in BAD:
                        print(
                            f"{result['outcome']}: {kind} #{seed} on {device} ({what}): "
                            f"{result['error']}"
                        )
                        shutil.copytree(case_dir, args.keep / f"{kind}-{seed}", dirs_exist_ok=True)
                shutil.rmtree(case_dir, ignore_errors=True)
        finally:
            w.stop()

    threads = [threading.Thread(target=lane, args=(n,)) for n in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shutil.rmtree(scratch, ignore_errors=True)
    per_kind = collections.Counter(kind for kind, _, _ in todo)
    print(
        f"{len(todo)} cases ({', '.join(f'{k} {per_kind[k]}' for k in kinds)}) on "
        f"{' and '.join(devices)}"
    )
    for outcome in ("clean error", "load", *BAD):
        detail = ", ".join(f"{k} {by_kind[(k, outcome)]}" for k in kinds)
        print(f"  {outcome:15} {counts[outcome]:5}   ({detail})")
    print(f"slowest case: {slowest[0]:.1f} s, {slowest[1]}")
    return 1 if any(counts[b] for b in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
