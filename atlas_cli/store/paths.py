"""Where atlas keeps things, and whether there is room there.

A leaf: it imports only the standard library, platformdirs and atlas_cli.errors, so the backend
(the kernel cache, the GGUF header cache) may import it without the rest of the store.

- `$ATLAS_HOME/models/<name>/`: the embedded default's GGUF (Hub downloads stay in the shared
  Hugging Face cache instead, see store.hub);
- `$ATLAS_HOME/manifests/<name>/<variant>.json`: one record per pull (see store.manifest);
- `$ATLAS_HOME/locks/<name>.lock`: taken while a model is pulled (see store.lock);
- `$ATLAS_HOME/run/`: the sockets and records of models kept loaded after `atlas run`
  (see atlas_cli.keepalive);
- the cache directory: derived data (parsed GGUF headers, compiled kernels, saved prefix-cache
  slots under `slots/`), safe to delete.

Without ATLAS_HOME these are the per-user data and cache directories.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from atlas_cli.errors import DownloadError, StoreError

FREE_SPACE_MARGIN = 256 << 20  # keep this much free after a download
WRITABLE_HINT = "make it writable, or set ATLAS_HOME (HF_HOME for Hub downloads) elsewhere"


def home() -> Path:
    """ATLAS_HOME, or the per-user data directory."""
    env = os.environ.get("ATLAS_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("atlas", appauthor=False))


def existing_path(text: str) -> Path | None:
    """`text` as a path when it names an existing file or directory."""
    try:
        path = Path(text).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError):  # names too long for the filesystem, NUL bytes
        return None


def models_dir() -> Path:
    return home() / "models"


def manifests_dir() -> Path:
    return home() / "manifests"


def locks_dir() -> Path:
    return home() / "locks"


def run_dir() -> Path:
    """Sockets and records of the keep-alive workers (atlas_cli.keepalive)."""
    return home() / "run"


def cache_dir() -> Path:
    """Derived data (parsed GGUF headers, compiled kernels): safe to delete."""
    env = os.environ.get("ATLAS_HOME")
    if env:
        return Path(env).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("atlas", appauthor=False))


def check_free_space(directory: Path, needed: int, hub: bool = False) -> None:
    """Refuse a download of `needed` bytes into `directory` before it starts, not halfway."""
    if needed <= 0:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        where = "set HF_HOME (or HF_HUB_CACHE)" if hub else "set ATLAS_HOME"
        raise DownloadError(
            f"not enough disk space in {directory}: {needed / 1e6:,.0f} MB needed, "
            f"{free / 1e6:,.0f} MB free; free some space or {where} to another disk"
        )


def location(path: Path) -> Path:
    """Where the directory entry `path` really is: its folder resolved (symlinks, `..`), its own
    name kept, so that a symlink is judged by where it lies, not by what it points to."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name


def inside(path: Path, root: Path) -> bool:
    """Whether the entry `path` lies strictly inside `root` (both resolved first)."""
    where, top = location(path), root.resolve()
    return where != top and where.is_relative_to(top)


@contextlib.contextmanager
def store_writes(hint: str = WRITABLE_HINT) -> Iterator[None]:
    """Writing into the store: a read-only disk, a folder without permission or a full disk
    become one line that names the path, instead of a traceback."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or "the model store"
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise StoreError(f"cannot write to {where} ({exc.strerror}); {hint}") from None
        if exc.errno == errno.ENOSPC:
            raise StoreError(
                f"no space left on the disk of {where}; free some space and run the command "
                "again (a download resumes where it stopped)"
            ) from None
        raise
