#!/usr/bin/env python3
"""Fuzz the keep-alive socket and saved slot files with the default model.

    python scripts/fuzz_protocols.py --cases 1000

Cases come from tests/protocol_fuzz.py (seeded: case i is the same every run). Socket: each line
goes to a keep-alive worker's handler over a socket pair; a case is bad when the worker stops
serving, answers outside its protocol, or an error is no AtlasError. Slots: each damaged file is
restored into the engine; a case is bad when that raises anything but a SlotError. Prints the
counts and the bad cases; exits 1 unless there are none.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="per fuzzer")
    args = parser.parse_args()

    from atlas_cli import errors
    from atlas_cli.errors import SlotError
    from atlas_cli.keepalive import worker as worker_module
    from atlas_cli.run_service import LoadSpec
    from atlas_cli.session import open_model, resolve
    from tests.protocol_fuzz import ask_worker, lying_header, slot_case, socket_case

    path = resolve("smollm2", device="cpu").path
    os.environ["ATLAS_HOME"] = tempfile.mkdtemp(prefix="atlas-fuzz-")  # records go there
    model = open_model(str(path), device="cpu")
    spec = LoadSpec(str(path), "cpu", None, None, None, True, None)
    worker = worker_module.Worker(spec, 600.0, "f" * 20)
    worker.model, worker.path = model, path
    worker.identity = worker_module.fingerprint(path)

    counts: collections.Counter = collections.Counter()
    bad: list[str] = []
    known = {"pong", "busy", "stale", "accepted", "alive", "text", "done", "error", "type", "note"}
    for seed in range(args.cases):
        line, what = socket_case(seed)
        try:
            messages = ask_worker(worker, line)
        except TimeoutError:
            counts["socket hang"] += 1
            bad.append(f"socket #{seed} ({what}): no answer")
            continue
        wrong = [m for m in messages if not isinstance(m, dict) or not set(m) <= known]
        wrong += [m for m in messages if "error" in m and not _atlas_error(errors, m.get("type"))]
        if wrong or worker.stopping.is_set():
            counts["socket bad"] += 1
            bad.append(f"socket #{seed} ({what}): {wrong or 'the worker stopped'}")
            worker.stopping.clear()
        else:
            counts["socket ok"] += 1

    engine = model.engine
    list(engine.generate(model.chat_prompt([{"role": "user", "content": "hi"}]), max_tokens=3))
    folder = Path(tempfile.mkdtemp(prefix="atlas-fuzz-slots-"))
    engine.save_slot(engine.pool.current.id, folder / "good.npz")
    good = (folder / "good.npz").read_bytes()
    damaged = [slot_case(good, seed) for seed in range(args.cases)]
    damaged.append((lying_header(good), "a header asking for 400 GB"))
    for i, (data, what) in enumerate(damaged):
        target = folder / "damaged.npz"
        target.write_bytes(data)
        try:
            engine.restore_slot(7, target)
            counts["slot restored"] += 1
        except SlotError:
            counts["slot refused"] += 1
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            counts["slot traceback"] += 1
            bad.append(f"slot #{i} ({what}): {type(exc).__name__}: {exc}")
    print(json.dumps(dict(sorted(counts.items()))))
    for line in bad:
        print(line)
    return 1 if bad else 0


def _atlas_error(errors, name) -> bool:
    kind = getattr(errors, str(name), None)
    return isinstance(kind, type) and issubclass(kind, errors.AtlasError)


if __name__ == "__main__":
    raise SystemExit(main())
