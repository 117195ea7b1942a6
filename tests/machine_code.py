"""What the compilers make of kernels/, for the machine-code tests: the sm_90 / sm_121 SASS
(nvcc or NVRTC, then cuobjdump -sass) by entry point, and the gfx1151 assembly (clang-19 -S).
A missing toolchain skips the calling test."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from atlas_cli.backend.ops.native import nvrtc
from atlas_cli.backend.ops.native import runtime as rt

KERNELS = rt.kernels_dir()
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def cuobjdump() -> str | None:
    """cuobjdump (it needs nvdisasm beside it or on PATH): a toolkit's, or the
    nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm wheels'."""
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return found
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for root in nvidia.__path__:
        for exe in Path(root).glob("cu*/bin/cuobjdump"):
            if (exe.parent / "nvdisasm").exists():
                return str(exe)
    return None


def cubin(source: str, arch: str, *, nvrtc_too: bool = True) -> bytes:
    """kernels/`source` for `arch` by nvcc, else (with `nvrtc_too`) by NVRTC, else a skip."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        known = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
        if f"compute_{arch[3:]}" not in known:
            pytest.skip(f"this nvcc does not know {arch}")
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "k.cubin"
            cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", f"-I{KERNELS}", "-o", str(out)]
            subprocess.run([*cmd, str(KERNELS / source)], check=True, capture_output=True)
            return out.read_bytes()
    if nvrtc_too and nvrtc.available():
        return nvrtc.compile_source(rt.expand_source(source), source, arch).binary
    pytest.skip("neither nvcc nor NVRTC installed" if nvrtc_too else "nvcc not installed")


def sass(binary: bytes) -> dict[str, list[tuple[int, str]]]:
    """Entry point -> its instructions (address, text without the predicate)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip(
            "cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump "
            "nvidia-cuda-nvdisasm)"
        )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(binary)
        env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ['PATH']}")
        text = subprocess.run(
            [tool, "-sass", str(path)], check=True, capture_output=True, text=True, env=env
        ).stdout
    fns: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in text.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            name = m.group(1)
            fns[name] = []
        elif name and (m := SASS_LINE.search(line)):
            fns[name].append((int(m.group(1), 16), PREDICATE.sub("", m.group(2))))
    return fns


def opcodes(binary: bytes) -> dict[str, list[str]]:
    """Entry point -> its opcodes with their modifiers (HMMA.16816.F32.BF16, LDG.E.128, ...)."""
    return {name: [op.split()[0] for _, op in ins] for name, ins in sass(binary).items()}


def clang() -> str | None:
    for name in ("clang++-19", "clang++-20", "clang++-18"):
        if shutil.which(name):
            return name
    return None


AMD_TARGET = ["-x", "hip", "--offload-arch=gfx1151", "-nogpulib", "--cuda-device-only", "-O3"]


@functools.cache
def amd_device_lib(compiler: str) -> bytes:
    """tests/amd_device_lib.hip as bitcode: the thread ids, barriers' fences and math the ROCm
    device libraries would give the kernels, which -nogpulib leaves as calls."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "lib.bc"
        src = Path(__file__).with_name("amd_device_lib.hip")
        cmd = [compiler, *AMD_TARGET, "-fgpu-rdc", "-emit-llvm", "-c", "-o", str(out), str(src)]
        subprocess.run(cmd, check=True, capture_output=True)
        return out.read_bytes()


def gfx1151_asm(source: str) -> str:
    """kernels/`source` as gfx1151 assembly, linked with amd_device_lib (so that no call is
    left), else a skip."""
    compiler = clang()
    if compiler is None or not Path("/usr/include/hip/hip_runtime.h").exists():
        pytest.skip("clang-19 and the HIP headers not installed")
    with tempfile.TemporaryDirectory() as d:
        out, lib = Path(d) / "k.s", Path(d) / "lib.bc"
        lib.write_bytes(amd_device_lib(compiler))
        cmd = [compiler, *AMD_TARGET, "-S", f"-I{KERNELS}", "-o", str(out), str(KERNELS / source)]
        cmd += ["-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(lib)]
        subprocess.run(cmd, check=True, capture_output=True)
        return out.read_text()


def amd_function(asm: str, name: str) -> str:
    """The assembly of entry point `name`."""
    start = asm.index(f"{name}:")
    return asm[start : asm.index(".Lfunc_end", start)]
