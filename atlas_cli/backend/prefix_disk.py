"""Conversations that outlive the process: the prefix pool's folder on disk.

A conversation the pool evicts, and every cached one when `atlas serve` or a keep-alive worker
stops, is written to `<cache dir>/prefix/<model id>/<digest of its tokens>.npz` (the slot-file
format of prefix_pool.py: the cache's arrays, the tokens, no pickle; each member's CRC-32 is
checked as it is read). A later process of the same model file finds the entry sharing the
longest prefix with a prompt that the pool cannot serve as well and resumes from it, so an
agent's next turn after a restart prefills only what is new.

- **Bound to the model file**: the folder is named by the model's fingerprint (architecture,
  config, final norm) and a digest of the weights file's size and sampled bytes (two
  quantisations of one model compute different keys and values); each entry says it again.
- **A quota** in bytes: the least recently used entries (by mtime; a resume touches it) go
  first. An entry that a longer one can return to is removed when the longer one is written.
- **Short conversations are not written** (`MIN_TOKENS`): recomputing them costs less than the
  file.
- **Bad entries**: one that fails its checks (corrupt, cut, another model's, not ours to read)
  is skipped with a log line and deleted where it can be.
- **Several processes** may share the folder: entries are written to a private name and renamed
  into place; one removed by another process is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from atlas_cli.backend.prefix_pool import (
    Slot,
    check_declared_sizes,
    common_prefix,
    read_slot,
    slot_arrays,
    write_slot,
)
from atlas_cli.errors import AtlasError, SlotError
from atlas_cli.store import paths

log = logging.getLogger(__name__)

DISK_BUDGET = 8 << 30  # the default quota, at most a quarter of the disk's free space
DISK_SHARE = 4
MIN_TOKENS = 128
STALE_PARTIAL_S = 600  # a write this old with no rename is a killed process's
SHUTDOWN_SPILL_S = 3.0  # what a stopping process spends writing (Lemonade kills after 5 s)
STOP_WAIT_S = 5.0  # and, before that, how long it waits for the generation in flight to end
SAMPLE_BYTES = 1 << 20  # of the weights file, read from its start, middle and end


def disk_place(folder: str | Path | None = None, quota: int | None = None) -> tuple[Path, int]:
    """Where conversations are kept on disk and within what quota (`--cache-dir`,
    `--cache-disk`): the given ones, else the prefix folder of atlas's cache folder and
    `default_quota` there."""
    folder = Path(folder).expanduser() if folder else paths.cache_dir() / "prefix"
    return folder, default_quota(folder) if quota is None else quota


def default_quota(folder: Path) -> int:
    """`DISK_BUDGET`, or a quarter of the free space of `folder`'s disk where that is less."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DISK_BUDGET
    return min(DISK_BUDGET, free // DISK_SHARE)


def weights_digest(source: Path) -> str:
    """Which weights these are, without reading gigabytes: each file's name and size and a
    sample of its bytes (a re-quantised or edited file differs there)."""
    h = hashlib.sha256()
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}|{size}".encode())
        with open(path, "rb") as f:
            for at in sorted(
                {0, max(size // 2 - SAMPLE_BYTES // 2, 0), max(size - SAMPLE_BYTES, 0)}
            ):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


class PrefixDisk:
    def __init__(self, folder: Path, quota: int, model_id: str):
        """`model_id`: the model's fingerprint and weights digest. No entry is larger than
        `quota` (the quota removes it once written), so none larger is read."""
        self.folder = folder / model_id
        self.model_id = model_id
        self.quota = quota
        self._index: dict[Path, np.ndarray] | None = None  # entry -> its tokens
        self._lock = threading.RLock()  # the index is changed by the writer thread too
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-spill")
        self._pending: list[Future] = []

    # -- finding --------------------------------------------------------------------------

    def lookup(self, ids: list[int], limit: int) -> tuple[Path, int] | None:
        """The entry sharing the longest prefix with `ids[:limit]`, and that prefix's length."""
        target = np.asarray(ids[:limit], np.int64)
        best, length = None, 0
        for path, tokens in self._entries():
            common = common_prefix(tokens, target)
            if common > length:
                best, length = path, common
        return (best, length) if best is not None else None

    def read(self, path: Path) -> tuple[dict, dict, dict, list[int]] | None:
        """An entry's meta, cache arrays, MTP arrays and tokens (prefix_pool.read_slot), or None
        where it is gone or bad (logged, and deleted)."""
        try:
            found = read_slot(path, self.model_id, self.quota)
        except SlotError as exc:
            self.discard(path, str(exc) if path.exists() else None)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the quota removes it last
        return found

    def discard(self, path: Path, why: str | None) -> None:
        """Forget a bad entry: say why (None: it went away on its own) and delete it."""
        if why is not None:
            log.warning("atlas: skipping the cached conversation %s: %s", path.name, why)
        self._forget(path)
        with contextlib.suppress(OSError):
            path.unlink()

    def _entries(self) -> list[tuple[Path, np.ndarray]]:
        """The index as it is now (the writer thread may change it while it is read)."""
        with self._lock:
            return list(self.index().items())

    def _forget(self, path: Path) -> None:
        with self._lock:
            if self._index is not None:
                self._index.pop(path, None)

    def index(self) -> dict[Path, np.ndarray]:
        """The entries' tokens, read once (only the `ids` member of each file)."""
        if self._index is None:
            found, bad = {}, []
            with contextlib.suppress(OSError):
                for path in sorted(self.folder.glob("*.npz")):
                    tokens = _read_tokens(path, self.quota)
                    if tokens is None:
                        bad.append(path)
                    else:
                        found[path] = tokens
            self._index = found
            for path in bad:
                self.discard(path, "it is not a cached conversation")
            self._remove_stale_partials()
        return self._index

    def _remove_stale_partials(self) -> None:
        """Files a process killed mid-write left (a rename never made them entries)."""
        cutoff = time.time() - STALE_PARTIAL_S
        with contextlib.suppress(OSError):
            for path in self.folder.glob(".*.partial"):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()

    # -- writing --------------------------------------------------------------------------

    def spill(self, slot: Slot, wait: bool = False) -> None:
        """Write `slot` (settled: its cache holds exactly its tokens) in the background, or
        before returning with `wait` (a process on its way out)."""
        if len(slot.ids) < MIN_TOKENS or self.quota <= 0:
            return
        tokens = np.asarray(slot.ids, np.int64)
        path = self.folder / f"{hashlib.sha256(tokens.tobytes()).hexdigest()[:32]}.npz"
        arrays = slot_arrays(slot, self.model_id)  # on this thread: a device cache copies here
        covered = [
            p
            for p, t in self._entries()
            if p != path and len(t) < len(tokens) and common_prefix(t, tokens) == len(t)
            and slot.cache.reusable(len(t)) == len(t)
        ]  # fmt: skip
        with self._lock:
            self.index()[path] = tokens
            for p in covered:
                self.index().pop(p, None)
        if wait:
            self._write(arrays, path, covered)
        else:  # a long-running server spills many: keep only the writes not yet done
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write, arrays, path, covered))

    def _write(self, arrays: dict[str, np.ndarray], path: Path, covered: list[Path]) -> None:
        try:
            write_slot(arrays, path)
        except AtlasError as exc:  # a full or read-only disk: the conversation is not kept
            log.warning("atlas: could not keep the conversation on disk: %s", exc)
            self._forget(path)
            return
        for old in covered:
            with contextlib.suppress(OSError):
                old.unlink()
        self._enforce_quota()

    def _enforce_quota(self) -> None:
        entries = []
        with contextlib.suppress(OSError):
            for path in self.folder.glob("*.npz"):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.quota:
                break
            with contextlib.suppress(OSError):
                path.unlink()
            self._forget(path)
            total -= size

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the entries being written."""
        pending, self._pending = self._pending, []
        for future in pending:
            with contextlib.suppress(Exception):
                future.result(timeout)


def _read_tokens(path: Path, max_bytes: int) -> np.ndarray | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            check_declared_sizes(z.zip, max_bytes)
            tokens = z["ids"]
    except Exception:  # noqa: BLE001 - any damage to a cache file is a skipped entry
        return None
    if tokens.dtype != np.int64 or tokens.ndim != 1:
        return None
    return tokens
