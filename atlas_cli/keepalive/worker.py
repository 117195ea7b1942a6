"""The keep-alive worker: `python -m atlas_cli.keepalive.worker SPEC HOLD_S KEY`, started by
`registry.start` after an in-process `atlas run`. It binds its socket first (so a second run
sees it and does not start another), loads the model as `atlas run` does, then answers one run
at a time until it has been idle for HOLD_S seconds, gets SIGTERM (`atlas stop`, `atlas rm`) or
finds its model file changed. Loading and answering are run_service's, as in `atlas run`.
Protocol: keepalive/client.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.prefix_disk import STOP_WAIT_S, disk_place
from atlas_cli.cpu_threads import use_threads
from atlas_cli.errors import AtlasError
from atlas_cli.keepalive import client, registry
from atlas_cli.run_service import LoadSpec, RunRequest, reply, stats_record
from atlas_cli.store.paths import run_dir

TURN_POLL_S = 0.25  # how often a waiting run looks at the model and the lock


def fingerprint(path: Path) -> tuple:
    """What changes when a model file is replaced (re-pulled, edited, deleted)."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    try:
        return tuple((p.name, *_stat(p)) for p in files)
    except OSError:
        return ()


def _stat(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


class Worker:
    def __init__(self, spec: LoadSpec, hold_s: float, key: str):
        self.spec, self.hold_s, self.key = spec, hold_s, key
        self.model = None
        self.path: Path | None = None
        self.device = spec.device or "cpu"
        self.identity: tuple = ()
        self.lock = threading.Lock()  # one run at a time; the others wait their turn
        self.clients: set[int] = set()  # the connections being answered or waiting
        self.notes: list[str] = []  # what loading says (a kernel compile): each client hears it
        self.stopping = threading.Event()
        self.deadline = time.monotonic() + hold_s

    # -- the connection side (one thread per connection) ----------------------------------

    def serve(self, server: socket.socket) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed on the way out
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8") as lines:
            try:
                message = json.loads(lines.readline() or "{}")
                if message.get("op") == "ping":
                    send(conn, {"pong": os.getpid()})
                elif message.get("op") == "run":
                    self.run(conn, RunRequest.from_message(message["request"]))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (Ctrl-C): the generation has stopped
            except (ValueError, TypeError, KeyError, AttributeError):
                send(conn, {"error": "malformed keep-alive request", "type": "AtlasError"})

    def run(self, conn: socket.socket, request: RunRequest) -> None:
        """Answer `request` once the model has loaded and the runs before it have ended (a run
        started while another answers, or while the model loads, shares this copy); the
        client hears a heartbeat meanwhile."""
        out = Replies(conn, self.notes)
        self.clients.add(id(out))
        try:
            with out.heartbeat():
                if not self.take_turn(out):
                    out.send({"busy": True})  # stopping: the client answers in-process
                    return
                try:
                    last = self.answer(out, request)
                finally:
                    self.renew()
                    self.lock.release()
            # after the release: a client that runs again at once finds the worker free
            out.send(last)
        finally:
            self.clients.discard(id(out))

    def take_turn(self, out: Replies) -> bool:
        """Wait for the model and the lock; False when the worker stops or the client left."""
        while not self.stopping.is_set() and not out.gone:
            if self.model is None:
                time.sleep(TURN_POLL_S)
            elif self.lock.acquire(timeout=TURN_POLL_S):
                return True
        return False

    def answer(self, out: Replies, request: RunRequest) -> dict:
        """Stream the reply to `request`; the message that ends it."""
        if fingerprint(self.path) != self.identity:
            self.stopping.set()
            return {"stale": True}
        out.send({"accepted": True})
        try:
            stats = reply(self.model, request, lambda text: out.send({"text": text}))
        except AtlasError as exc:
            return {"error": str(exc), "type": type(exc).__name__}
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # a bug: say so in one line, log it, and stop serving
            traceback.print_exc()
            self.stopping.set()
            return {"error": f"the kept-alive model failed: {exc}", "type": "AtlasError"}
        return {"done": stats_record(stats)}

    def renew(self) -> bool:
        """Hold the model HOLD_S more; False where its record could not be written (a full
        disk): `atlas ps` and `atlas stop` would not see the worker."""
        self.deadline = time.monotonic() + self.hold_s
        try:
            self._write_record()
        except OSError:
            return False
        return True

    def _write_record(self) -> None:
        """The record `atlas ps` and `atlas stop` read: written when the socket is bound (a
        loading worker can be stopped), again when loaded and after every run."""
        pool = self.model.engine.pool if self.model is not None else None
        registry.write_record(
            registry.Worker(
                key=self.key,
                pid=os.getpid(),
                model=self.spec.model,
                path=str(self.path or self.spec.model),
                device=self.device,
                expires_at=time.time() + self.hold_s,
                cache_bytes=pool.nbytes if pool else 0,
                cache_budget=pool.budget if pool else 0,
            )
        )

    # -- the main thread ------------------------------------------------------------------

    def keep_conversations(self) -> None:
        """On the way out: the cached conversations to disk, for the next worker (not those
        of a model file that changed: they belong to the old one)."""
        if self.model is None or fingerprint(self.path) != self.identity:
            return
        if self.lock.acquire(timeout=STOP_WAIT_S):  # the run in flight ends first
            try:
                self.model.engine.spill_all()
            finally:
                self.lock.release()

    def wait_until_idle(self) -> None:
        while not self.stopping.wait(0.25):
            if time.monotonic() > self.deadline and not self.clients:
                return


def send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


class Replies:
    """One run's messages to its client: the reply's pieces and, while it is being worked on
    (a long prompt may take minutes before its first piece), a heartbeat, so that the client
    can tell a working worker from a wedged one (`client.SILENT_WORKER_S`)."""

    def __init__(self, conn: socket.socket, notes: list[str] = ()):
        self.conn = conn
        self.lock = threading.Lock()  # two threads write to one socket
        self.gone = False  # the client closed the connection (Ctrl-C)
        self.notes, self.told = notes, 0  # the worker's notes, and how many this client heard

    def send(self, message: dict) -> None:
        with self.lock:
            try:
                send(self.conn, message)
            except OSError:
                self.gone = True
                raise

    @contextlib.contextmanager
    def heartbeat(self):
        done = threading.Event()

        def beat():
            while True:
                with contextlib.suppress(OSError):  # the client went: the reply finds out
                    while self.told < len(self.notes):
                        self.send({"note": self.notes[self.told]})
                        self.told += 1
                if done.wait(client.HEARTBEAT_S):
                    return
                with contextlib.suppress(OSError):
                    self.send({"alive": True})

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def bind(key: str) -> socket.socket | None:
    """The worker's listening socket; None when another worker for `key` answers on it."""
    path = registry.socket_path(key)
    if path is None:
        return None
    if os.path.lexists(path):
        if client.ping(key) is not None:
            return None
        with contextlib.suppress(OSError):  # (a folder there stays, and bind fails)
            path.unlink()  # left by a worker that was killed
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
    except OSError:  # another worker bound it first
        server.close()
        return None
    server.listen(8)
    return server


def main(argv: list[str]) -> int:
    spec, hold_s, key = LoadSpec(**json.loads(argv[0])), float(argv[1]), argv[2]
    os.umask(0o077)  # the socket and record: this user's only
    run_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
    server = bind(key)
    if server is None:
        return 0
    worker = Worker(spec, hold_s, key)

    def on_term(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the run's, not ours
    if not worker.renew():  # a worker nobody can list or stop is not left running
        print("atlas keep-alive: cannot write the worker's record; stopping", file=sys.stderr)
        server.close()
        registry.forget(key)
        return 1
    try:
        threading.Thread(target=worker.serve, args=(server,), daemon=True).start()
        use_threads(spec.threads)
        jit.notice_to = worker.notes.append  # a compile's notice goes to the waiting run
        worker.model, resolved = spec.open()
        worker.path, worker.device = resolved.path, resolved.device
        worker.identity = fingerprint(worker.path)
        worker.model.engine.keep_on_disk(*disk_place(), worker.path)
        worker.renew()
        worker.wait_until_idle()
    except AtlasError as exc:
        print(f"atlas keep-alive: {exc}", file=sys.stderr)
        return 1
    finally:
        worker.stopping.set()
        server.close()
        registry.forget(key)
        worker.keep_conversations()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
