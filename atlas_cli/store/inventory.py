"""What is installed: every manifest, plus the embedded default when its file is on disk
(downloaded before manifests existed); and removing a pulled variant."""

from __future__ import annotations

import contextlib

from atlas_cli import recipes
from atlas_cli.store import hub
from atlas_cli.store.embedded import EMBEDDED, embedded_entry, installed_path, is_present
from atlas_cli.store.manifest import Installed, manifest_path, recorded
from atlas_cli.store.paths import models_dir


def installed() -> list[Installed]:
    """Every pulled model variant, sorted by name."""
    entries = {(e.name, e.variant): e for e in recorded()}
    for spec in EMBEDDED.values():  # downloaded before manifests existed (or by `atlas run`)
        target = installed_path(spec)
        if (spec.name, spec.variant) not in entries and is_present(spec, target):
            entries[(spec.name, spec.variant)] = embedded_entry(spec, "unknown", target)
    return sorted(entries.values(), key=lambda e: (e.name, e.variant))


def find_installed(name_or_path: str, device: str | None = None) -> list[Installed]:
    """Installed variants a name refers to: NAME gives all its variants, NAME:VARIANT one."""
    ref = recipes.parse_ref(name_or_path)
    if ref.kind == "local":
        return []
    return [e for e in installed() if e.name == ref.name and variant_matches(ref, e)]


def variant_matches(ref: recipes.ModelRef, entry: Installed) -> bool:
    if ref.variant is None:
        return True
    return entry.variant == ref.variant.lower()


def remove(entry: Installed) -> int:
    """Delete a pulled variant's files (unless another installed model uses them) and its
    manifest. Returns the bytes freed."""
    others = [e for e in installed() if (e.name, e.variant) != (entry.name, entry.variant)]
    freed = 0
    if entry.source == "pypi" or (entry.repo is None or entry.commit is None):
        kept = {p for e in others for p in e.files}
        for path in entry.files:
            if path not in kept and path.is_file():
                freed += path.stat().st_size
                path.unlink()
        parent = entry.path.parent
        if parent.is_relative_to(models_dir()) and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    else:
        keep = {
            (e.repo, e.commit, rp) for e in others if e.repo and e.commit for rp in e.repo_files
        }
        freed = hub.remove(entry.repo, entry.commit, list(entry.repo_files), keep)
    manifest_path(entry.name, entry.variant).unlink(missing_ok=True)
    legacy = models_dir() / entry.name / "manifest.json"
    if entry.name in EMBEDDED:
        legacy.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (models_dir() / entry.name).rmdir()
    with contextlib.suppress(OSError):
        manifest_path(entry.name, entry.variant).parent.rmdir()
    return freed
