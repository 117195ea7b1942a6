"""`atlas run` keeps its model loaded (ollama's keep-alive): the next run with the same model
and options is answered by the background worker, the same tokens as in-process; `atlas ps`
lists it, `atlas stop` / `atlas rm` end it, a changed model file or Ctrl-C in the client does not
leave a wrong answer behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from atlas_cli.errors import AtlasError, UsageError
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


def test_a_model_file_is_matched_however_it_is_written(tmp_path, monkeypatch):
    """`atlas stop my.gguf` for a model started as `./my.gguf` (or by its full path)."""
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.gguf").write_bytes(b"w")
    (tmp_path / "home" / "run").mkdir(parents=True)
    me = registry.Worker("k" * 20, os.getpid(), "./my.gguf", "my.gguf", "cpu", time.time() + 60)
    registry.write_record(me)
    monkeypatch.setattr(registry, "_alive", lambda pid: True)
    for name in ["my.gguf", "./my.gguf", str(tmp_path / "my.gguf")]:
        assert registry.matching(name) == [me], name
    assert registry.matching("other") == []


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


def test_a_run_folder_that_is_not_this_users_is_refused(tmp_path, monkeypatch):
    """A run folder left by `sudo -E atlas run` (another owner) or a file at its path: one line
    saying why (keep-alive is off, the run loads in-process); one open to others is closed."""
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    run = tmp_path / "run"
    assert registry.run_dir_problem() is None and run.stat().st_mode & 0o777 == 0o700
    run.chmod(0o777)
    assert registry.run_dir_problem() is None and run.stat().st_mode & 0o777 == 0o700
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    assert "belongs to another user" in registry.run_dir_problem()
    monkeypatch.setattr(os, "geteuid", lambda: me)
    run.rmdir()
    run.write_text("x")
    assert "is not a folder" in registry.run_dir_problem()


def test_a_worker_of_another_user_is_never_sent_a_prompt(monkeypatch):
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert registry.peer_is_this_user(left)
        if hasattr(socket, "SO_PEERCRED"):
            me = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: me + 1)
            assert not registry.peer_is_this_user(left)


def fake_worker(tmp_path, monkeypatch, *messages: dict, pause_s: float = 0.0):
    """A socket at a worker's path that accepts one run, says `messages` (`pause_s` apart),
    then goes silent with the connection open; the key to reach it."""
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    key = "k" * 20
    path = registry.socket_path(key)
    path.parent.mkdir(mode=0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        conn.makefile("r").readline()
        for message in messages:
            conn.sendall((json.dumps(message) + "\n").encode())
            time.sleep(pause_s)
        time.sleep(5)
        conn.close()
        server.close()

    threading.Thread(target=answer, daemon=True).start()
    return key


def test_a_silent_worker_is_given_up_on(tmp_path, monkeypatch):
    """A worker that accepts and then says nothing once left `atlas run` waiting forever: the
    client gives up after SILENT_WORKER_S and runs in-process (or says the reply stopped)."""
    monkeypatch.setattr(client, "SILENT_WORKER_S", 0.3)
    key = fake_worker(tmp_path, monkeypatch, {"accepted": True})
    t0 = time.monotonic()
    assert client.run(key, {}, print) is None and time.monotonic() - t0 < 3


def test_a_worker_silent_mid_reply_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "SILENT_WORKER_S", 0.3)
    key = fake_worker(tmp_path, monkeypatch, {"accepted": True}, {"text": "Par"})
    with pytest.raises(AtlasError, match="stopped in the middle"):
        client.run(key, {}, lambda _: None)


def test_what_loading_says_reaches_the_run(tmp_path, monkeypatch, capsys):
    """A first run waits while its worker compiles the kernels: the worker's notice comes over
    the socket and is shown as an in-process load shows it."""
    note = {"note": "atlas: compiling the CPU kernels (about a minute, once; ...)"}
    key = fake_worker(tmp_path, monkeypatch, note, {"accepted": True}, {"done": {"text": "ok"}})
    assert client.run(key, {}, print)["text"] == "ok"
    assert "compiling the CPU kernels" in capsys.readouterr().err


def test_a_working_worker_keeps_the_client_with_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "SILENT_WORKER_S", 0.3)
    beats = [{"alive": True}] * 6  # 1.2 s of work, 0.2 s apart
    done = {"done": {"text": "ok"}}
    key = fake_worker(tmp_path, monkeypatch, {"accepted": True}, *beats, done, pause_s=0.2)
    assert client.run(key, {}, print)["text"] == "ok"


def test_a_worker_that_cannot_write_its_record_stops(tmp_path, monkeypatch):
    """On a full disk the worker once ran without its record: `atlas ps` and `atlas stop`
    could not see it. It stops instead, and leaves no socket behind."""
    from types import SimpleNamespace

    from atlas_cli.keepalive import worker
    from atlas_cli.run_service import LoadSpec

    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"w")
    pool = SimpleNamespace(nbytes=0, budget=1 << 30)
    engine = SimpleNamespace(keep_on_disk=lambda *a: None, spill_all=lambda: None, pool=pool)
    loaded = SimpleNamespace(engine=engine)
    monkeypatch.setattr(
        LoadSpec, "open", lambda self: (loaded, SimpleNamespace(path=weights, device="cpu"))
    )

    def full_disk(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(registry, "write_record", full_disk)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # this process keeps its handlers
    spec = LoadSpec(str(weights), "cpu", None, None, None, True, None)
    umask = os.umask(0o022)
    try:
        assert worker.main([json.dumps(spec.__dict__), "60", "k" * 20]) == 1
    finally:
        os.umask(umask)
    assert registry.workers() == [] and not list((tmp_path / "run").glob("*.sock"))


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

    # Ctrl-C in a run the worker answers: the worker stays and serves the next one. Greedy, the
    # story runs all 400 tokens (~3 s); sampled, it could end before the signal and exit 0
    cmd = [sys.executable, "-m", "atlas_cli", "run", str(model), "Tell me a story", "-n", "400"]
    cmd += ["--temperature", "0"]
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
    assert run_json(env, model, prompt)["cached_tokens"] == 0  # a new worker answers
    assert atlas(env, "stop").returncode == 0  # on its way out it writes the conversation
    assert list((root / "cache" / "prefix").glob("*/*.npz"))
    resumed = run_json(env, model, prompt)  # the next worker
    assert resumed["cached_tokens"] >= resumed["prompt_tokens"] - 1


@pytest.mark.slow
def test_runs_started_together_share_one_loaded_copy(home):
    """Two runs at once with no worker yet: one worker loads the model and answers both (the
    second waits for it instead of loading its own copy)."""
    root, model, env = home
    cmd = [sys.executable, "-m", "atlas_cli", "run", str(model), "--json", "-n", "4"]
    procs = [
        subprocess.Popen([*cmd, f"Say {word}."], env=env, stdout=subprocess.PIPE, text=True)
        for word in ("yes", "no")
    ]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(r["kept_alive"] for r in results), results
    assert len(json.loads(atlas(env, "ps", "--json").stdout)) == 1
