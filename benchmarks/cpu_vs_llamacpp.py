"""atlas's CPU path and llama.cpp side by side on the same GGUF files.

    python benchmarks/cpu_vs_llamacpp.py                       # the default model, 1 and 2 threads
    python benchmarks/cpu_vs_llamacpp.py --model a.gguf --model b.gguf -t 1,2 --rounds 5 \\
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python

llama.cpp runs through llama-cpp-python, in `--llama-python` (default: this interpreter), so
atlas's environment need not have it. Random-weight files of real shapes:
benchmarks/make_random_gguf.py.

For every model and thread count, each of `--rounds` rounds starts one fresh process per engine
(atlas first in even rounds, llama.cpp first in odd ones, so a change in machine load hits both)
that measures, after a short warm-up:

- ppN: N prompt tokens from an empty cache, tokens/s (`--pp`, default 512 and 2048);
- tgN: N greedy tokens, one per forward, after a 1-token prompt, tokens/s (`--tg`, 128);
- tgN@dD: N tokens after a D-token prompt (`--depth-tg`, `--depth`: 64 after 2048);
- peak RSS of the whole process (from wait4).

It prints median [min-max] per engine, the ratio of the medians (atlas / llama.cpp, above 1 is
better for tok/s) and the load average at the start, after each round and with the table. Both
engines get the same thread count (and BLAS, numba and OpenMP pools of that size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run from a checkout without installing: this repository's atlas_cli, here and in the children
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The same token ids for both engines: spread over the vocabulary, no special tokens."""
    span = max(1, min(20_000, vocab - 1_000))
    return [min(vocab - 1, 100 + (i * 37) % span) for i in range(n)]


def plan(args) -> list[tuple[str, str, int, int]]:
    """(label, kind, prompt tokens, generated tokens) of every test, in the order run."""
    tests = [(f"pp{n}", "pp", n, 0) for n in args.pp]
    if args.tg:
        tests.append((f"tg{args.tg}", "tg", 1, args.tg))
    if args.depth_tg:
        tests.append((f"tg{args.depth_tg}@d{args.depth}", "tg", args.depth, args.depth_tg))
    return tests


# ---------------------------------------------------------------------------------------------
# workers: each runs in its own process and prints one JSON line of tok/s per test


def work_atlas(args) -> dict:
    import numpy as np

    from atlas_cli.session import open_model

    m = open_model(args.model[0], device="cpu", ctx_size=context_size(args))
    engine = m.engine
    vocab = engine.model.args.vocab_size
    engine.prefill(prompt_ids(8, vocab))  # first calls load the cached kernels: not timed
    engine.reset()
    out = {}
    for label, kind, n_prompt, n_gen in plan(args):
        engine.reset()
        t0 = time.perf_counter()
        logits, _ = engine.prefill(prompt_ids(n_prompt, vocab))
        if kind == "pp":
            out[label] = n_prompt / (time.perf_counter() - t0)
            continue
        token = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            token = int(np.argmax(engine.step(token)))
        out[label] = n_gen / (time.perf_counter() - t0)
    import numba

    out["_layer"] = f"numba {numba.threading_layer()}, {numba.get_num_threads()} threads"
    return out


def work_llama(args) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t = args.threads[0]
    llm = Llama(
        args.model[0], n_ctx=context_size(args), n_batch=512, n_ubatch=512,
        n_threads=t, n_threads_batch=t, verbose=False,
    )  # fmt: skip
    vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    llm.eval(prompt_ids(8, vocab))  # warm-up, as for atlas
    out = {}
    for label, kind, n_prompt, n_gen in plan(args):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_ids(n_prompt, vocab))
        if kind == "pp":
            out[label] = n_prompt / (time.perf_counter() - t0)
            continue
        token = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
        out[label] = n_gen / (time.perf_counter() - t0)
    import llama_cpp

    out["_layer"] = f"llama-cpp-python {llama_cpp.__version__}"
    return out


def context_size(args) -> int:
    return max([*args.pp, 1 + args.tg, args.depth + args.depth_tg]) + 16


# ---------------------------------------------------------------------------------------------
# the driver


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(
        ATLAS_THREADS=str(threads),
        NUMBA_NUM_THREADS=str(threads),
        OMP_NUM_THREADS=str(threads),
        OPENBLAS_NUM_THREADS=str(threads),
        NO_COLOR="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return env


def run_worker(python: str, engine: str, model: str, threads: int, args) -> dict:
    """One measuring process; its results plus its peak RSS in MB (wait4: the child's own)."""
    cmd = [
        python, __file__, "--worker", engine, "--model", model, "-t", str(threads),
        "--pp", ",".join(map(str, args.pp)), "--tg", str(args.tg),
        "--depth", str(args.depth), "--depth-tg", str(args.depth_tg),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as err:  # a file: a chatty stderr cannot block the pipe
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=_env(threads))
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            sys.exit(f"{engine} on {Path(model).name} failed:\n{err.read().decode()[-2000:]}")
    res = json.loads(out.decode().strip().splitlines()[-1])
    res["peak RSS MB"] = usage.ru_maxrss / 1024
    return res


Rows = dict[tuple[str, int, str], dict[str, list[float]]]  # (model, threads, engine) -> test


def measure(args) -> Rows:
    rows: Rows = {}
    engines = [("atlas", sys.executable), ("llama.cpp", args.llama_python)]
    for r in range(args.rounds):
        for model in args.model:
            for t in args.threads:
                for engine, python in engines if r % 2 == 0 else engines[::-1]:
                    res = run_worker(python, engine, model, t, args)
                    row = rows.setdefault((model, t, engine), {})
                    for key, value in res.items():
                        row.setdefault(key, []).append(value)
        print(f"round {r + 1}/{args.rounds} done, load avg {_load()}", flush=True)
    return rows


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def print_table(args, rows: Rows) -> None:
    print(f"\nload avg (1, 5, 15 min) at the end: {_load()}")
    print("ratio = atlas / llama.cpp (medians): above 1 is better for tok/s, worse for RSS")
    tests = [label for label, *_ in plan(args)] + ["peak RSS MB"]
    for model in args.model:
        size = Path(model).stat().st_size / 1e6
        for t in args.threads:
            a, b = rows[(model, t, "atlas")], rows[(model, t, "llama.cpp")]
            print(f"\n{Path(model).name} ({size:.0f} MB), {t} thread(s)")
            print(f"  atlas: {a['_layer'][0]}; llama.cpp: {b['_layer'][0]}")
            print(f"  {'test':14s} {'atlas tok/s':>24s} {'llama.cpp tok/s':>24s}  ratio")
            for test in tests:
                ratio = statistics.median(a[test]) / statistics.median(b[test])
                print(f"  {test:14s} {_stats(a[test]):>24s} {_stats(b[test]):>24s}  {ratio:5.2f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="GGUF file (repeatable; default: atlas's)")
    ap.add_argument("-t", "--threads", type=_ints, default=[1, 2], help="comma list: 1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pp", type=_ints, default=[512, 2048], help="prompt sizes, comma list")
    ap.add_argument("--tg", type=int, default=128, help="tokens generated from an empty cache")
    ap.add_argument("--depth", type=int, default=2048, help="prompt before --depth-tg")
    ap.add_argument("--depth-tg", type=int, default=64, help="tokens generated after --depth")
    ap.add_argument("--llama-python", default=sys.executable, help="Python with llama_cpp")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.depth_tg and args.depth < 1:
        ap.error("--depth must be at least 1 (the prompt before --depth-tg); --depth-tg 0 skips")
    if args.worker:
        work = work_atlas if args.worker == "atlas" else work_llama
        print(json.dumps(work(args)))
        return
    if not args.model:
        from atlas_cli.store.embedded import DEFAULT_MODEL
        from atlas_cli.store.locate import resolve

        args.model = [str(resolve(DEFAULT_MODEL))]
    check = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True, text=True,
    )  # fmt: skip
    if check.returncode:
        sys.exit(f"{args.llama_python} has no llama_cpp: pip install llama-cpp-python there")
    print(f"machine    {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"llama.cpp  llama-cpp-python {check.stdout.strip()} ({args.llama_python})")
    print(f"tests      {', '.join(label for label, *_ in plan(args))}; threads {args.threads}")
    print(f"load avg   {_load()} at the start", flush=True)
    print_table(args, measure(args))


if __name__ == "__main__":
    main()
