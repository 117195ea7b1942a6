"""`atlas run` keeps its model loaded (ollama's keep-alive): the next run with the same model
and options is answered by the background worker, the same tokens as in-process; `atlas ps`
lists it, `atlas stop` / `atlas rm` end it, a changed model file or Ctrl-C in the client does not
leave a wrong answer behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from atlas_cli.errors import UsageError
from atlas_cli.keepalive import client, keep_alive_seconds, registry


@pytest.mark.parametrize(
    "text,seconds", [("0", 0), ("30", 30), ("30s", 30), ("5m", 300), ("1.5h", 5400), (" 2M ", 120)]
)
def test_durations(text, seconds):
    assert keep_alive_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "-1", "5 minutes", "m", "1d", "inf"])
def test_bad_durations_are_one_line_errors(text):
    with pytest.raises(UsageError, match="not a duration"):
        keep_alive_seconds(text)


def test_the_environment_and_the_default(monkeypatch):
    monkeypatch.setenv("ATLAS_KEEP_ALIVE", "10s")
    assert keep_alive_seconds(None) == 10
    assert keep_alive_seconds("0") == 0  # the flag wins
    monkeypatch.delenv("ATLAS_KEEP_ALIVE")
    assert keep_alive_seconds(None) == 300
    monkeypatch.setenv("ATLAS_KEEP_ALIVE", "soon")
    with pytest.raises(UsageError, match="ATLAS_KEEP_ALIVE"):
        keep_alive_seconds(None)


def test_the_key_follows_the_load_options(monkeypatch):
    from atlas_cli.run_service import LoadSpec

    def key(ctx_size=None):
        spec = LoadSpec("smollm2-135m", None, ctx_size, None, None, None, None)
        return registry.key_of(spec.key_fields())

    first = key()
    assert key() == first and key(4096) != first
    monkeypatch.setenv("ATLAS_KEEP_ALIVE", "1h")  # how long a worker stays: the same worker
    assert key() == first
    for var, value in [("ATLAS_DEVICE", "cpu"), ("ATLAS_CPU_ACTIVATIONS", "float32")]:
        monkeypatch.setenv(var, value)  # what it computes: another worker
        assert key() != first
        monkeypatch.delenv(var)
    assert key() == first


def test_a_bad_keep_alive_fails_before_loading(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "atlas_cli", "run", "hi", "--keep-alive", "later"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("atlas: error: --keep-alive: 'later' is not a duration")
    assert len(done.stderr.strip().splitlines()) == 1


def test_stale_records_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    worker = registry.Worker("k" * 20, int(dead), "m", "/nowhere", "cpu", time.time() + 60)
    registry.write_record(worker)
    (tmp_path / "run" / f"{'k' * 20}.sock").touch()
    assert registry.workers() == []
    assert list((tmp_path / "run").iterdir()) == []


def test_no_worker_and_no_error_where_the_run_folder_cannot_be_made(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    (tmp_path / "run").write_text("a file where the folder should be")  # as a read-only home
    registry.start({"model": "m"}, 60.0, "k" * 20)  # the run has answered: nothing to say
    assert (tmp_path / "run").is_file() and registry.workers() == []


def test_what_is_not_this_users_socket_is_never_used(tmp_path, monkeypatch):
    """A folder at the socket's path (once a traceback on every run), a plain file, and a log
    name that is a link to someone's file: no connection, no error, the file untouched."""
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    key = "k" * 20
    sock = registry.socket_path(key)
    sock.parent.mkdir()
    sock.mkdir()
    assert client.run(key, {}, print) is None and client.ping(key) is None
    registry.forget(key)
    registry.start({"model": "m"}, 60.0, key)  # something is there: no worker
    assert sock.is_dir() and registry.workers() == []
    sock.rmdir()
    sock.write_text("not a socket")
    assert not registry.owned_socket(sock) and client.run(key, {}, print) is None
    sock.unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    registry.log_path(key).symlink_to(victim)
    registry.start({"model": "m"}, 60.0, key)
    assert victim.read_text() == "keep me" and registry.workers() == []


# ---- a real worker ---------------------------------------------------------------------------


@pytest.fixture
def home(smollm2_path):
    """A short ATLAS_HOME (a Unix socket's path has ~100 bytes), the suite's compiled kernels,
    and a copy of the default model that the test may change."""
    root = Path(tempfile.mkdtemp(prefix="atlas-ka-"))
    model = root / "smollm2.gguf"
    shutil.copyfile(smollm2_path, model)
    numba_cache = Path(os.environ["ATLAS_HOME"]) / "cache" / "numba"
    env = dict(os.environ, ATLAS_HOME=str(root), ATLAS_KEEP_ALIVE="120",
               NUMBA_CACHE_DIR=str(numba_cache))  # fmt: skip
    yield root, model, env
    subprocess.run([sys.executable, "-m", "atlas_cli", "stop"], env=env, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def atlas(env, *args, **kw):
    cmd = [sys.executable, "-m", "atlas_cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, **kw)


def run_json(env, model, *args):
    done = atlas(env, "run", str(model), *args, "--json", "-n", "12", "--seed", "7")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_for_worker(env, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = json.loads(atlas(env, "ps", "--json").stdout)
        if rows:
            return rows
        time.sleep(0.5)
    raise AssertionError("no worker came up")


@pytest.mark.slow
def test_a_kept_alive_model_answers_the_next_run(home):
    root, model, env = home
    prompt = ["What is the capital of France?", "--temperature", "0.7"]
    first = run_json(env, model, *prompt)  # in-process; starts the worker
    (worker,) = wait_for_worker(env)
    assert worker["path"] == str(model) and worker["device"] == "cpu"
    assert worker["memory_bytes"] > 50e6

    second = run_json(env, model, *prompt)  # the worker: same seed, same tokens
    assert second["text"] == first["text"] and second["completion_tokens"] == 12
    assert second["timings"]["load_s"] < 0.5 < first["timings"]["load_s"]
    (worker,) = json.loads(atlas(env, "ps", "--json").stdout)  # no second worker
    assert 0 < worker["cache_bytes"] < 10e6 and worker["cache_budget"] <= 1 << 30
    assert "PREFIX CACHE" in atlas(env, "ps").stdout

    # its errors are the run's errors, one line, same exit code
    bad = atlas(env, "run", str(model), "hi", "--temperature", "-1")
    assert bad.returncode == 2 and bad.stderr.startswith("atlas: error: ") and not bad.stdout
    long = atlas(env, "run", str(model), "word " * 9000)
    assert long.returncode == 1 and "context" in long.stderr and len(long.stderr.splitlines()) == 1

    # Ctrl-C in a run the worker answers: the worker stays and serves the next one
    cmd = [sys.executable, "-m", "atlas_cli", "run", str(model), "Tell me a story", "-n", "400"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(8)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    third = run_json(env, model, *prompt)
    assert third["text"] == first["text"] and third["timings"]["load_s"] < 0.5

    # a model file that changed is not answered from the old copy: the run loads it itself
    os.utime(model, (time.time() + 5, time.time() + 5))
    fourth = run_json(env, model, *prompt)
    assert fourth["text"] == first["text"] and fourth["timings"]["load_s"] > 0.5
    (again,) = wait_for_worker(env)
    assert again["pid"] != worker["pid"]

    # stopping: atlas rm's road (by path) and atlas stop
    registry_env = {"ATLAS_HOME": str(root)}
    code = f"from atlas_cli.keepalive import registry; registry.stop_for_paths([{str(model)!r}])"
    subprocess.run([sys.executable, "-c", code], env={**env, **registry_env}, check=True)
    assert json.loads(atlas(env, "ps", "--json").stdout) == []
    assert not list((root / "run").glob("*.sock"))
    stopped = atlas(env, "stop", "nothing-loaded")
    assert stopped.returncode == 1 and "is not loaded" in stopped.stderr


@pytest.mark.slow
def test_a_new_worker_resumes_the_conversations_of_the_last(home):
    """A worker stopped (`atlas stop`, or idle) keeps its cached conversations on disk; the
    next worker of the same model file answers the same prompt from them."""
    root, model, env = home
    prompt = "Summarise these notes. " + " ".join(f"Note {i}: keep it exact." for i in range(30))
    run_json(env, model, prompt)  # in-process; starts a worker
    wait_for_worker(env)
    assert run_json(env, model, prompt)["cached_tokens"] == 0  # the worker's first
    assert atlas(env, "stop").returncode == 0  # on its way out it writes the conversation
    assert list((root / "cache" / "prefix").glob("*/*.npz"))
    run_json(env, model, prompt)  # in-process again; starts the next worker
    wait_for_worker(env)
    resumed = run_json(env, model, prompt)
    assert resumed["cached_tokens"] >= resumed["prompt_tokens"] - 1
