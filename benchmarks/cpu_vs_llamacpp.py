"""atlas's CPU path and llama.cpp side by side on the same GGUF file.

    pip install llama-cpp-python            # benchmark-only dependency (builds llama.cpp)
    python benchmarks/cpu_vs_llamacpp.py    # the default model, 2 threads, 5 runs

For each of `--runs` rounds it starts one fresh process per engine (atlas first in even rounds,
llama.cpp first in odd ones, so a change in machine load hits both) and measures:

- prompt processing: `--pp` prompt tokens from an empty cache, tokens/s;
- decode: `--tg` greedy tokens after a short chat prompt, one token per forward, tokens/s;
- load: constructing the model in-process (atlas `load_model`, llama.cpp `Llama(...)`);
- the command line: process start to first token, and peak resident memory of a whole
  `--tg`-token reply (`atlas run` vs the same through llama-cpp-python), from `wait4`.

It prints median [min-max] per engine, the ratio of the medians (atlas / llama.cpp) and the
spread of per-round ratios, the load average and the threading setup. Both engines get the
same thread count. CPU milliseconds per token (all threads of the process) are reported next
to the rates: on a machine shared with other work they show efficiency independent of how
much of the machine each run happened to get.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# run from a checkout without installing: this repository's atlas_cli, here and in the children
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = "What is the capital of France?"
LONG_PROMPT = "Why is the sky blue? Explain it to a ten year old."


# ---------------------------------------------------------------------------------------------
# workers: each runs in its own process and prints one JSON line


def work_atlas_engine(model: str, threads: int, pp: int, tg: int) -> dict:
    import numpy as np

    from atlas_cli.session import open_model

    t0 = time.perf_counter()
    m = open_model(model, device="cpu", ctx_size=max(pp, 64 + tg) + 16)
    load_s = time.perf_counter() - t0
    engine = m.engine
    prompt = [1000 + (i * 37) % 20000 for i in range(pp)]
    engine.prefill(prompt[:8])  # first calls load the cached kernels: not part of the rates
    engine.reset()
    t0 = _clock()
    engine.prefill(prompt)
    pp_time = _since(t0)
    engine.reset()
    chat = m.chat_prompt([{"role": "user", "content": PROMPT}])
    logits, _ = engine.prefill(chat)
    token = int(np.argmax(logits))
    t0 = _clock()
    for _ in range(tg):
        token = int(np.argmax(engine.step(token)))
    tg_time = _since(t0)
    import numba

    return {
        **_rates(load_s, pp, pp_time, tg, tg_time),
        "layer": numba.threading_layer(),
        "threads": numba.get_num_threads(),
    }


Seconds = tuple[float, float]  # (wall, CPU of every thread of this process)


def _clock() -> Seconds:
    return time.perf_counter(), time.process_time()


def _since(start: Seconds) -> Seconds:
    """Wall and CPU seconds since `start`."""
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def _rates(load_s: float, pp: int, pp_time: Seconds, tg: int, tg_time: Seconds) -> dict:
    """What each engine worker reports, from the seconds of its pp and tg runs."""
    return {
        "load_s": load_s,
        "pp_tok_s": pp / pp_time[0],
        "tg_tok_s": tg / tg_time[0],
        "pp_cpu_ms": 1e3 * pp_time[1] / pp,
        "tg_cpu_ms": 1e3 * tg_time[1] / tg,
    }


def _llama(model: str, threads: int, n_ctx: int):
    from llama_cpp import Llama

    return Llama(
        model,
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def work_llama_engine(model: str, threads: int, pp: int, tg: int) -> dict:
    import numpy as np

    t0 = time.perf_counter()
    llm = _llama(model, threads, max(pp, 64 + tg) + 16)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    prompt = [1000 + (i * 37) % 20000 for i in range(pp)]
    llm.eval(prompt[:8])  # warm-up, as for atlas
    llm.reset()
    t0 = _clock()
    llm.eval(prompt)
    pp_time = _since(t0)
    llm.reset()
    chat = llm.tokenize(_chat_text(llm).encode(), add_bos=False, special=True)
    llm.eval(chat)
    token = int(np.argmax(last_logits()))
    t0 = _clock()
    for _ in range(tg):
        llm.eval([token])
        token = int(np.argmax(last_logits()))
    return _rates(load_s, pp, pp_time, tg, _since(t0))


def _chat_text(llm) -> str:
    """The chat prompt as atlas renders it (the model's own template), for the same ids."""
    from atlas_cli.backend.tokenizer import render_template

    template = llm.metadata["tokenizer.chat_template"]
    return render_template(
        template, messages=[{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )


def work_llama_cli(model: str, threads: int, tg: int, prompt: str) -> dict:
    """What `atlas run` does, through llama-cpp-python: load, chat template, stream a reply."""
    t_start = float(os.environ["BENCH_T0"])
    t0 = time.perf_counter()
    llm = _llama(model, threads, 512)
    load_s = time.perf_counter() - t0
    stream = llm.create_chat_completion(
        [{"role": "user", "content": prompt}], max_tokens=tg, temperature=0.0, stream=True
    )
    first = None
    for _chunk in stream:
        if first is None:
            first = time.time() - t_start
    return {"load_s": load_s, "first_token_s": first}


WORKERS = {
    "atlas-engine": work_atlas_engine,
    "llama-engine": work_llama_engine,
}


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


def _spawn(cmd: list[str], threads: int) -> tuple[str, float, float, int]:
    """Run `cmd`; return (stdout, wall seconds, seconds to the first byte of stdout, peak RSS
    in bytes) from wait4, which reports the child's own rusage."""
    env = _env(threads)
    env["BENCH_T0"] = repr(time.time())
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed:\n{err.decode()[-2000:]}")
    return (first + rest).decode(), wall, t_first, usage.ru_maxrss * 1024


def _worker_cmd(name: str, args) -> list[str]:
    return [
        sys.executable, __file__, "--worker", name, "--model", args.model,
        "--threads", str(args.threads), "--pp", str(args.pp), "--tg", str(args.tg),
    ]  # fmt: skip


def _atlas_cli_cmd(args, n: int, prompt: str) -> list[str]:
    # streamed to a pipe: the first byte on stdout is the first token
    return [
        sys.executable, "-m", "atlas_cli", "run", args.model, prompt, "--temperature", "0",
        "--max-tokens", str(n),
    ]  # fmt: skip


def _llama_cli_cmd(args, n: int, prompt: str) -> list[str]:
    return [
        sys.executable, __file__, "--worker", "llama-cli", "--model", args.model,
        "--threads", str(args.threads), "--tg", str(n), "--prompt", prompt,
    ]  # fmt: skip


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):9.2f} [{min(values):.2f}-{max(values):.2f}]"


Rows = dict[str, dict[str, list[float]]]  # engine -> measurement -> one value per round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: atlas's embedded default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=LONG_PROMPT, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker == "llama-cli":
        print(json.dumps(work_llama_cli(args.model, args.threads, args.tg, args.prompt)))
        return
    if args.worker:
        out = WORKERS[args.worker](args.model, args.threads, args.pp, args.tg)
        print(json.dumps(out))
        return

    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install llama-cpp-python")
    if args.model is None:
        from atlas_cli.store.embedded import DEFAULT_MODEL
        from atlas_cli.store.locate import resolve

        args.model = str(resolve(DEFAULT_MODEL))
    gguf_bytes = Path(args.model).stat().st_size
    print(f"model      {args.model} ({gguf_bytes / 1e6:.1f} MB)")
    print(f"machine    {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"threads    {args.threads} each; llama-cpp-python {llama_cpp.__version__}")
    print(f"load avg   {os.getloadavg()[0]:.2f} at start")
    print("warming atlas's kernel cache (compiles once per install) ...", flush=True)
    _spawn(_worker_cmd("atlas-engine", args) + ["--pp", "16", "--tg", "4"], args.threads)
    _spawn(_atlas_cli_cmd(args, 1, PROMPT), args.threads)

    rows: Rows = {"atlas": {}, "llama.cpp": {}}
    layer = ""
    for r in range(args.runs):
        layer = _engine_round(args, r, rows) or layer
        _cli_round(args, r, rows)
        print(
            f"round {r + 1}/{args.runs}: atlas pp {rows['atlas']['pp_tok_s'][-1]:.0f} "
            f"tg {rows['atlas']['tg_tok_s'][-1]:.1f} | llama.cpp pp "
            f"{rows['llama.cpp']['pp_tok_s'][-1]:.0f} tg {rows['llama.cpp']['tg_tok_s'][-1]:.1f}"
            f" | load avg {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    _print_summary(args, rows, layer, gguf_bytes)


def _engine_round(args, r: int, rows: Rows) -> str:
    """The in-process workers of round `r`, in alternating order; atlas's threading layer."""
    layer = ""
    order = [("atlas", "atlas-engine"), ("llama.cpp", "llama-engine")]
    for engine, worker in order if r % 2 == 0 else order[::-1]:
        out, _, _, _ = _spawn(_worker_cmd(worker, args), args.threads)
        res = json.loads(out.strip().splitlines()[-1])
        layer = res.get("layer", layer)
        for key in ("pp_tok_s", "tg_tok_s", "pp_cpu_ms", "tg_cpu_ms", "load_s"):
            rows[engine].setdefault(key, []).append(res[key])
    return layer


def _cli_round(args, r: int, rows: Rows) -> None:
    """Round `r` of the command lines: start to first token, then peak RSS of a whole reply."""
    cli = [
        ("atlas", _atlas_cli_cmd(args, 1, PROMPT), _atlas_cli_cmd(args, args.tg, LONG_PROMPT)),
        (
            "llama.cpp",
            _llama_cli_cmd(args, 1, PROMPT),
            _llama_cli_cmd(args, args.tg, LONG_PROMPT),
        ),
    ]
    for engine, first_cmd, full_cmd in cli if r % 2 == 0 else cli[::-1]:
        out, _, t_first, _ = _spawn(first_cmd, args.threads)
        if engine == "llama.cpp":
            t_first = json.loads(out.strip().splitlines()[-1])["first_token_s"]
        rows[engine].setdefault("cli_first_token_s", []).append(t_first)
        _, _, _, rss = _spawn(full_cmd, args.threads)
        rows[engine].setdefault("peak_rss_mb", []).append(rss / 1e6)


def _print_summary(args, rows: Rows, layer: str, gguf_bytes: int) -> None:
    labels = {
        "pp_tok_s": f"prompt tok/s (pp{args.pp})",
        "tg_tok_s": f"decode tok/s (tg{args.tg})",
        "pp_cpu_ms": "prompt CPU ms/token",
        "tg_cpu_ms": "decode CPU ms/token",
        "load_s": "load, in-process (s)",
        "cli_first_token_s": "start to 1st token (s)",
        "peak_rss_mb": "peak RSS, whole reply (MB)",
    }
    print(f"\natlas threading layer: {layer}; load avg at end {os.getloadavg()[0]:.2f}")
    print("ratio = atlas / llama.cpp: above 1 is better for tok/s, worse for time and memory")
    print(f"{'':28s} {'atlas median [min-max]':>26s} {'llama.cpp median [min-max]':>28s}  ratio")
    for key, label in labels.items():
        a, b = rows["atlas"][key], rows["llama.cpp"][key]
        ratio = statistics.median(a) / statistics.median(b)
        per = sorted(x / y for x, y in zip(a, b, strict=True))
        print(
            f"{label:28s} {_stats(a):>26s} {_stats(b):>28s}  {ratio:5.2f} "
            f"(rounds {per[0]:.2f}-{per[-1]:.2f})"
        )
    rss = statistics.median(rows["atlas"]["peak_rss_mb"])
    print(f"atlas peak RSS / GGUF size: {rss * 1e6 / gguf_bytes:.2f}x")


if __name__ == "__main__":
    main()
