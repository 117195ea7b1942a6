"""Every kernel file compiles, warnings treated as errors, for the targets atlas ships for:
sm_90 (H100/H200) and sm_121 (GB10) through NVRTC (and nvcc where installed), their
architecture-specific sm_90a / sm_121a (the slow half), gfx1151 (Strix Halo) through clang -x
hip with code generation. No GPU needed.

In CI (CI set) a missing toolchain is a failure: .ci/run installs them (NVRTC from the
nvidia-cuda-nvrtc wheel in the [test] extra, clang-19 + HIP headers from Debian). Elsewhere it
is a skip that says what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from atlas_cli.backend.ops.native import nvrtc
from atlas_cli.backend.ops.native import runtime as rt

KERNELS = rt.kernels_dir()
CUDA_ARCHS = ("sm_90", "sm_121")
SPECIFIC_ARCHS = ("sm_90a", "sm_121a")  # what those devices compile for (nvrtc.device_target)
HIP_ARCH = "gfx1151"


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI (.ci/run should have installed it)")
    pytest.skip(f"{what} not installed")


def _clang() -> str | None:
    for name in ("clang++-19", "clang++-20", "clang++-18", "clang++"):
        if shutil.which(name):
            return name
    return None


def test_every_kernel_file_is_listed():
    on_disk = sorted(p.name for p in KERNELS.glob("*.cu"))
    assert on_disk == sorted(rt.KERNEL_FILES)
    readme = (KERNELS / "README.md").read_text()
    for name in on_disk:
        assert name in readme, f"{name} has no entry in kernels/README.md"


@pytest.mark.parametrize("file", rt.KERNEL_FILES)
def test_nvrtc_compiles_without_warnings(file):
    _compiles_clean(file, CUDA_ARCHS)


@pytest.mark.slow  # NVRTC again for every file: with the slow half
@pytest.mark.parametrize("file", rt.KERNEL_FILES)
def test_nvrtc_compiles_for_the_architecture_specific_targets(file):
    """What a GB10 or an H100/H200 runs (nvrtc.device_target picks sm_121a / sm_90a there)."""
    _compiles_clean(file, SPECIFIC_ARCHS)


def _compiles_clean(file: str, archs: tuple[str, ...]) -> None:
    if not nvrtc.available():
        _missing("NVRTC (pip install nvidia-cuda-nvrtc)")
    source = rt.expand_source(file)
    # a register spill or local memory is a warning on every target (gdn_decode once spilled
    # 188 bytes on sm_121 only)
    spills = ["--ptxas-options=--warn-on-spills", "--ptxas-options=--warn-on-local-memory-usage"]

    def build(arch):
        return arch, nvrtc.compile_source(source, file, arch, extra_options=spills)

    with ThreadPoolExecutor(len(archs)) as pool:  # NVRTC runs outside the GIL
        results = list(pool.map(build, archs))
    for arch, out in results:
        assert out.binary, f"{file} {arch}: empty cubin"
        assert "warning" not in out.log.lower(), f"{file} {arch}:\n{out.log}"


def test_a_device_gets_its_architecture_specific_target():
    if not nvrtc.available():
        _missing("NVRTC (pip install nvidia-cuda-nvrtc)")
    assert nvrtc.device_target(9, 0) == "sm_90a" and nvrtc.device_target(12, 1) == "sm_121a"
    assert nvrtc.device_target(8, 6) == "sm_86"  # Ampere has no such target


# attention.cu takes over a minute through NVRTC on two cores: with the slow tests
SLOW_TO_COMPILE = pytest.param("attention.cu", marks=pytest.mark.slow)


@pytest.mark.parametrize("file", [SLOW_TO_COMPILE, "dequant.cu"])
def test_nvrtc_portable_fallbacks_compile(file):
    """The portable #else branches of guarded hardware paths (FP8 decode) compile too."""
    if not nvrtc.available():
        _missing("NVRTC (pip install nvidia-cuda-nvrtc)")
    out = nvrtc.compile_source(rt.expand_source(file), file, "sm_90", defines={"ATLAS_PORTABLE": 1})
    assert out.binary and "warning" not in out.log.lower(), out.log


@pytest.mark.parametrize("file", rt.KERNEL_FILES)
def test_nvcc_compiles_with_werror(file, tmp_path):
    """nvcc is an extra check where a CUDA toolkit is installed; CI relies on NVRTC."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed (the NVRTC test covers CI)")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in CUDA_ARCHS]
    cmd = [
        nvcc,
        "-fatbin",
        *gencode,
        "-Werror",
        "all-warnings",
        f"-I{KERNELS}",
        "-o",
        str(tmp_path / "k.fatbin"),
        str(KERNELS / file),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("file", rt.KERNEL_FILES)
def test_hip_clang_generates_gfx1151_code(file, tmp_path):
    clang = _clang()
    if clang is None or not Path("/usr/include/hip/hip_runtime.h").exists():
        _missing("clang-19 and the HIP headers (apt-get install clang-19 libamdhip64-dev)")
    out = tmp_path / "k.s"
    cmd = [
        clang,
        "-x",
        "hip",
        f"--offload-arch={HIP_ARCH}",
        "-nogpulib",
        "--cuda-device-only",
        "-S",
        "-O3",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{KERNELS}",
        "-o",
        str(out),
        str(KERNELS / file),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    asm = out.read_text()
    assert HIP_ARCH in asm and ".amdhsa_kernel" in asm
    # every extern "C" entry point is there as a kernel symbol
    assert ".amdhsa_wavefront_size32 1" in asm  # gfx11 runs wave32


def test_expand_source_is_self_contained():
    src = rt.expand_source("gemv.cu")
    assert '#include "' not in src.replace('#include "emu/atlas_emu.h"', "")
    assert src.count("ATLAS_DEV float bf16_to_f32") == 1  # the common header pasted once
