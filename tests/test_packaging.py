"""The kernel sources live in the top-level kernels/ and ship inside the package as
atlas_cli/kernels (setup.py's package_dir, pyproject's package-data): a wheel carries every
file, and the kernel lookup finds them in a wheel install and in this checkout alike."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from atlas_cli.backend.ops.native import runtime as rt

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "kernels"


def _kernel_files() -> list[str]:
    return sorted(
        p.relative_to(KERNELS).as_posix()
        for p in KERNELS.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def _can_build_wheels() -> bool:
    """setuptools builds wheels itself from 70.1; before, it needs the `wheel` package."""
    import setuptools

    major, minor = (int(n) for n in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not _can_build_wheels():
        pytest.skip("this environment's setuptools cannot build wheels (needs >= 70.1 or wheel)")
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (t.decode() for t in tracked)):
        if (REPO / name).is_file() and not name.startswith("tests/"):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
    res = subprocess.run([*cmd, "-q", "-w", str(out)], cwd=src, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def test_the_kernels_are_top_level_only():
    assert KERNELS.is_dir() and not (REPO / "atlas_cli" / "kernels").exists()
    assert set(rt.KERNEL_FILES) <= set(_kernel_files())


def test_wheel_carries_every_kernel_file_inside_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in _kernel_files() if f"atlas_cli/kernels/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith("kernels/") for n in names)  # no stray top-level folder


def test_installed_wheel_finds_every_kernel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from atlas_cli.backend.ops.native import runtime as rt\n"
        "assert rt.__file__.startswith(sys.argv[1]), rt.__file__\n"
        "d = rt.kernels_dir(); print(d)\n"
        "for f in rt.KERNEL_FILES: rt.expand_source(f, d)\n"
    )
    # the unpacked wheel comes first on sys.path, before this checkout's editable install
    # (whose finder is consulted after sys.path); the assert in `code` proves which answered
    res = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == site / "atlas_cli" / "kernels"


def test_checkout_finds_every_kernel():
    d = rt.kernels_dir()
    assert d.resolve() == KERNELS.resolve()
    for f in _kernel_files():
        assert (d / f).is_file(), f
    for f in rt.KERNEL_FILES:  # every local header resolves from there
        assert '.cuh"' not in rt.expand_source(f)
