"""Where keep-alive workers live and how to find, list and stop them (standard library only:
`atlas run` reads this before anything heavy is imported).

A worker for load options `spec` listens on `$ATLAS_HOME/run/<key>.sock`, `key` a hash of the
spec, atlas's version and the Python running it, and describes itself in `<key>.json` (pid,
model, device, path, when it expires, its prefix cache). A record whose process is gone is
stale and removed by whoever finds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_cli import __version__
from atlas_cli.store.paths import run_dir

# AF_UNIX paths are limited to 108 bytes on Linux (104 on macOS): past this, no keep-alive
MAX_SOCKET_PATH = 100
WORKER_MODULE = "atlas_cli.keepalive.worker"


def supported() -> bool:
    return hasattr(socket, "AF_UNIX")


def key_of(spec: dict[str, Any]) -> str:
    """The worker key of a set of load options: the same options, the same worker."""
    # the environment (a venv's prefix), not the interpreter's name: `python` and `python3`
    # are the same worker
    python = [sys.prefix, os.path.realpath(sys.executable)]
    text = json.dumps({"spec": spec, "atlas": __version__, "python": python}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def socket_path(key: str) -> Path | None:
    """The worker's socket, or None where the path would be too long for a Unix socket."""
    path = run_dir() / f"{key}.sock"
    return path if len(os.fsencode(path)) <= MAX_SOCKET_PATH else None


def record_path(key: str) -> Path:
    return run_dir() / f"{key}.json"


def log_path(key: str) -> Path:
    return run_dir() / f"{key}.log"


@dataclass(frozen=True)
class Worker:
    key: str
    pid: int
    model: str  # as the user named it
    path: str  # the loaded file or directory
    device: str
    expires_at: float  # wall-clock time; renewed by every request
    cache_bytes: int = 0  # what its prefix cache holds after the last request
    cache_budget: int = 0  # and may hold (evicting least recently used conversations past it)

    def memory_bytes(self) -> int | None:
        """The worker's resident memory (Linux /proc), None where that cannot be read."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return None


def write_record(worker: Worker) -> None:
    """The record, replaced atomically (a reader never sees half of it)."""
    path = record_path(worker.key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(worker.__dict__))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return WORKER_MODULE.encode() in cmdline  # a recycled pid is not our worker


def forget(key: str) -> None:
    """Remove a worker's socket and record (its log stays: it says why a worker ended); what
    cannot be removed (a folder there, another user's file) stays, without an error."""
    for path in (record_path(key), socket_path(key)):
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def run_dir_problem() -> str | None:
    """Why the run folder cannot hold this user's workers, or None once it can: it is made
    0700 where missing or open to others; another user's folder (left by `sudo -E atlas run`),
    or something else at its path, is never used."""
    path = run_dir()
    try:
        with contextlib.suppress(FileExistsError):  # (a link there is not followed)
            path.mkdir(parents=True, mode=0o700)
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a folder; remove it"
        if st.st_uid != os.geteuid():
            return f"{path} belongs to another user (uid {st.st_uid}); remove it, or set ATLAS_HOME"
        if st.st_mode & 0o077:
            path.chmod(0o700)
    except OSError as exc:
        return f"cannot use {path} ({exc.strerror or exc})"
    return None


def peer_is_this_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of a connected Unix socket runs as this user
    (Linux's SO_PEERCRED; elsewhere the socket's owner, checked before connecting, decides)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return True
    creds = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.geteuid()


def owned_socket(path: Path) -> bool:
    """Whether `path` is a Unix socket of this user's (a link is not followed): a folder, a
    file or another user's socket there is never connected to, so a shared ATLAS_HOME cannot
    hand one user's prompts to another's process."""
    try:
        st = path.lstat()
    except OSError:  # absent, or in a folder this user cannot read
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()


def workers() -> list[Worker]:
    """The live workers, oldest first; stale records (their process gone) are removed."""
    found = []
    directory = run_dir()
    if not directory.is_dir():
        return []
    for path in sorted(directory.glob("*.json")):
        try:
            worker = Worker(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if _alive(worker.pid):
            found.append(worker)
        else:
            forget(worker.key)
    return found


def stop(worker: Worker, timeout: float = 5.0) -> None:
    """End a worker (SIGTERM: it removes its socket and record on the way out) and wait."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    forget(worker.key)


def matching(name: str | None) -> list[Worker]:
    """The workers of model `name` (as named at `atlas run`, or its loaded path); all of them
    for None."""
    if name is None:
        return workers()
    if os.path.exists(name):  # a file however it is written: my.gguf, ./my.gguf, its path
        wanted = os.path.realpath(name)
        return [w for w in workers() if wanted in map(os.path.realpath, (w.path, w.model))]
    return [w for w in workers() if w.model.lower() == name.lower()]


def stop_for_paths(paths: list[Path]) -> None:
    """Stop the workers that hold a model under any of `paths` (before `atlas rm` deletes it)."""
    roots = [os.path.abspath(p) for p in paths]
    for worker in workers():
        if any(worker.path == r or worker.path.startswith(r + os.sep) for r in roots):
            stop(worker)


def start(spec: dict[str, Any], hold_s: float, key: str):
    """Start a detached worker for `spec` unless one is there (or starting: it binds its socket
    before it loads); its process, or None. It outlives this process; its errors go to its log,
    never to the user's terminal."""
    import subprocess

    path = socket_path(key)
    if path is None or os.path.lexists(path):  # a worker, or something not ours: leave it
        return None
    try:
        run_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
        # a link planted at the log's name is not followed (it could truncate any file)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        log = os.fdopen(os.open(log_path(key), flags, 0o600), "wb")
    except OSError:  # a read-only or full home: no worker, no error
        return None
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, json.dumps(spec), repr(hold_s), key],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # Ctrl-C in the terminal is not for it
            close_fds=True,
        )
