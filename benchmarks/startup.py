"""Start to first token, side by side: `atlas run` (with its model kept loaded, and cold) and
llama.cpp on the same GGUF, plus `atlas --help`.

    python benchmarks/startup.py [--model FILE] [--rounds 10] \\
        [--llama-python /path/to/venv-with-llama-cpp-python/bin/python]

Every round starts one fresh process per case, in an order that rotates from round to round
(machine noise hits every case alike), and times from the process start to the first byte of
the reply on stdout (for `--help`: to the process's exit). The cases:

- atlas warm: `atlas run FILE PROMPT` answered by the model `atlas run` keeps loaded
  (`--keep-alive`, the default; started once before the rounds);
- atlas cold: the same with `ATLAS_KEEP_ALIVE=0`: the process loads the model itself (numba's
  compiled kernels from its cache);
- atlas first run: no worker yet (`atlas stop` before it, in a home of its own): the run starts
  the worker, which loads the model and answers;
- atlas second run: right after a first run ends (no worker before that one), another prompt;
- llama.cpp: llama-cpp-python in a fresh process: import, load the same file, the same chat
  prompt streamed (`create_chat_completion`), as `atlas run` does;
- atlas --help.

It prints median [min-max] in milliseconds per case and the load average. llama.cpp runs in
`--llama-python` (default: this interpreter).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"
OTHER_PROMPT = "Name three primary colours."

LLAMA_CHILD = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, verbose=False)
messages = [{"role": "user", "content": sys.argv[2]}]
for chunk in llm.create_chat_completion(messages, stream=True, max_tokens=8, temperature=0):
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
"""


def first_byte_s(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from starting `cmd` to the first byte on its stdout (then it runs to its end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = os.read(proc.stdout.fileno(), 1)
    seconds = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return seconds


def exit_s(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def cases(args, env: dict[str, str]) -> dict[str, object]:
    atlas = [sys.executable, "-m", "atlas_cli"]
    run = [*atlas, "run", str(args.model), PROMPT, "-n", "8", "--temperature", "0"]
    cold_env = dict(env, ATLAS_KEEP_ALIVE="0")
    llama = [args.llama_python, "-c", LLAMA_CHILD, str(args.model), PROMPT]
    other = [*run[:5], OTHER_PROMPT, *run[6:]]

    def in_a_fresh_home(measure) -> float:
        """`measure(env)` in a home of its own (no worker yet), whose worker is stopped after."""
        fresh = dict(env, ATLAS_HOME=tempfile.mkdtemp(prefix="atlas-startup-fresh-"))
        try:
            return measure(fresh)
        finally:
            subprocess.run([*atlas, "stop"], env=fresh, capture_output=True)

    def second_run(fresh) -> float:
        first_byte_s(run, fresh)
        return first_byte_s(other, fresh)

    return {
        "atlas run, model kept loaded": lambda: first_byte_s(run, env),
        "atlas run, cold": lambda: first_byte_s(run, cold_env),
        "atlas run, first": lambda: in_a_fresh_home(lambda fresh: first_byte_s(run, fresh)),
        "atlas run, right after the first": lambda: in_a_fresh_home(second_run),
        "llama.cpp (llama-cpp-python)": lambda: first_byte_s(llama, env),
        "atlas --help": lambda: exit_s([*atlas, "--help"], env),
    }


def default_model() -> Path:
    sys.path.insert(0, str(REPO))
    from atlas_cli.store import embedded, locate

    return locate.resolve(embedded.DEFAULT_MODEL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--llama-python", default=sys.executable, help="python with llama_cpp")
    args = p.parse_args()
    args.model = args.model or default_model()
    home = tempfile.mkdtemp(prefix="atlas-startup-")  # its own keep-alive worker, stopped after
    numba_cache = os.environ.get("NUMBA_CACHE_DIR") or str(default_cache() / "numba")
    env = dict(os.environ, ATLAS_HOME=home, ATLAS_KEEP_ALIVE="10m", NUMBA_CACHE_DIR=numba_cache,
               PYTHONPATH=str(REPO))  # fmt: skip
    todo = cases(args, env)
    try:
        warm_up(todo, env)
        times: dict[str, list[float]] = {name: [] for name in todo}
        names = list(todo)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(todo[name]())
            print(f"round {r + 1}/{args.rounds}, load average {load()}", file=sys.stderr)
    finally:
        subprocess.run([sys.executable, "-m", "atlas_cli", "stop"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    print(f"model {args.model.name}, {args.rounds} rounds, load average {load()}")
    print(f"{'case':32} {'ms, median [min-max]':>26}")
    for name, values in times.items():
        ms = [v * 1000 for v in values]
        print(f"{name:32} {statistics.median(ms):>8.0f} [{min(ms):.0f}-{max(ms):.0f}]")


def warm_up(todo, env) -> None:
    """One of each (the file in the page cache, the kernels loaded once), then wait for the
    kept-alive model to be up."""
    for case in todo.values():
        case()
    atlas = [sys.executable, "-m", "atlas_cli", "ps"]
    deadline = time.monotonic() + 120
    while "cpu" not in subprocess.run(atlas, env=env, capture_output=True, text=True).stdout:
        if time.monotonic() > deadline:
            raise SystemExit("the kept-alive model did not come up")
        time.sleep(0.5)


def default_cache() -> Path:
    sys.path.insert(0, str(REPO))
    from atlas_cli.store.paths import cache_dir

    return cache_dir()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
