"""The small protocol every GPU runtime implements, and what the runtimes share.

A runtime owns device memory, compiles kernel sources (with an on-disk cache) and launches
kernels. The launchers (`NativeOps` in native/device.py and its op families) talk to a runtime
only through this protocol, so the same launchers drive CUDA (runtime_cuda, cupy + NVRTC), HIP
(runtime_hip, hip-python + hiprtc) and the CPU emulator the tests use (runtime_emu).

Kernel arguments are passed as `Arg`s: a pointer, int32, int64 or float32, so each runtime can
marshal them for its launch API without guessing.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from atlas_cli.errors import DeviceError

KERNEL_FILES = (
    "attention.cu",
    "decode.cu",
    "dequant.cu",
    "elementwise.cu",
    "embedding.cu",
    "gdn.cu",
    "gemm.cu",
    "gemm_fast.cu",
    "gemm_fp4.cu",
    "gemv.cu",
    "gemv_mma.cu",
    "norm.cu",
    "rope.cu",
    "sample.cu",
)


def kernels_dir() -> Path:
    """The kernel sources: the top-level `kernels/` beside `atlas_cli/` in a checkout (with an
    editable install or none), `atlas_cli/kernels/` in an installed wheel (setup.py maps the
    one onto the other)."""
    package = Path(str(resources.files("atlas_cli")))
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "atlas_common.cuh").is_file():
            return candidate
    raise DeviceError(
        f"the kernel sources are missing from {package} (a broken install?): reinstall atlas-cli"
    )


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+\.cuh)"\s*$', re.M)


def expand_source(name: str, directory: Path | None = None) -> str:
    """The kernel file `name` with its local `.cuh` includes pasted in (once each), so that
    NVRTC and hiprtc, which read no files, get one self-contained source."""
    directory = directory or kernels_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (directory / fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


@dataclass(frozen=True)
class Arg:
    kind: str  # "p" pointer, "i" int32, "q" int64, "f" float32
    value: int | float


def ptr(value: int) -> Arg:
    return Arg("p", int(value))


def i32(value: int) -> Arg:
    return Arg("i", int(value))


def i64(value: int) -> Arg:
    return Arg("q", int(value))


def f32(value: float) -> Arg:
    return Arg("f", float(value))


# How the ctypes-based launch APIs (hip-python, the emulator) take each Arg kind.
CTYPES_ARGS: dict[str, Callable[[Any], Any]] = {
    "p": ctypes.c_void_p,
    "i": ctypes.c_int32,
    "q": ctypes.c_int64,
    "f": ctypes.c_float,
}


def marshal(args: list[Arg], types: dict[str, Callable[[Any], Any]]) -> list:
    """Each kernel argument as its launch API wants it; `types` maps an Arg kind to the
    runtime's constructor for it."""
    return [types[a.kind](a.value) for a in args]


def dims3(dims: tuple) -> tuple:
    """A grid or block padded with 1s to the three dimensions launch APIs take."""
    return tuple(dims) + (1,) * (3 - len(dims))


class Buffer(Protocol):
    ptr: int  # device address
    nbytes: int


class Module(Protocol):
    def function(self, name: str) -> Any: ...


class Runtime(Protocol):
    name: str  # "cuda" | "hip" | "emu"
    target: str  # "sm_90", "gfx1151", "cpu"

    def alloc(self, nbytes: int) -> Buffer: ...
    def h2d(self, dst: Buffer, host, offset: int = 0) -> None: ...  # host: C-contiguous ndarray
    def d2h(self, host, src: Buffer, offset: int = 0) -> None: ...
    def d2d(self, dst: Buffer, dst_off: int, src: Buffer, src_off: int, nbytes: int) -> None: ...
    def compile(self, file: str, defines: dict[str, str | int] | None = None) -> Module: ...
    def launch(self, fn, grid: tuple, block: tuple, args: list[Arg]) -> None: ...
    def synchronize(self) -> None: ...
    def event(self) -> Any: ...  # .record(); elapsed_ms(a, b)
    def elapsed_ms(self, start, end) -> float: ...
    def capture(self) -> Any: ...  # context manager yielding a Graph with .replay()
    def info(self) -> dict[str, Any]: ...


@dataclass
class CompileStats:
    """What `atlas hw` reports: per kernel file, how long compilation took or that the on-disk
    cache was hit."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, file: str, seconds: float, cache_hit: bool, target: str) -> None:
        self.entries[file] = {
            "seconds": round(seconds, 3),
            "cache_hit": cache_hit,
            "target": target,
        }

    def summary(self) -> dict[str, Any]:
        hits = sum(1 for e in self.entries.values() if e["cache_hit"])
        return {
            "kernels": dict(self.entries),
            "compiled": len(self.entries) - hits,
            "cache_hits": hits,
            "compile_s": round(sum(e["seconds"] for e in self.entries.values()), 3),
        }


def cache_key(source: str, target: str, toolchain: str, defines: dict | None) -> str:
    """sha256 over what decides the binary: source text, target, compiler + driver versions."""
    h = hashlib.sha256()
    for part in (source, target, toolchain, repr(sorted((defines or {}).items()))):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def kernel_cache_dir() -> Path:
    from atlas_cli.store import paths

    d = paths.cache_dir() / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_compile(
    stats: CompileStats,
    file: str,
    source: str,
    target: str,
    toolchain: str,
    defines: dict | None,
    suffix: str,
    build,
    cache_dir: Path | None = None,
) -> Path:
    """Return the path of the compiled binary for `source`, building it with `build(path)`
    unless the cache already holds it. Writes go through a temp file and a rename, so a crash
    never leaves a half-written binary under the final name."""
    key = cache_key(source, target, toolchain, defines)
    directory = cache_dir or kernel_cache_dir()
    path = directory / f"{Path(file).stem}-{target}-{key}{suffix}"
    t0 = time.perf_counter()
    hit = path.exists()
    if not hit:
        tmp = path.with_suffix(path.suffix + f".tmp{id(path)}")
        build(tmp)
        tmp.replace(path)
    stats.record(file, time.perf_counter() - t0, hit, target)
    return path
