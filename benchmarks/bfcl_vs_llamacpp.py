"""BFCL v4 on `atlas serve` and llama.cpp's server, the same GGUF file, side by side.

    pip install --no-deps 'bfcl-eval==2026.3.23'    # BFCL's cases and checker
    pip install 'llama-cpp-python[server]'           # benchmark-only (builds llama.cpp)
    python benchmarks/bfcl_vs_llamacpp.py --limit 20

Starts one server at a time on a loopback port, `atlas serve MODEL` and then
`python -m llama_cpp.server --model FILE --chat_format chatml-function-calling` (llama.cpp's
grammar-constrained function calling) or, with `--llama-server PATH`, llama.cpp's own C++
server as MLPerf Edge Agentic's reference system runs (`--jinja --reasoning off -np 1 --seed
42`: its tool calls parsed from the model's template syntax), runs `atlas bench bfcl --url
... -o json` against each with the same flags (function-calling mode, tool_choice auto,
temperature 0 unless told otherwise), and prints correct/total per category for both, with
protocol errors; `--mlperf` runs MLPerf Edge Agentic's set and prints its two headline scores
and gate against llama.cpp.
The JSON results are kept in --out. The file is the one `atlas show MODEL` names in the store.
`--also "atlas before=old/atlas.json"` adds a column from an earlier run (another commit).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# run from a checkout without installing: this repository's atlas_cli, here and in the children
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until GET url answers 200 (atlas: /health once loaded; llama.cpp: /v1/models)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready after {timeout:.0f} s")


def gguf_path(model: str) -> Path:
    from atlas_cli.session import resolve

    path = Path(resolve(model).path)
    if path.suffix != ".gguf":
        raise SystemExit(f"{model} resolves to {path}, not a GGUF file llama.cpp can read")
    return path


def server_command(engine: str, model: str, path: Path, port: int, args) -> list[str]:
    if engine == "atlas":
        return [sys.executable, "-m", "atlas_cli", "serve", model, "--port", str(port)]
    if args.llama_server:  # MLPerf Edge Agentic's reference system, its flags
        return [
            args.llama_server, "-m", str(path), "--port", str(port), "--host", "127.0.0.1",
            "--jinja", "--reasoning", "off", "--ctx-size", str(args.ctx_size), "-np", "1",
            "--seed", "42", "-t", str(args.threads),
        ]  # fmt: skip
    return [
        args.llama_python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(path),
        "--port",
        str(port),
        "--chat_format",
        args.chat_format,
        "--n_ctx",
        str(args.ctx_size),
        "--n_threads",
        str(args.threads),
    ]


def bench(engine: str, model: str, path: Path, args) -> dict:
    """Start the engine's server, run `atlas bench bfcl --url` against it, stop the server."""
    port = free_port()
    python_server = engine != "atlas" and not args.llama_server
    ready = f"http://127.0.0.1:{port}" + ("/v1/models" if python_server else "/health")
    log = open(args.out / f"{engine}-server.log", "w")  # noqa: SIM115 (lives as long as the server)
    server = subprocess.Popen(
        server_command(engine, model, path, port, args), stdout=log, stderr=log, env=CHILD_ENV
    )
    result_file = args.out / f"{engine}.json"
    try:
        wait_ready(ready, server)
        command = [
            sys.executable, "-m", "atlas_cli", "bench", "bfcl", model,
            "--url", f"http://127.0.0.1:{port}", "--mode", args.mode,
            "--max-tokens", str(args.max_tokens), "--output-file", str(result_file),
            "--timeout", str(args.timeout),
        ]  # fmt: skip
        if args.mode == "fc":
            command += ["--tool-choice", args.tool_choice]
        if args.limit:
            command += ["--limit", str(args.limit)]
        if args.categories:
            command += ["--categories", args.categories]
        if args.mlperf:
            command += ["--mlperf"]
        if args.reuse:
            command += ["--resume", str(result_file)]
        t0 = time.perf_counter()
        subprocess.run(command, check=True, env=CHILD_ENV, stdout=subprocess.DEVNULL)
        print(f"{engine}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:  # llama_cpp.server waits for a request in flight
            server.kill()
            server.wait()
        log.close()
    return json.loads(result_file.read_text())


def table(results: dict[str, dict]) -> str:
    engines = list(results)
    head = "| BFCL v4 category | " + " | ".join(engines) + " |"
    lines = [head, "| --- |" + " ---: |" * len(engines)]
    first = results[engines[0]]
    rows = [*first["categories"], "overall"]
    for name in rows:
        cells = []
        for engine in engines:
            doc = results[engine]
            t = doc["summary"] if name == "overall" else doc["categories"].get(name)
            if t is None:  # an --also run without this category
                cells.append("-")
                continue
            errors = f" ({t['protocol_errors']} protocol errors)" if t["protocol_errors"] else ""
            cells.append(f"{t['correct']}/{t['total']}{errors}")
        label = f"**{name}**" if name == "overall" else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from atlas_cli.store.embedded import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="atlas model name (a GGUF variant)")
    p.add_argument("--limit", type=int, default=20, help="cases per category (0: all)")
    p.add_argument("--categories", default=None, help="comma list (default: all single-turn)")
    p.add_argument("--mode", default="fc", choices=("fc", "prompt"))
    p.add_argument("--tool-choice", default="auto", choices=("auto", "required"))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600, help="seconds per answer")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    p.add_argument(
        "--ctx-size", type=int, default=None, help="llama.cpp context (8192; 32768 with --mlperf)"
    )
    p.add_argument("--chat-format", default="chatml-function-calling", help="llama.cpp's")
    p.add_argument("--llama-python", default=sys.executable, help="python with llama_cpp")
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama.cpp's own C++ llama-server instead of llama_cpp.server, run with MLPerf's "
        "reference flags (--jinja --reasoning off -np 1 --seed 42; --ctx-size 32768 with --mlperf)",
    )
    p.add_argument("--engines", default="atlas,llama.cpp")
    p.add_argument(
        "--mlperf",
        action="store_true",
        help="MLPerf Edge Agentic's set (atlas bench bfcl --mlperf; --limit per subset, 0: all "
        "995) and its gate: each engine's two headline scores against llama.cpp's",
    )
    p.add_argument("--out", type=Path, default=Path("bfcl-results"))
    p.add_argument(
        "--reuse",
        action="store_true",
        help="go on from each engine's result in --out: its answered cases are kept, the rest "
        "asked (atlas bench bfcl --resume), so a long run can be cut off and continued",
    )
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="one more column from an earlier result file (repeatable)",
    )
    args = p.parse_args()
    if args.ctx_size is None:
        args.ctx_size = 32768 if args.mlperf else 8192
    args.out.mkdir(parents=True, exist_ok=True)
    path = gguf_path(args.model)
    print(f"{args.model}: {path}", file=sys.stderr)
    results = {}
    for engine in args.engines.split(","):
        results[engine] = bench(engine, args.model, path, args)
    for extra in args.also:
        label, sep, file = extra.partition("=")
        if not sep or not Path(file).is_file():
            raise SystemExit(f"--also takes LABEL=FILE with an existing file, got {extra!r}")
        results[label] = json.loads(Path(file).read_text())
    mode = args.mode + (f", tool_choice {args.tool_choice}" if args.mode == "fc" else "")
    limit = f"first {args.limit} cases" if args.limit else "all cases"
    print(f"BFCL v4 ({mode}, {limit} per category, temperature 0), {path.name}\n")
    print(table(results))
    if args.mlperf:
        print("\n" + mlperf_lines(results))


def mlperf_lines(results: dict[str, dict]) -> str:
    """Each engine's MLPerf headline scores, and against llama.cpp's (the reference system)
    whether both are at least 97% of it, MLPerf's pass rule."""
    from atlas_cli.bench.gate import MLPERF_FRACTION

    ref = results.get("llama.cpp", {}).get("mlperf")
    lines = []
    for engine, doc in results.items():
        m = doc.get("mlperf")
        if m is None:
            continue
        line = (
            f"{engine}: overall {m['overall']:.2%}, category-balanced {m['category_balanced']:.2%}"
        )
        if ref and engine != "llama.cpp":
            ratios = [
                m[k] / ref[k] if ref[k] else float("inf") for k in ("overall", "category_balanced")
            ]
            verdict = "PASS" if min(ratios) >= MLPERF_FRACTION else "FAIL"
            line += f" = {ratios[0]:.3f} / {ratios[1]:.3f} of llama.cpp's: {verdict}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
