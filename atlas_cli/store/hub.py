"""Hugging Face Hub downloads into the shared HF cache, resumable and verified.

Files land in the standard cache layout (`models--org--repo/blobs/<etag>`, symlinked from
`snapshots/<commit>/<file>`), so files that other tools (transformers, llama.cpp, vLLM) already
fetched are reused, and what atlas fetches they reuse. huggingface_hub does the talking: the
file list with the Hub's LFS sha256 (`model_info(files_metadata=True)`), auth headers
(HF_TOKEN), error types and the byte transfer (`http_get`, which resumes with Range requests).
What atlas adds on top of `hf_hub_download`:

- a partial download stays as `blobs/<etag>.incomplete` and the next run resumes it;
- every file is checked against the Hub's sha256 (LFS) or git blob id before it is moved into
  place, so nothing unverified ever looks complete;
- one progress display for the whole pull, and one-line errors.

Environment is read at call time (HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_TOKEN): huggingface_hub reads some of these once at import.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from atlas_cli.errors import AtlasError, CorruptModelError, DownloadError, ModelNotFoundError
from atlas_cli.store.verify import hexdigest

COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Files a safetensors checkpoint needs (top level only); used for hf.co/ repos without GGUF.
SAFETENSORS_FILES = ["*.safetensors", "*.json", "merges.txt", "tokenizer.model", "*.jinja"]
# Which GGUF an hf.co/org/repo without a tag gets (ollama and llama.cpp default to Q4_K_M).
GGUF_PREFERENCE = ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q4_1", "Q6_K", "Q8_0", "Q5_0"]
SPLIT_GGUF = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


# -- environment -------------------------------------------------------------------------------


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def cache_root() -> Path:
    """The shared HF hub cache: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def offline(flag: bool | None = None) -> bool:
    if flag:
        return True
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def token() -> str | None:
    """HF_TOKEN; None lets huggingface_hub fall back to the token saved by `hf auth login`."""
    return os.environ.get("HF_TOKEN") or None


def repo_dir(repo: str) -> Path:
    return cache_root() / ("models--" + repo.replace("/", "--"))


# -- listing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repo
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1 (every file)

    @property
    def etag(self) -> str:
        """The cache's blob name, as huggingface_hub names it: sha256 for LFS, else the git id."""
        etag = self.sha256 or self.blob_id
        if not etag:
            raise DownloadError(f"{self.path}: the Hub sent no hash for it")
        return etag


@dataclass(frozen=True)
class RepoListing:
    repo: str
    revision: str  # as asked
    commit: str
    files: tuple[RemoteFile, ...]


def list_repo(repo: str, revision: str) -> RepoListing:
    """The files of `repo` at `revision`, with sizes and hashes (one API call)."""
    from huggingface_hub import HfApi

    with hub_errors(repo, revision):
        info = HfApi(endpoint=endpoint()).model_info(
            repo, revision=revision, files_metadata=True, token=token()
        )
    files = []
    for s in info.siblings or ():
        lfs = s.lfs
        sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) or None
        files.append(RemoteFile(s.rfilename, int(s.size or 0), sha, s.blob_id))
    if not info.sha:
        raise DownloadError(f"{repo}@{revision}: the Hub did not say which commit this is")
    return RepoListing(repo, revision, info.sha, tuple(files))


def matches(path: str, pattern: str) -> bool:
    """fnmatch, but a pattern without '/' matches top-level files only (not original/*.json)."""
    from fnmatch import fnmatchcase

    if "/" not in pattern and "/" in path:
        return False
    return fnmatchcase(path, pattern)


def select(files: tuple[RemoteFile, ...], patterns: list[str]) -> list[RemoteFile]:
    return [f for f in files if any(matches(f.path, p) for p in patterns)]


def select_gguf(listing: RepoListing, tag: str | None) -> tuple[list[RemoteFile], str] | None:
    """The GGUF file(s) for `tag` (all parts of a split file), and the tag; None: no GGUF."""
    ggufs = [
        f
        for f in listing.files
        if f.path.lower().endswith(".gguf") and "mmproj" not in f.path.lower()
    ]
    if not ggufs:
        return None
    if tag:
        pick = [f for f in ggufs if _has_tag(f.path, tag)]
        if not pick:
            names = ", ".join(sorted(f.path for f in ggufs)[:12])
            raise ModelNotFoundError(f"hf.co/{listing.repo} has no {tag} GGUF (files: {names})")
    else:
        pick = []
        for quant in GGUF_PREFERENCE:
            pick = [f for f in ggufs if _has_tag(f.path, quant)]
            if pick:
                tag = quant
                break
        if not pick:
            pick = [min(ggufs, key=lambda f: f.size)]
            tag = Path(pick[0].path).stem
    first = sorted(pick, key=lambda f: f.path)[0]
    split = SPLIT_GGUF.match(first.path)
    # every part of a split file
    pick = [f for f in ggufs if f.path.startswith(split.group(1) + "-")] if split else [first]
    return sorted(pick, key=lambda f: f.path), tag


def _has_tag(path: str, tag: str) -> bool:
    return re.search(rf"(^|[-_./]){re.escape(tag)}([-_./]|$)", path, re.IGNORECASE) is not None


# -- the cache ---------------------------------------------------------------------------------


def blob_path(repo: str, f: RemoteFile) -> Path:
    return repo_dir(repo) / "blobs" / f.etag


def pointer_path(repo: str, commit: str, filename: str) -> Path:
    return repo_dir(repo) / "snapshots" / commit / filename


def missing_bytes(repo: str, commit: str, files: list[RemoteFile]) -> int:
    """Bytes still to fetch: files not in the cache, less what partial downloads hold."""
    total = 0
    for f in files:
        blob = blob_path(repo, f)
        if blob.exists():
            continue
        part = blob.with_name(blob.name + ".incomplete")
        total += f.size - (part.stat().st_size if part.exists() else 0)
    return max(total, 0)


def commit_for(repo: str, revision: str) -> str | None:
    """The commit a revision points to in the cache (refs/<revision>), without the network."""
    if COMMIT.match(revision):
        return revision
    ref = repo_dir(repo) / "refs" / revision
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def cached_files(repo: str, revision: str, patterns: list[str]) -> tuple[str, list[Path]] | None:
    """(commit, files) of a cached snapshot matching `patterns` (another tool's download too),
    or None. A sharded checkpoint counts only when every shard in its index is present."""
    commit = commit_for(repo, revision)
    if commit is None:
        return None
    snap = repo_dir(repo) / "snapshots" / commit
    if not snap.is_dir():
        return None
    present = sorted(
        p
        for p in snap.rglob("*")
        if p.is_file() and any(matches(_rel(p, snap), x) for x in patterns)
    )
    if not present:
        return None
    for index in snap.glob("*.safetensors.index.json"):
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not all((snap / s).is_file() for s in shards):
            return None
    for pattern in patterns:  # a named single file must be there
        if not any(c in pattern for c in "*?[") and not (snap / pattern).is_file():
            return None
    return commit, present


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


# -- downloading -------------------------------------------------------------------------------


Progress = Callable[[str, int, int], contextlib.AbstractContextManager[Callable[[int], None]]]


def download(
    listing: RepoListing, files: list[RemoteFile], label: str, progress: Progress | None = None
) -> Path:
    """Fetch `files` of the listing's commit into the cache; returns the snapshot directory."""
    from atlas_cli.progress import byte_progress

    repo, commit = listing.repo, listing.commit
    todo = [f for f in files if not blob_path(repo, f).exists()]
    total = sum(f.size for f in todo)
    done = total - missing_bytes(repo, commit, todo)
    report = progress or byte_progress
    snapshot = repo_dir(repo) / "snapshots" / commit
    with _quiet_hub_bars(), report(label, total, done) if todo else _no_bar() as advance:
        for f in files:
            _fetch(repo, commit, f, advance)
    for f in files:  # files already in the cache still need their snapshot link
        _link(blob_path(repo, f), pointer_path(repo, commit, f.path))
    if listing.revision != commit:
        _write_ref(repo, listing.revision, commit)
    return snapshot


def _fetch(repo: str, commit: str, f: RemoteFile, advance: Callable[[int], None]) -> None:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    blob = blob_path(repo, f)
    if blob.exists():
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    # the same lock file huggingface_hub takes, so a concurrent hf_hub_download waits for us
    lock = cache_root() / ".locks" / repo_dir(repo).name / f"{f.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():
            return
        part = blob.with_name(blob.name + ".incomplete")
        done = part.stat().st_size if part.exists() else 0
        if done > f.size:  # not ours, or a different file: start over
            part.unlink()
            done = 0
        url = hf_hub_url(repo, f.path, revision=commit, endpoint=endpoint())
        headers = build_hf_headers(token=token())
        headers["Accept-Encoding"] = "identity"  # sizes and Range offsets are raw bytes
        with hub_errors(repo, commit, f.path), open(part, "ab") as out:
            http_get(
                url,
                _Counting(out, advance),
                resume_size=done,
                headers=headers,
                expected_size=f.size,
                displayed_filename=f.path,
            )
        _verify(part, f)
        os.replace(part, blob)


def _verify(part: Path, f: RemoteFile) -> None:
    """Check the bytes against the Hub's hash; a mismatch deletes them."""
    if f.sha256:
        kind, expected, label = "sha256", f.sha256, "sha256"
    else:  # a small git file: its blob id is sha1("blob <size>\0" + bytes)
        kind, expected, label = "git", f.blob_id, "git blob id"
    actual = hexdigest(part, kind)
    if actual != expected:
        part.unlink(missing_ok=True)
        raise CorruptModelError(
            f"{f.path}: {label} {actual[:12]}… does not match the Hub's {expected[:12]}…; "
            "the download was discarded, run the command again"
        )


class _Counting:
    """A file wrapper that reports bytes written (http_get writes, and may seek/truncate)."""

    def __init__(self, f, advance: Callable[[int], None]):
        self._f, self._advance = f, advance

    def write(self, data: bytes) -> int:
        n = self._f.write(data)
        self._advance(len(data))
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, *args) -> int:
        return self._f.seek(*args)

    def truncate(self, *args) -> int:
        before = self._f.tell()
        size = self._f.truncate(*args)
        self._advance(-max(before - size, 0))  # the server ignored Range: counted bytes are gone
        return size

    def flush(self) -> None:
        self._f.flush()


@contextlib.contextmanager
def _quiet_hub_bars() -> Iterator[None]:
    """huggingface_hub's own tqdm bars and retry chatter off while our display is shown."""
    import logging

    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    log = logging.getLogger("huggingface_hub")
    level = log.level
    disable_progress_bars()
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
        if not was_disabled:
            enable_progress_bars()


@contextlib.contextmanager
def _no_bar() -> Iterator[Callable[[int], None]]:
    yield lambda n: None


def _link(blob: Path, pointer: Path) -> None:
    if pointer.exists() and pointer.resolve() == blob.resolve():
        return
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:  # no symlinks (Windows without developer mode): a copy, as hf does
        shutil.copyfile(blob, pointer)


def _write_ref(repo: str, revision: str, commit: str) -> None:
    ref = repo_dir(repo) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


# -- errors ------------------------------------------------------------------------------------


def is_network_error(exc: BaseException) -> bool:
    """Connection refused, DNS failure, timeouts: for httpx (hub >= 1.0) and requests (0.x)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "ConnectionError", "Timeout", "TimeoutException"})


@contextlib.contextmanager
def hub_errors(repo: str, revision: str, filename: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line AtlasErrors that say what to do."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo}/{filename}" if filename else repo
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        yield
    except AtlasError:
        raise
    except GatedRepoError:
        raise DownloadError(
            f"{repo} is gated: accept its licence at {endpoint()}/{repo} with your account, then "
            f"{login}"
        ) from None
    except RepositoryNotFoundError as exc:
        status = _status(exc)
        if status == 401:
            raise DownloadError(
                f"{repo}: not found, or private and you are not logged in (HTTP 401): check the "
                f"name; for a private or gated repo, {login}"
            ) from None
        raise ModelNotFoundError(f"{repo}: no such model repository on {endpoint()}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo}: no revision {revision!r}") from None
    except EntryNotFoundError:
        raise ModelNotFoundError(f"{where}: no such file at revision {revision[:12]}") from None
    except HfHubHTTPError as exc:
        status = _status(exc)
        if status == 401:
            raise DownloadError(
                f"{where}: the Hub rejected the credentials (HTTP 401): {login} with a valid token"
            ) from None
        if status == 403:
            raise DownloadError(
                f"{where}: access denied (HTTP 403): accept the repository's terms at "
                f"{endpoint()}/{repo}, and {login} with a token that can read it"
            ) from None
        if status == 404:
            raise ModelNotFoundError(f"{where}: not found (HTTP 404)") from None
        raise DownloadError(f"{where}: the Hub answered HTTP {status}; try again later") from None
    except OSError as exc:
        if is_network_error(exc):
            raise _network_down(exc, filename) from None
        if "Consistency check failed" in str(exc):
            raise DownloadError(
                f"{where}: the download was cut short; run the command again to resume"
            ) from None
        raise DownloadError(f"{where}: {exc.strerror or exc}") from None
    except Exception as exc:
        if is_network_error(exc):
            raise _network_down(exc, filename) from None
        raise


class HubUnreachable(DownloadError):
    """The network or the Hub is down (as opposed to an answer we do not like)."""


def _network_down(exc: BaseException, filename: str | None) -> DownloadError:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if filename:
        return HubUnreachable(
            f"{filename}: the connection broke during the download ({reason}); run the "
            "command again to resume it"
        )
    return HubUnreachable(
        f"cannot reach the Hugging Face Hub at {endpoint()} ({reason}); check the network, or "
        "use --offline (HF_HUB_OFFLINE=1) for models already downloaded"
    )


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)
