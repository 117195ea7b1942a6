"""One lock per model, so two atlas processes (or threads) fetching the same model take turns.

Without it two `atlas pull` (or `atlas run` of a model not downloaded yet) append to the same
partial file and both fail with a sha256 mismatch. The lock is an OS file lock
(`$ATLAS_HOME/locks/<name>.lock`, through `filelock`), so a process that dies releases it. The
second process says once that it waits, then finds the model installed and fetches nothing.

Locks are re-entrant within a thread (`pull` holds it while `ensure_embedded` takes it again):
one FileLock object per lock file, whose counter is per thread (thread_local), so two threads
of one process still exclude each other through separate file descriptors.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from atlas_cli.store.paths import locks_dir, store_writes

_locks: dict[str, object] = {}
_guard = threading.Lock()


def lock_file_name(name: str) -> str:
    """The lock file of a model name (recipe, hf.co/org/repo): one path component."""
    return name.lower().replace("/", "--").replace("\\", "--") + ".lock"


@contextlib.contextmanager
def model_lock(name: str) -> Iterator[None]:
    """Hold `name`'s lock for the block; say so on stderr when another process holds it."""
    from filelock import FileLock, Timeout

    path = locks_dir() / lock_file_name(name)
    with store_writes():
        path.parent.mkdir(parents=True, exist_ok=True)
    with _guard:
        lock = _locks.setdefault(str(path), FileLock(path, thread_local=True))
    with store_writes():
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"waiting for another atlas process pulling {name}", file=sys.stderr, flush=True)
            lock.acquire()
    try:
        yield
    finally:
        lock.release()
