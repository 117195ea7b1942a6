"""`pull(name)`: download a recipe variant, NAME:VARIANT or hf.co/org/repo[:QUANT] if needed.

Hub downloads stay in the shared Hugging Face cache (see store.hub), so files other tools
fetched are reused and nothing is stored twice; a manifest records each pull once it is
complete. Offline (or with the Hub unreachable) a copy already downloaded is used.
"""

from __future__ import annotations

import sys

from atlas_cli import recipes
from atlas_cli.errors import CorruptModelError, DownloadError, ModelNotFoundError, UsageError
from atlas_cli.hardware import hardware_class
from atlas_cli.store import hub, inventory
from atlas_cli.store.embedded import embedded_entry, embedded_spec, ensure_embedded
from atlas_cli.store.manifest import Installed, now, write_manifest
from atlas_cli.store.paths import FREE_SPACE_MARGIN, check_free_space


def pull(
    name: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    device: str | None = None,
    progress=None,
) -> Installed:
    """Download `name` (recipe, NAME:VARIANT or hf.co/org/repo[:QUANT]) if needed."""
    ref = recipes.parse_ref(name)
    if ref.kind == "local":
        raise UsageError(f"{name} is a local path: nothing to pull")
    offline = hub.offline(offline)
    if ref.kind == "hub":
        return _pull_hub_ref(ref, revision, offline, progress)
    recipe = ref.recipe
    variant = ref.variant or recipe.variant_for(hardware_class(device))
    v = recipe.variants[variant]
    spec = embedded_spec(recipe, variant)
    if spec is not None and revision is None:
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
    )


def _downloaded(ref: recipes.ModelRef) -> Installed | None:
    """A complete installed copy of a Hub reference, if there is one."""
    for entry in inventory.installed():
        if entry.name == ref.name and inventory.variant_matches(ref, entry) and entry.complete:
            return entry
    return None


def _pull_hub_ref(ref, revision: str | None, offline: bool, progress) -> Installed:
    revision = revision or "main"
    if offline:
        entry = _downloaded(ref)
        if entry is not None:
            return entry
        raise _not_cached(ref.name, ref.repo, revision)
    try:
        listing = hub.list_repo(ref.repo, revision)
    except hub.HubUnreachable as exc:
        entry = _downloaded(ref)
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
) -> Installed:
    label = f"pulling {name}:{variant}"
    if offline:
        cached = _from_hf_cache(name, variant, fmt, quantization, repo, revision, patterns)
        if cached is None:
            raise _not_cached(f"{name}:{variant}", repo, revision)
        return cached
    if listing is None:
        try:
            listing = hub.list_repo(repo, revision)
        except hub.HubUnreachable as exc:
            cached = _from_hf_cache(name, variant, fmt, quantization, repo, revision, patterns)
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
    needed = hub.missing_bytes(repo, listing.commit, files)
    cache = hub.cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    check_free_space(cache, needed + FREE_SPACE_MARGIN if needed else 0, hub=True)
    snapshot = hub.download(listing, files, label, progress)
    entry = _hub_entry(
        name, variant, fmt, quantization, repo, revision, listing.commit, snapshot, files
    )
    write_manifest(entry)
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


def _from_hf_cache(name, variant, fmt, quantization, repo, revision, patterns) -> Installed | None:
    """An installed entry from our manifest, or from a copy in the HF cache (any tool's)."""
    for entry in inventory.installed():
        same = entry.name == name and entry.variant == variant
        if same and entry.complete and revision in (entry.revision, entry.commit):
            return entry
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
    write_manifest(entry)
    return entry


def _not_cached(what: str, repo: str, revision: str) -> DownloadError:
    return DownloadError(
        f"offline (--offline or HF_HUB_OFFLINE) and {what} is not downloaded: {repo}@"
        f"{revision[:12]} is not in the Hugging Face cache at {hub.cache_root()}; run "
        "`atlas pull` while online"
    )


def _warn(message: str) -> None:
    print(f"atlas: warning: {message}", file=sys.stderr)
