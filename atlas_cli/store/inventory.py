"""What is installed: every manifest, plus the embedded default when its file is on disk
(downloaded before manifests existed); and removing a pulled variant."""

from __future__ import annotations

from atlas_cli import recipes
from atlas_cli.store import remove as removal
from atlas_cli.store.embedded import EMBEDDED, installed_path, is_present
from atlas_cli.store.fetch import embedded_entry
from atlas_cli.store.manifest import Installed, recorded


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
    manifest, after checking that every path lies inside the store (see store.remove). Returns
    the bytes freed."""
    others = [e for e in installed() if (e.name, e.variant) != (entry.name, entry.variant)]
    return removal.remove(entry, others)
