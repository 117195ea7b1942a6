"""NVRTC through ctypes: CUDA C source -> cubin, with no GPU and no driver.

The CUDA runtime (runtime_cuda.py) compiles with this, and so do the compile checks that run on
any machine (tests/test_kernels_compile.py): one code path, one set of options. libnvrtc comes
from the `nvidia-cuda-nvrtc` wheel (a dependency of cupy, and in the [test] extra) or from a
CUDA toolkit on the library path. The kernels include no CUDA headers, so no include path is
needed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

_LIB: ctypes.CDLL | None = None


class NvrtcUnavailable(RuntimeError):
    """No libnvrtc could be loaded."""


class CompileError(RuntimeError):
    """NVRTC rejected the source; the message holds its log."""


@dataclass(frozen=True)
class Compiled:
    binary: bytes  # cubin (or PTX when asked for)
    log: str  # NVRTC's log: warnings, if any
    kind: str  # "cubin" | "ptx"


def _candidates() -> list[str]:
    names = []
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            names += sorted(glob.glob(os.path.join(base, sub, "libnvrtc.so.*")), reverse=True)
    names = [n for n in names if "builtins" not in n]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")), reverse=True)
    return names + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def load() -> ctypes.CDLL:
    """The NVRTC library, loaded once; NvrtcUnavailable says how to get it."""
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _LIB = lib
        return lib
    raise NvrtcUnavailable(
        "libnvrtc not found: pip install nvidia-cuda-nvrtc, "
        "or put a CUDA toolkit's lib64 on LD_LIBRARY_PATH"
    )


def available() -> bool:
    try:
        load()
    except NvrtcUnavailable:
        return False
    return True


def version() -> tuple[int, int]:
    lib = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib, code: int, what: str) -> None:
    if code != 0:
        raise CompileError(f"{what}: {lib.nvrtcGetErrorString(code).decode()}")


def compile_source(
    source: str,
    name: str,
    arch: str,
    include_dirs: list[Path] = (),
    defines: dict[str, str | int] | None = None,
    kind: str = "cubin",
    extra_options: list[str] = (),
) -> Compiled:
    """Compile `source` for `arch` ("sm_90", "sm_121", ...). `kind` "cubin" runs ptxas too
    (a real machine-code check); "ptx" stops at PTX."""
    lib = load()
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        target = arch.replace("sm_", "sm_" if kind == "cubin" else "compute_")
        opts = [f"--gpu-architecture={target}", "--std=c++17", "-default-device"]
        opts += [f"--include-path={d}" for d in include_dirs]
        opts += [f"-D{k}={v}" for k, v in (defines or {}).items()]
        opts += list(extra_options)
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        code = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
        if code != 0:
            raise CompileError(f"{name} for {arch}:\n{log}")
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if kind == "cubin"
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet*Size")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, out), "nvrtcGet*")
        return Compiled(out.raw, log, kind)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# compute capabilities with an architecture-specific target ("sm_90a", "sm_121a"): Hopper's
# wgmma and TMA, Blackwell's block-scaled FP4 MMA and E2M1 conversions exist only there
_SPECIFIC_MAJORS = (9, 10, 12)


def device_target(major: int, minor: int) -> str:
    """What to compile for on a device of compute capability major.minor: its
    architecture-specific target where this NVRTC knows it (such code runs on that
    architecture only, which is the device in hand), else the portable one."""
    plain = f"sm_{major}{minor}"
    if major not in _SPECIFIC_MAJORS:
        return plain
    try:
        compile_source('extern "C" __global__ void probe() {}', "probe", plain + "a", kind="ptx")
    except CompileError:
        return plain
    return plain + "a"
