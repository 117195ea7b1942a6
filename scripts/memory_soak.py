#!/usr/bin/env python3
"""Resident memory of `atlas serve` and of the keep-alive worker over many distinct prompts.

    python scripts/memory_soak.py serve --prompts 200                      # default settings
    python scripts/memory_soak.py serve --prompts 200 --cache-size 256MiB
    python scripts/memory_soak.py worker --prompts 200

Starts the process on the model (default: the embedded SmolLM2), sends each prompt once (two
tokens of reply, no two prompts alike, so every one is a new cached conversation) and reads the
process's VmRSS before the first and after the last. Prints one JSON object: the RSS figures,
the prefix cache's bytes and budget, the weights' size and the bound atlas keeps to,
`weights + budget + 300 MB`; exits 1 when the bound is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OVERHEAD = 300 << 20  # what the bound allows beyond weights and the cache's budget


def resident(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if "VmRSS:" in line)


def prompt(i: int) -> str:
    return f"Note {i}: the number {i * 7919 % 10007} is the key of locker {i}. Say ok."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def soak_serve(model: str, prompts: int, cache_size: str | None, env: dict, bound: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "atlas_cli", "serve", model, "--port", str(port)]
    cmd += ["--cache-size", cache_size] if cache_size else []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"atlas serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                post(port, "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("atlas serve did not come up in 300 s") from None
                time.sleep(0.2)
        ask = lambda i: post(  # noqa: E731
            port,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": prompt(i)}], "max_tokens": 2},
        )
        ask(-1)  # the first request compiles and allocates what every later one reuses
        before = resident(proc.pid)
        sent = send_all(ask, prompts, lambda: resident(proc.pid), bound)
        after = resident(proc.pid)
        slots = post(port, "/slots")
        held = sum(s.get("bytes", 0) for s in slots) if isinstance(slots, list) else None
        return {"before": before, "after": after, "sent": sent, "cache_bytes": held}
    finally:
        proc.terminate()
        proc.wait(30)


def send_all(ask, prompts: int, rss, bound: int) -> int:
    """Send the prompts, stopping early once the process is over `bound` (a leak would
    otherwise take the machine's memory); how many were sent."""
    for i in range(prompts):
        if ask(i) is None:
            raise SystemExit(f"prompt {i} was refused")
        if i % 10 == 9 and rss() > bound:
            return i + 1
    return prompts


def soak_worker(model: str, prompts: int, env: dict, bound: int) -> dict:
    from atlas_cli.keepalive import client, registry
    from atlas_cli.run_service import LoadSpec, RunRequest

    os.environ.update(env)  # the client finds the worker under the same ATLAS_HOME
    spec = LoadSpec(model, "cpu", None, None, None, True, None)
    key = registry.key_of(spec.key_fields())
    registry.start(spec.__dict__, 600.0, key)
    sampling = dict(temperature=0.0, top_k=None, top_p=None, min_p=None, repeat_penalty=None)

    def ask(i: int) -> dict | None:
        request = RunRequest(prompt(i), None, False, "on", 2, [], sampling, False)
        return client.run(key, request.__dict__, lambda _: None)

    deadline = time.monotonic() + 300
    while ask(-1) is None:  # still loading
        if time.monotonic() > deadline:
            raise SystemExit(f"no worker answered; its log: {registry.log_path(key)}")
        time.sleep(0.5)
    (worker,) = registry.workers()
    try:
        before = resident(worker.pid)
        sent = send_all(ask, prompts, lambda: resident(worker.pid), bound)
        after = resident(worker.pid)
        (record,) = registry.workers()
        return {"before": before, "after": after, "sent": sent, "cache_bytes": record.cache_bytes}
    finally:
        registry.stop(worker)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("process", choices=["serve", "worker"])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--cache-size", help="serve's --cache-size (default: its own)")
    parser.add_argument("--model", help="a model file (default: the embedded one)")
    args = parser.parse_args()

    from atlas_cli.backend.ops.cpu.jit import kernel_cache_dir
    from atlas_cli.backend.prefix_pool import RUN_BUDGET, SERVE_BUDGET, default_budget
    from atlas_cli.serve.server import parse_size
    from atlas_cli.session import resolve

    model = args.model or str(resolve("smollm2", device="cpu").path)
    home = tempfile.mkdtemp(prefix="atlas-soak-")  # a short path: the worker's Unix socket
    # the user's compiled kernels (a fresh home would compile them again for a minute)
    env = dict(os.environ, ATLAS_HOME=home, NUMBA_CACHE_DIR=str(kernel_cache_dir()))
    if args.process == "serve":
        size = parse_size(args.cache_size, "--cache-size") if args.cache_size else None
        budget = default_budget(SERVE_BUDGET) if size is None else size
    else:
        budget = default_budget(RUN_BUDGET)
    weights = os.path.getsize(model)
    bound = weights + budget + OVERHEAD
    if args.process == "serve":
        result = soak_serve(model, args.prompts, args.cache_size, env, bound)
    else:
        result = soak_worker(model, args.prompts, env, bound)
    result |= {"process": args.process, "prompts": args.prompts, "weights": weights,
               "budget": budget, "bound": bound}  # fmt: skip
    result["ok"] = result["sent"] == args.prompts and result["after"] <= bound
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
