"""Removing a pulled variant: first a plan, every path in it checked, then the deletions.

A manifest is a file on disk that anything may have edited, so nothing it names is deleted on
trust. Every path is resolved (symlinks, `..`) and must lie inside the store's models folder,
or inside the model's own entry of the Hugging Face cache (`models--org--repo/snapshots/<commit>`
for links, `models--org--repo/blobs` for what they point to). One path outside, or one folder
that cannot be written, refuses the whole removal before anything is deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from atlas_cli.errors import StoreError
from atlas_cli.store import hub
from atlas_cli.store.embedded import EMBEDDED
from atlas_cli.store.manifest import Installed, manifest_path
from atlas_cli.store.paths import inside, location, manifests_dir, models_dir, store_writes


@dataclass
class Plan:
    """What removing one variant deletes; every path already checked."""

    manifest: Path
    files: list[Path] = field(default_factory=list)  # store files, snapshot links or copies
    blobs: set[Path] = field(default_factory=set)  # HF cache blobs, if nothing else links them
    repo_dir: Path | None = None  # the HF cache entry, pruned when empty
    snapshot: Path | None = None
    commit: str | None = None


def remove(entry: Installed, others: list[Installed]) -> int:
    """Delete `entry`'s files (those no entry in `others` uses) and its manifest. Bytes freed."""
    plan = plan_removal(entry, others)
    for path in [plan.manifest, *plan.files, *plan.blobs]:
        _writable(location(path).parent, entry.tag)
    with store_writes():
        return _execute(plan, entry)


def plan_removal(entry: Installed, others: list[Installed]) -> Plan:
    manifest = manifest_path(entry.name, entry.variant)
    _check(manifest, manifests_dir(), manifest)
    plan = Plan(manifest)
    if entry.source == "pypi" or entry.repo is None or entry.commit is None:
        kept = {p for e in others for p in e.files}
        for path in entry.files:
            if path not in kept and (path.is_file() or path.is_symlink()):
                _check(path, models_dir(), manifest)
                plan.files.append(path)
        return plan
    rdir = hub.repo_dir(entry.repo)
    _check(rdir, hub.cache_root(), manifest)
    if not hub.COMMIT.match(entry.commit):
        raise _outside(manifest, f"commit {entry.commit!r}", rdir)
    snap = rdir / "snapshots" / entry.commit
    plan.repo_dir, plan.snapshot, plan.commit = rdir, snap, entry.commit
    keep = {(e.repo, e.commit, rp) for e in others if e.repo and e.commit for rp in e.repo_files}
    for name in entry.repo_files:
        pointer = snap / name
        if (entry.repo, entry.commit, name) in keep:
            continue
        _check(pointer, snap, manifest)
        if pointer.is_symlink():
            blob = pointer.resolve()
            _check(blob, rdir / "blobs", manifest)
            plan.blobs.add(blob)
            plan.files.append(pointer)
        elif pointer.is_file():  # a copy (no symlinks on this system)
            plan.files.append(pointer)
    return plan


def _execute(plan: Plan, entry: Installed) -> int:
    freed = 0
    for path in plan.files:
        if not path.is_symlink():
            freed += path.stat().st_size
        path.unlink()
    if plan.repo_dir is not None:
        freed += _drop_unlinked_blobs(plan)
    else:
        parent = location(entry.path).parent
        if inside(parent, models_dir()) and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    plan.manifest.unlink(missing_ok=True)
    if entry.name in EMBEDDED:  # the manifest of atlas versions before manifests/
        (models_dir() / entry.name / "manifest.json").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (models_dir() / entry.name).rmdir()
    with contextlib.suppress(OSError):
        plan.manifest.parent.rmdir()
    return freed


def _drop_unlinked_blobs(plan: Plan) -> int:
    """Delete the plan's blobs no snapshot links to any more, then what is left empty."""
    rdir, snap = plan.repo_dir, plan.snapshot
    freed = 0
    still_linked = {p.resolve() for p in (rdir / "snapshots").rglob("*") if p.is_symlink()}
    for blob in plan.blobs:
        if blob not in still_linked and blob.is_file():
            freed += blob.stat().st_size
            blob.unlink()
    _prune(snap, stop=rdir / "snapshots")
    if snap.exists():
        return freed
    for ref in (rdir / "refs").rglob("*") if (rdir / "refs").is_dir() else ():
        with contextlib.suppress(OSError):
            if ref.is_file() and ref.read_text().strip() == plan.commit:
                ref.unlink()
    snapshots = rdir / "snapshots"
    if (not snapshots.exists() or not any(snapshots.iterdir())) and not any(
        (rdir / "blobs").glob("*")
    ):
        shutil.rmtree(rdir, ignore_errors=True)
    return freed


def _prune(directory: Path, stop: Path) -> None:
    """Remove empty directories from the bottom of `directory` up to (not including) `stop`."""
    if not directory.exists():
        return
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    d = directory
    while d != stop and d.is_relative_to(stop):
        try:
            d.rmdir()
        except OSError:
            break
        d = d.parent


def _check(path: Path, root: Path, manifest: Path) -> None:
    if not inside(path, root):
        raise _outside(manifest, str(path), root)


def _outside(manifest: Path, what: str, root: Path) -> StoreError:
    return StoreError(
        f"{manifest} names {what}, outside {root}; nothing was deleted (delete that manifest "
        "yourself if you did not write it)"
    )


def _writable(directory: Path, tag: str) -> None:
    if directory.exists() and not os.access(directory, os.W_OK):
        raise StoreError(
            f"cannot remove {tag}: {directory} is read-only; nothing was deleted (make it "
            "writable, or set ATLAS_HOME to the store you mean)"
        )
