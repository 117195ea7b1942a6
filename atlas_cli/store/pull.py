"""`pull(name)`: download a recipe variant, NAME:VARIANT or hf.co/org/repo[:QUANT] if needed.

Hub downloads stay in the shared Hugging Face cache (see store.hub), so files other tools
fetched are reused and nothing is stored twice; a manifest records each pull once it is
complete. Offline (or with the Hub unreachable) a copy already downloaded is used.

One pull of a model at a time (store.lock). An installed copy is hashed again when its files'
sizes or mtimes changed since they were last checked, or always with `verify` (store.verify);
a damaged file is reported and downloaded again.

Which variant a bare recipe name gets depends on the machine, which the store does not probe:
the caller passes its rule from a device to a hardware class (`hardware.hardware_class`, from
the session and the commands), and it is asked only when a variant must be picked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from atlas_cli import recipes
from atlas_cli.errors import CorruptModelError, DownloadError, ModelNotFoundError, UsageError
from atlas_cli.store import hub, inventory, verify
from atlas_cli.store.embedded import EmbeddedModel, embedded_spec, installed_path, is_present
from atlas_cli.store.fetch import embedded_entry, ensure_embedded
from atlas_cli.store.lock import model_lock
from atlas_cli.store.manifest import (
    Installed,
    manifest_path,
    now,
    read_manifest,
    stamped,
    write_manifest,
)
from atlas_cli.store.paths import FREE_SPACE_MARGIN, check_free_space, store_writes

# a device (None: this machine's) -> the recipe hardware class its variants are picked for
HardwareClass = Callable[[str | None], str]


def pull(
    name: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    device: str | None = None,
    progress=None,
    verify_all: bool = False,
    hardware_class: HardwareClass | None = None,
) -> Installed:
    """Download `name` (recipe, NAME:VARIANT or hf.co/org/repo[:QUANT]) if needed.

    An installed copy's changed files are hashed again (every file with `verify_all`).
    `hardware_class` picks a bare recipe name's variant for `device` (see `recipe_variant`)."""
    ref = recipes.parse_ref(name)
    if ref.kind == "local":
        raise UsageError(f"{name} is a local path: nothing to pull")
    with model_lock(ref.name):
        local_only = hub.offline(offline)
        if ref.kind == "hub":
            return _pull_hub_ref(ref, revision, local_only, progress, verify_all)
        variant = recipe_variant(ref, device, hardware_class)
        return _pull_recipe(ref.recipe, variant, revision, local_only, progress, verify_all)


def recipe_variant(
    ref: recipes.ModelRef, device: str | None, hardware_class: HardwareClass | None
) -> str:
    """The variant a recipe reference names, else its recipe's variant for `device`'s hardware
    class: `hardware_class` is asked only then, so naming a variant costs no probe. Without
    one, the CPU's variant (as the Python API runs on the CPU unless told)."""
    if ref.variant:
        return ref.variant
    return ref.recipe.variant_for(hardware_class(device) if hardware_class else "cpu")


def _pull_recipe(recipe, variant: str, revision, offline: bool, progress, verify_all) -> Installed:
    v = recipe.variants[variant]
    spec = embedded_spec(recipe, variant)
    if spec is not None and revision is None:
        _recheck_embedded(spec, verify_all)
        target = ensure_embedded(spec, progress=progress, offline=offline)
        return embedded_entry(spec, "unknown", target)
    return _pull_from_hub(
        name=recipe.name,
        variant=variant,
        fmt=v.format,
        quantization=v.quantization,
        repo=v.repo,
        revision=revision or v.revision,
        patterns=v.patterns,
        offline=offline,
        progress=progress,
        expected_sha256=v.sha256 if revision is None else None,
        verify_all=verify_all,
    )


def _downloaded(ref: recipes.ModelRef, verify_all: bool) -> Installed | None:
    """A complete installed copy of a Hub reference, if there is one (checked: see _checked)."""
    for entry in inventory.installed():
        if entry.name == ref.name and inventory.variant_matches(ref, entry) and entry.complete:
            return _checked(entry, verify_all)
    return None


def _pull_hub_ref(ref, revision: str | None, offline: bool, progress, verify_all) -> Installed:
    revision = revision or "main"
    if offline:
        entry = _downloaded(ref, verify_all)
        if entry is not None:
            return entry
        raise _not_cached(ref.name, ref.repo, revision)
    try:
        listing = hub.list_repo(ref.repo, revision)
    except hub.HubUnreachable as exc:
        entry = _downloaded(ref, verify_all)
        if entry is not None:
            _warn(f"{exc}; using the downloaded copy of {entry.tag}")
            return entry
        raise
    picked = hub.select_gguf(listing, ref.variant)
    if picked is not None:
        files, tag = picked
        variant, fmt, quantization = tag.lower(), "gguf", tag.upper()
        patterns = [f.path for f in files]
    else:
        if ref.variant:
            raise ModelNotFoundError(
                f"hf.co/{ref.repo} has no GGUF files, so the tag :{ref.variant} means nothing; "
                f"use hf.co/{ref.repo} for its safetensors checkpoint"
            )
        variant, fmt, quantization = "default", "safetensors", "?"
        patterns = hub.SAFETENSORS_FILES
    return _pull_from_hub(
        name=ref.name,
        variant=variant,
        fmt=fmt,
        quantization=quantization,
        repo=ref.repo,
        revision=revision,
        patterns=patterns,
        offline=False,
        progress=progress,
        listing=listing,
        verify_all=verify_all,
    )


def _pull_from_hub(
    *,
    name: str,
    variant: str,
    fmt: str,
    quantization: str,
    repo: str,
    revision: str,
    patterns: list[str],
    offline: bool,
    progress,
    expected_sha256: str | None = None,
    listing=None,
    verify_all: bool = False,
) -> Installed:
    label = f"pulling {name}:{variant}"
    known = (name, variant, fmt, quantization, repo, revision, patterns, verify_all)
    if offline:
        cached = _from_hf_cache(*known)
        if cached is None:
            raise _not_cached(f"{name}:{variant}", repo, revision)
        return cached
    if listing is None:
        try:
            listing = hub.list_repo(repo, revision)
        except hub.HubUnreachable as exc:
            cached = _from_hf_cache(*known)
            if cached is None:
                raise
            _warn(f"{exc}; using the cached copy of {name}:{variant}")
            return cached
    files = hub.select(listing.files, patterns)
    if not files:
        raise ModelNotFoundError(
            f"{repo}@{revision[:12]}: no files match {', '.join(patterns)}; the recipe or the "
            "repository changed"
        )
    if expected_sha256 and len(files) == 1 and files[0].sha256 != expected_sha256:
        raise CorruptModelError(
            f"{repo}/{files[0].path}: the Hub's sha256 ({(files[0].sha256 or '?')[:12]}…) is "
            f"not the recipe's ({expected_sha256[:12]}…); refusing to download"
        )
    _recheck_blobs(name, variant, repo, listing.commit, files, verify_all)
    needed = hub.missing_bytes(repo, listing.commit, files)
    cache = hub.cache_root()
    with store_writes():
        cache.mkdir(parents=True, exist_ok=True)
    check_free_space(cache, needed + FREE_SPACE_MARGIN if needed else 0, hub=True)
    with store_writes():
        snapshot = hub.download(listing, files, label, progress)
    entry = _hub_entry(
        name, variant, fmt, quantization, repo, revision, listing.commit, snapshot, files
    )
    write_manifest(stamped(entry))  # every file is checked: downloaded now, or rechecked
    return entry


def _hub_entry(name, variant, fmt, quantization, repo, revision, commit, snapshot, files):
    paths = tuple(snapshot / f.path for f in files)
    weights = [p for p in paths if p.suffix == ".gguf"]
    return Installed(
        name=name,
        variant=variant,
        format=fmt,
        quantization=quantization,
        path=sorted(weights)[0] if fmt == "gguf" and weights else snapshot,
        files=paths,
        size=sum(f.size for f in files),
        source="hub",
        repo=repo,
        revision=revision,
        commit=commit,
        pulled=now(),
        repo_files=tuple(f.path for f in files),
        sha256={f.path: f.sha256 for f in files if f.sha256},
    )


def _from_hf_cache(
    name, variant, fmt, quantization, repo, revision, patterns, verify_all
) -> Installed | None:
    """An installed entry from our manifest, or from a copy in the HF cache (any tool's);
    checked (see _checked)."""
    for entry in inventory.installed():
        same = entry.name == name and entry.variant == variant
        if same and entry.complete and revision in (entry.revision, entry.commit):
            return _checked(entry, verify_all)
    found = hub.cached_files(repo, revision, patterns)
    if found is None:
        return None
    commit, paths = found
    snapshot = hub.repo_dir(repo) / "snapshots" / commit
    weights = [p for p in paths if p.suffix == ".gguf"]
    entry = Installed(
        name=name,
        variant=variant,
        format=fmt,
        quantization=quantization,
        path=weights[0] if fmt == "gguf" and weights else snapshot,
        files=tuple(paths),
        size=sum(p.stat().st_size for p in paths),
        source="hub-cache",
        repo=repo,
        revision=revision,
        commit=commit,
        pulled=now(),
        repo_files=tuple(p.relative_to(snapshot).as_posix() for p in paths),
    )
    return _checked(entry, verify_all)


# -- rechecking what is installed ---------------------------------------------------------------


def _recheck_embedded(spec: EmbeddedModel, verify_all: bool) -> None:
    """Hash the installed embedded model again if it changed since it was checked (or always
    with `verify_all`); a damaged file is deleted, so ensure_embedded fetches it again."""
    target = installed_path(spec)
    if not is_present(spec, target):
        return
    entry = embedded_entry(spec, "unknown", target)
    if not verify_all and verify.unchanged(target, entry.stamps.get(spec.filename)):
        return
    if verify.intact(target, spec.sha256):
        write_manifest(stamped(entry))
        return
    _damaged(entry.tag, target)
    with store_writes():
        target.unlink()


def _recheck_blobs(name, variant, repo: str, commit: str, files, verify_all: bool) -> None:
    """Hash the files of this pull already in the HF cache again where they changed since atlas
    last checked them (the manifest's stamps), or all with `verify_all`; a file another tool
    fetched has no stamp, so it is checked once. Damaged ones are deleted, so the download that
    follows fetches them again."""
    prior = read_manifest(manifest_path(name, variant))
    stamps = prior.stamps if prior is not None and prior.commit == commit else {}
    for f in files:
        pointer, blob = hub.pointer_path(repo, commit, f.path), hub.blob_path(repo, f)
        path = pointer if pointer.is_file() else blob  # a copy where symlinks are missing
        if not path.is_file():
            continue
        if not verify_all and verify.unchanged(path, stamps.get(f.path)):
            continue
        if not verify.intact(path, f.sha256, f.blob_id):
            _damaged(f"{name}:{variant}", pointer)
            with store_writes():
                blob.unlink(missing_ok=True)
                pointer.unlink(missing_ok=True)


def _checked(entry: Installed, verify_all: bool) -> Installed:
    """An installed copy used without downloading: the files that changed since they were
    checked (all with `verify_all`) hashed again. Damage is an error here, as the Hub is out of
    reach or not to be asked."""
    todo = [
        (path, rp)
        for path, rp in zip(entry.files, entry.in_repo_names, strict=True)
        if verify_all or not verify.unchanged(path, entry.stamps.get(rp))
    ]
    if not todo:
        return entry
    for path, rp in todo:
        if not verify.intact(path, entry.sha256.get(rp)):
            raise CorruptModelError(
                f"{entry.tag}: {path} is damaged on disk (its hash does not match) and cannot be "
                f"downloaded again now; run `atlas pull {entry.tag}` while online"
            )
    entry = stamped(entry)
    write_manifest(entry)
    return entry


def _damaged(tag: str, path) -> None:
    _warn(f"{tag}: {path.name} is damaged on disk (its hash does not match); downloading it again")


def _not_cached(what: str, repo: str, revision: str) -> DownloadError:
    return DownloadError(
        f"offline (--offline or HF_HUB_OFFLINE) and {what} is not downloaded: {repo}@"
        f"{revision[:12]} is not in the Hugging Face cache at {hub.cache_root()}; run "
        "`atlas pull` while online"
    )


def _warn(message: str) -> None:
    print(f"atlas: warning: {message}", file=sys.stderr)
