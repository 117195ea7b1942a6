"""Where atlas keeps things, and whether there is room there.

A leaf: it imports only the standard library, platformdirs and atlas_cli.errors, so the backend
(the kernel cache, the GGUF header cache) may import it without the rest of the store.

- `$ATLAS_HOME/models/<name>/`: the embedded default's GGUF (Hub downloads stay in the shared
  Hugging Face cache instead, see store.hub);
- `$ATLAS_HOME/manifests/<name>/<variant>.json`: one record per pull (see store.manifest);
- the cache directory: derived data (parsed GGUF headers, compiled kernels), safe to delete.

Without ATLAS_HOME these are the per-user data and cache directories.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from atlas_cli.errors import DownloadError

FREE_SPACE_MARGIN = 256 << 20  # keep this much free after a download


def home() -> Path:
    """ATLAS_HOME, or the per-user data directory."""
    env = os.environ.get("ATLAS_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("atlas", appauthor=False))


def models_dir() -> Path:
    return home() / "models"


def manifests_dir() -> Path:
    return home() / "manifests"


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
