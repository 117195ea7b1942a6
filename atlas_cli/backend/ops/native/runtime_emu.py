"""A CPU emulator runtime: the kernel sources compiled by g++ against a fiber-based emulation
of the CUDA execution model (kernels/emu/), device memory in host RAM.

It exists so that every launcher of native/ and every kernel's logic can be tested against
the numpy reference on any machine, CI included. It says nothing about speed, and it cannot
catch races that only real parallel hardware shows; tests/gpu runs the same checks on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atlas_cli.backend.ops.native import runtime as rt

_ENTRY = re.compile(
    r'extern\s+"C"\s+__attribute__\(\(visibility\("default"\)\)\)\s+void\s+(\w+)\s*\(([^)]*)\)'
)


def available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


@dataclass
class HostBuffer:
    array: np.ndarray  # uint8

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


@dataclass(frozen=True)
class EmuFunction:
    name: str
    lib: ctypes.CDLL  # the module's library: its trampoline and its own atlas_emu_launch


class EmuModule:
    def __init__(self, lib: ctypes.CDLL, names: list[str]):
        self.lib = lib
        self.names = set(names)

    def function(self, name: str) -> EmuFunction:
        if name not in self.names:
            raise KeyError(f"no kernel {name!r} in module")
        return EmuFunction(name, self.lib)


class _Graph:
    def __init__(self, runtime: EmuRuntime):
        self.runtime = runtime
        self.calls: list[tuple] = []

    def replay(self) -> None:
        for call in self.calls:
            self.runtime._run(*call)


class _Event:
    def __init__(self):
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()


def _trampolines(preprocessed: str) -> tuple[str, list[str]]:
    """One `void atlas_emu_tramp_<name>(void** args)` per extern "C" kernel, unpacking the
    argument slots into the kernel's parameter types."""
    out, names = [], []
    for name, params in _ENTRY.findall(preprocessed):
        params = " ".join(params.split())
        types = []
        for p in [p.strip() for p in params.split(",") if p.strip()]:
            p = p.replace("__restrict__", "")
            types.append(re.sub(r"\w+$", "", p.strip()).strip())
        unpack = ", ".join(f"*({t}*)args[{i}]" for i, t in enumerate(types))
        out.append(
            f'extern "C" __attribute__((visibility("default"))) void '
            f"atlas_emu_tramp_{name}(void** args) {{ {name}({unpack}); }}"
        )
        names.append(name)
    return "\n".join(out), names


class EmuRuntime:
    name = "emu"
    target = "cpu"

    def __init__(self, cache_dir: Path | None = None):
        self.cache_dir = cache_dir
        self.stats = rt.CompileStats()
        self._modules: dict[str, EmuModule] = {}
        self._capture: _Graph | None = None
        self._cxx = os.environ.get("CXX", "g++")

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.empty(max(int(nbytes), 1), np.uint8))

    def h2d(self, dst: HostBuffer, host: np.ndarray, offset: int = 0) -> None:
        raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        dst.array[offset : offset + raw.size] = raw

    def d2h(self, host: np.ndarray, src: HostBuffer, offset: int = 0) -> None:
        raw = host.reshape(-1).view(np.uint8)
        raw[:] = src.array[offset : offset + raw.size]

    def d2d(self, dst: HostBuffer, dst_off: int, src: HostBuffer, src_off: int, n: int) -> None:
        dst.array[dst_off : dst_off + n] = src.array[src_off : src_off + n]

    # -- compile --------------------------------------------------------------------------
    def compile(self, file: str, defines: dict | None = None) -> EmuModule:
        key = f"{file}:{sorted((defines or {}).items())}"
        if key in self._modules:
            return self._modules[key]
        kdir = rt.kernels_dir()
        source = rt.expand_source(file, kdir)
        emu_src = (kdir / "emu" / "atlas_emu.h").read_text() + (
            kdir / "emu" / "atlas_emu.cpp"
        ).read_text()

        def build(path: Path) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "module.cpp"
                src.write_text(source)
                flags = ["-std=c++17", "-DATLAS_EMU", f"-I{kdir}", "-fPIC", "-w"]
                flags += [f"-D{k}={v}" for k, v in (defines or {}).items()]
                pre = subprocess.run(
                    [self._cxx, *flags, "-E", "-P", str(src)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                tramps, _ = _trampolines(pre)
                src.write_text(source + '\n#include "emu/atlas_emu.cpp"\n' + tramps + "\n")
                res = subprocess.run(
                    [self._cxx, *flags, "-O1", "-shared", "-o", str(path), str(src)],
                    capture_output=True,
                    text=True,
                )
                if res.returncode != 0:
                    raise RuntimeError(f"emulator build of {file} failed:\n{res.stderr[-4000:]}")

        path = rt.cached_compile(
            self.stats,
            file,
            source + emu_src,
            self.target,
            self._cxx,
            defines,
            ".so",
            build,
            self.cache_dir,
        )
        lib = ctypes.CDLL(str(path))
        lib.atlas_emu_launch.restype = ctypes.c_int
        pre_names = re.findall(r"atlas_emu_tramp_(\w+)", path.read_bytes().decode("latin-1"))
        names = sorted(set(pre_names))
        mod = EmuModule(lib, names)
        self._modules[key] = mod
        return mod

    # -- launch ---------------------------------------------------------------------------
    def launch(self, fn, grid: tuple, block: tuple, args: list[rt.Arg]) -> None:
        grid, block = rt.dims3(grid), rt.dims3(block)
        if self._capture is not None:
            self._capture.calls.append((fn, grid, block, list(args)))
            return
        self._run(fn, grid, block, args)

    def _run(self, fn, grid, block, args) -> None:
        ctypes_args = rt.marshal(args, rt.CTYPES_ARGS)
        slots = (ctypes.c_void_p * max(len(ctypes_args), 1))(
            *[ctypes.cast(ctypes.byref(c), ctypes.c_void_p) for c in ctypes_args]
        )
        tramp = ctypes.cast(getattr(fn.lib, f"atlas_emu_tramp_{fn.name}"), ctypes.c_void_p)
        code = fn.lib.atlas_emu_launch(tramp, *[ctypes.c_uint(v) for v in (*grid, *block)], slots)
        if code != 0:
            raise RuntimeError(f"emulated kernel failed (code {code}): divergent barrier?")

    def synchronize(self) -> None:
        pass

    def event(self) -> _Event:
        return _Event()

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        return (end.t - start.t) * 1e3

    @contextlib.contextmanager
    def capture(self):
        graph = _Graph(self)
        self._capture = graph
        try:
            yield graph
        finally:
            self._capture = None

    def info(self) -> dict:
        return {"runtime": "emu", "target": self.target, **self.stats.summary()}
