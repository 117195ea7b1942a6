"""The keep-alive socket and saved slot files under seeded hostile input (tests/protocol_fuzz.py;
`scripts/fuzz_protocols.py` runs more cases): a worker answers every line in its protocol and
goes on serving, never printing a traceback; a damaged slot file is a SlotError (the server's
400), never another exception."""

from __future__ import annotations

import json

import pytest

from atlas_cli import errors
from atlas_cli.errors import SlotError
from tests.protocol_fuzz import GOOD_REQUEST, ask_worker, lying_header, slot_case, socket_case

CASES = 48
KNOWN = {"pong", "busy", "stale", "accepted", "alive", "text", "done", "error", "type", "note"}


@pytest.fixture(scope="module")
def model(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu")


@pytest.fixture
def worker(model, smollm2_path, tmp_path, monkeypatch):
    from atlas_cli.keepalive import worker as worker_module
    from atlas_cli.run_service import LoadSpec

    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    spec = LoadSpec(str(smollm2_path), "cpu", None, None, None, True, None)
    w = worker_module.Worker(spec, 60.0, "k" * 20)
    w.model, w.path = model, smollm2_path
    w.identity = worker_module.fingerprint(smollm2_path)
    return w


def test_the_worker_answers_hostile_lines_in_its_protocol(worker, capfd):
    for seed in range(CASES):
        line, what = socket_case(seed)
        for message in ask_worker(worker, line):
            assert isinstance(message, dict) and set(message) <= KNOWN, (what, message)
            if "error" in message:
                kind = getattr(errors, message["type"], None)
                assert isinstance(kind, type) and issubclass(kind, errors.AtlasError), what
        assert not worker.stopping.is_set(), f"case {seed} ({what}) stopped the worker"
    assert "Traceback" not in capfd.readouterr().err
    good = dict(GOOD_REQUEST, max_tokens=2, stream=False)
    worker.notes.append("atlas: compiling the CPU kernels")  # what its load said: relayed
    answer = ask_worker(worker, json.dumps({"op": "run", "request": good}).encode())
    assert answer[0] == {"note": "atlas: compiling the CPU kernels"} and "done" in answer[-1]


def test_damaged_slot_files_are_slot_errors(model, tmp_path):
    engine = model.engine
    list(engine.generate(model.chat_prompt([{"role": "user", "content": "hi"}]), max_tokens=3))
    good_path = tmp_path / "good.npz"
    engine.save_slot(engine.pool.current.id, good_path)
    good = good_path.read_bytes()
    damaged = [slot_case(good, seed) for seed in range(CASES)]
    damaged.append((lying_header(good), "a header asking for 400 GB"))
    for data, what in damaged:
        path = tmp_path / "damaged.npz"
        path.write_bytes(data)
        try:
            engine.restore_slot(7, path)
        except SlotError:
            continue
        except Exception as exc:  # noqa: BLE001 - the point: nothing but a SlotError
            pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
