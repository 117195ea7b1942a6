"""Where llama-server's `POST /slots/{id}?action=save|restore` may read and write: only inside the
folder given by `--slot-save-path` (no folder, no saving: llama-server's rule), by plain file
names, and within a quota of bytes counted over every file in that folder, so a client cannot
fill the disk of whoever runs the server."""

from __future__ import annotations

import os
import re
from pathlib import Path

from atlas_cli.errors import SlotError, UsageError
from atlas_cli.serve.errors import APIError

SLOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# The default prefix-cache budget of `atlas serve` (SERVE_BUDGET): room to save every
# conversation a default server holds in memory at once, and a bound a user can predict (the
# cache's real budget depends on the memory free at load).
DEFAULT_QUOTA = 8 << 30


def slot_folder(path: str | os.PathLike) -> Path:
    """`--slot-save-path`, made if missing; a usage error when it cannot be written."""
    folder = Path(path).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--slot-save-path {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--slot-save-path {folder} is not writable")
    return folder


def slot_file(folder: Path, name: str) -> Path:
    """The file of a saved slot: a plain name inside `folder`, nothing else."""
    if not SLOT_NAME.fullmatch(name or "") or ".." in name:
        raise SlotError(
            f"bad slot filename {name!r}: use letters, digits, '.', '_' and '-' "
            "(at most 128, no folders)"
        )
    return folder / name


def used_bytes(folder: Path, leaving_out: Path) -> int:
    """The bytes of the files in `folder`, but for `leaving_out` (a save replaces it)."""
    total = 0
    if not folder.is_dir():
        return total  # the first save makes it
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False) and entry.name != leaving_out.name:
                total += entry.stat(follow_symlinks=False).st_size
    return total


def save_within_quota(engine, slot_id: int, path: Path, quota: int) -> tuple[int, int]:
    """`engine.save_slot` unless the folder would then hold more than `quota` bytes: a full
    folder writes nothing; a save that overflows it is removed again. Runs on the engine
    thread, after the saves queued before it, so two saves never race for the last bytes."""
    used = used_bytes(path.parent, path)
    if used >= quota:
        raise _over_quota(used, quota)
    n, size = engine.save_slot(slot_id, path)
    if used + size > quota:
        path.unlink(missing_ok=True)
        raise _over_quota(used + size, quota)
    return n, size


def _over_quota(needed: int, quota: int) -> APIError:
    return APIError(
        507,
        f"saving this slot would fill the slot folder to {needed:,} bytes, over its quota of "
        f"{quota:,}; reuse a saved name, remove saved slots, or raise --slot-save-quota",
        type="server_error",
        code="slot_quota_exceeded",
    )
