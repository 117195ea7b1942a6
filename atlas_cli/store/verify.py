"""Is an installed file still the bytes whose hash was checked when it was pulled?

A manifest records each file's size and mtime (its stamp) once the file's hash has been checked.
Hashing a 17 GB model on every `atlas pull` would cost a minute, so a pull hashes a file again
only when its stamp changed (the file was rewritten, truncated, touched) or the manifest has no
stamp for it, and always with `--verify`. Same-size damage with the mtime kept is found by
`--verify` only: that is what the flag is for.

The expected hash is the one the manifest records (the Hub's LFS sha256, the recipe's), else the
name of the Hugging Face cache blob the file links to, which is its sha256 (LFS files) or its git
blob id (small files) by the cache's own layout.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

CHUNK = 1 << 20
SHA256 = re.compile(r"^[0-9a-f]{64}$")
GIT_BLOB = re.compile(r"^[0-9a-f]{40}$")

Stamp = tuple[int, int]  # (size, mtime in ns)


def stamp(path: Path) -> Stamp:
    """The file's size and mtime (through a symlink: the blob's)."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def hexdigest(path: Path, kind: str = "sha256") -> str:
    """sha256 of the file, or (kind "git") its git blob id: sha1("blob <size>\\0" + bytes)."""
    if kind == "sha256":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()
        digest.update(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def expected_hash(
    path: Path, sha256: str | None = None, git_blob: str | None = None
) -> tuple[str, str] | None:
    """(kind, hex) the file must hash to, or None when nothing says."""
    if sha256:
        return "sha256", sha256
    if git_blob:
        return "git", git_blob
    blob = path.resolve().name
    if SHA256.match(blob):
        return "sha256", blob
    if GIT_BLOB.match(blob):
        return "git", blob
    return None


def intact(path: Path, sha256: str | None = None, git_blob: str | None = None) -> bool:
    """Whether the file hashes to what it should (True when nothing says what that is)."""
    expected = expected_hash(path, sha256, git_blob)
    return expected is None or hexdigest(path, expected[0]) == expected[1]


def unchanged(path: Path, recorded: Stamp | None) -> bool:
    """Whether the file's stamp is the one recorded when its hash was last checked."""
    return recorded is not None and stamp(path) == tuple(recorded)
