"""The record of one pulled model variant, and its manifest file.

`$ATLAS_HOME/manifests/<name>/<variant>.json` records each pull (source, revision, commit,
files, sizes, hashes, and each verified file's size and mtime: see store.verify); `atlas list`
reads them. A manifest is written last, and through a
temporary file, so a pull that was interrupted never shows up as installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from atlas_cli.store.paths import manifests_dir, store_writes
from atlas_cli.store.verify import stamp


@dataclass(frozen=True)
class Installed:
    """One pulled model variant, as its manifest records it."""

    name: str  # recipe name or hf.co/org/repo
    variant: str
    format: str
    quantization: str
    path: Path  # what backend.load opens: a file, or a snapshot directory
    files: tuple[Path, ...]
    size: int
    source: str  # "pypi", "hub", "hub-cache" (found in the HF cache), "unknown"
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None
    pulled: str = ""  # ISO 8601
    repo_files: tuple[str, ...] = field(default=(), repr=False)  # in-repo names (hub)
    sha256: dict[str, str] = field(default_factory=dict, repr=False)
    # (size, mtime_ns) per in-repo name, of files whose hash was checked (see store.verify)
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def tag(self) -> str:
        return f"{self.name}:{self.variant}"

    @property
    def complete(self) -> bool:
        return all(p.is_file() for p in self.files)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "variant": self.variant,
            "format": self.format,
            "quantization": self.quantization,
            "path": str(self.path),
            "size": self.size,
            "source": self.source,
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "pulled": self.pulled,
            "complete": self.complete,
            "files": [
                {"path": str(p), "repo_path": rp, "sha256": self.sha256.get(rp)}
                | _stamp_json(self.stamps.get(rp))
                for p, rp in zip(self.files, self.in_repo_names, strict=True)
            ],
        }

    @property
    def in_repo_names(self) -> tuple[str, ...]:
        return self.repo_files or tuple(p.name for p in self.files)


def _stamp_json(stamp: tuple[int, int] | None) -> dict[str, int]:
    return {"verified_size": stamp[0], "verified_mtime_ns": stamp[1]} if stamp else {}


def manifest_path(name: str, variant: str) -> Path:
    safe = name.replace("/", "--")
    return manifests_dir() / safe / (variant.replace("/", "--") + ".json")


def write_manifest(entry: Installed) -> None:
    path = manifest_path(entry.name, entry.variant)
    data = entry.as_json()
    data.pop("complete")
    tmp = path.with_name(path.name + ".tmp")
    with store_writes():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def stamped(entry: Installed) -> Installed:
    """`entry` with its files' current stamps: call it once their hashes have been checked."""
    stamps = {rp: stamp(p) for p, rp in zip(entry.files, entry.in_repo_names, strict=True)}
    return dataclasses.replace(entry, stamps=stamps)


def read_manifest(path: Path) -> Installed | None:
    try:
        d = json.loads(path.read_text())
        files = d.get("files", [])
        return Installed(
            name=d["name"],
            variant=d["variant"],
            format=d["format"],
            quantization=d["quantization"],
            path=Path(d["path"]),
            files=tuple(Path(f["path"]) for f in files),
            size=int(d["size"]),
            source=d.get("source", "unknown"),
            repo=d.get("repo"),
            revision=d.get("revision"),
            commit=d.get("commit"),
            pulled=d.get("pulled", ""),
            repo_files=tuple(f.get("repo_path") or Path(f["path"]).name for f in files),
            sha256={
                (f.get("repo_path") or Path(f["path"]).name): f["sha256"]
                for f in files
                if f.get("sha256")
            },
            stamps={
                (f.get("repo_path") or Path(f["path"]).name): (
                    int(f["verified_size"]),
                    int(f["verified_mtime_ns"]),
                )
                for f in files
                if "verified_size" in f and "verified_mtime_ns" in f
            },
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged manifest: the model shows as not installed


def recorded() -> Iterator[Installed]:
    """Every readable manifest on disk, in no particular order."""
    root = manifests_dir()
    if not root.is_dir():
        return
    for path in root.glob("*/*.json"):
        entry = read_manifest(path)
        if entry is not None:
            yield entry


def now() -> str:
    """A manifest's timestamp: UTC, ISO 8601, to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")
