"""What the compiler makes of the decode GEMV (kernels/gemv.cu), read from the machine code: the
sm_90 SASS (nvcc or NVRTC, then cuobjdump -sass) and the gfx1151 ISA (clang-19 -S). The inner
loop of each fast path is found as a backward branch's body; the decode-step loop (T == 1) is
the one that reads x from shared memory with exactly 8 16-byte loads (32 floats). Where a
toolchain is missing the test skips. The misaligned-row fallback is checked on the emulator.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from atlas_cli.backend.ops import nvrtc, runtime_emu
from atlas_cli.backend.ops import runtime as rt

KERNELS = rt.kernels_dir()
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _cuobjdump() -> str | None:
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


def _sm90_cubin(tmp: Path) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = tmp / "gemv.cubin"
        cmd = [nvcc, "-cubin", "-arch=sm_90", "-O3", f"-I{KERNELS}", "-o", str(out)]
        subprocess.run([*cmd, str(KERNELS / "gemv.cu")], check=True, capture_output=True)
        return out.read_bytes()
    if nvrtc.available():
        return nvrtc.compile_source(rt.expand_source("gemv.cu"), "gemv.cu", "sm_90").binary
    pytest.skip("neither nvcc nor NVRTC installed")


@pytest.fixture(scope="module")
def sass() -> dict[str, list[str]]:
    """gemv.cu for sm_90: entry point -> its instructions (predicates dropped)."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip(
            "cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump "
            "nvidia-cuda-nvdisasm)"
        )
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "gemv.cubin"
        cubin.write_bytes(_sm90_cubin(Path(d)))
        env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ['PATH']}")
        text = subprocess.run(
            [tool, "-sass", str(cubin)], check=True, capture_output=True, text=True, env=env
        ).stdout
    fns: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            fns[name] = []
        elif name and (m := SASS_LINE.search(line)):
            fns[name].append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    return fns


def _sass_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    loops = []
    for addr, op in ins:
        m = re.match(r"BRA\b.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            loops.append([o for a, o in ins if start <= a <= addr])
    return loops


def _ops(body: list[str]) -> collections.Counter:
    return collections.Counter(op.split()[0] for op in body)


def _decode_loop(fns, name: str) -> collections.Counter:
    """The T == 1 tile loop of the 16-byte path: a barrier, 8 LDS.128 of x, no byte loads of
    the fallback (deq32) path."""
    found = []
    for body in _sass_loops(fns[f"gemv_{name}"]):
        c = _ops(body)
        if c["BAR.SYNC.DEFER_BLOCKING"] and c["LDS.128"] == 8 and not c["LDG.E.U8.CONSTANT"]:
            found.append(c)
    assert found, f"gemv_{name}: no T == 1 loop with x in shared memory"
    return min(found, key=lambda c: sum(c.values()))


# (format, weight 16-byte loads per 32 weights, instruction bound per 32 weights at T == 1)
# Before the rewrite (byte/half-word loads, x from global memory, compare/select E2M1 decode,
# the scale per element): NVFP4 556, bf16 136, f16 841, f32 103 instructions per 32 weights.
FAST_PATHS = [("nvfp4", 1, 184), ("bf16", 4, 120), ("f16", 4, 120), ("f32", 8, 90)]


@pytest.mark.parametrize("fmt,loads,bound", FAST_PATHS)
def test_sm90_decode_loop_uses_128_bit_loads(sass, fmt, loads, bound):
    c = _decode_loop(sass, fmt)
    # the weights' 16-byte loads plus one for staging x
    assert c["LDG.E.128.CONSTANT"] == loads + 1, c
    assert c["LDG.E.U16.CONSTANT"] == (1 if fmt == "nvfp4" else 0), c  # NVFP4: 2 block scales
    assert c["FFMA"] == 32 + (2 if fmt == "nvfp4" else 0), c  # the scale once per 16-block
    total = sum(c.values())
    assert total <= bound, f"gemv_{fmt}: {total} instructions per 32 weights at T == 1"


def test_sm90_nvfp4_decode_has_no_compare_select(sass):
    c = _decode_loop(sass, "nvfp4")
    assert not c["FSEL"] and not c["I2FP.F32.U32"] and not c["ISETP.GE.U32.AND"], c
    assert c["HADD2.F32"] == 34, c  # 32 codes + 2 block scales, converted exactly from f16


def test_sm90_gemv_uses_no_local_memory(sass):
    for name, ins in sass.items():
        ops = _ops([o for _, o in ins])
        assert not any(k.startswith(("LDL", "STL")) for k in ops), name


# ---- gfx1151 -------------------------------------------------------------------------------


def _clang() -> str | None:
    for name in ("clang++-19", "clang++-20", "clang++-18"):
        if shutil.which(name):
            return name
    return None


@pytest.fixture(scope="module")
def gfx1151(tmp_path_factory) -> str:
    clang = _clang()
    if clang is None or not Path("/usr/include/hip/hip_runtime.h").exists():
        pytest.skip("clang-19 and the HIP headers not installed")
    out = tmp_path_factory.mktemp("gfx") / "gemv.s"
    cmd = [clang, "-x", "hip", "--offload-arch=gfx1151", "-nogpulib", "--cuda-device-only"]
    cmd += ["-S", "-O3", f"-I{KERNELS}", "-o", str(out), str(KERNELS / "gemv.cu")]
    subprocess.run(cmd, check=True, capture_output=True)
    return out.read_text()


def _amd_loops(asm: str, name: str) -> list[collections.Counter]:
    start = asm.index(f"{name}:")
    lines = asm[start : asm.index(".Lfunc_end", start)].splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        if m := re.match(r"(\.LBB\w+):", line):
            labels[m.group(1)] = i
        m = re.match(r"\s+(s_cbranch_\w+|s_branch)\s+(\.LBB\w+)", line)
        if m and m.group(2) in labels:
            body = lines[labels[m.group(2)] : i + 1]
            ops = [x.split()[0] for x in body if x.startswith("\t") and x.split()[0][0] != "."]
            loops.append(collections.Counter(ops))
    return loops


def test_gfx1151_nvfp4_loop_is_branch_free_with_128_bit_loads(gfx1151):
    """The NVFP4 decode-step loop: one 16-byte load of codes, one 2-byte load of scales, x
    from LDS, no byte loads and no branch per nibble (before: 16 byte loads, 43 branches)."""
    fast = [
        c
        for c in _amd_loops(gfx1151, "gemv_nvfp4")
        if c["s_barrier"] and c["ds_load_b128"] == 8 and c["global_load_u16"]
    ]
    assert fast, "no NVFP4 loop with x staged in LDS"
    c = min(fast, key=lambda c: sum(c.values()))
    assert not c["global_load_u8"] and c["global_load_b128"] >= 2, c
    branches = sum(n for op, n in c.items() if op.startswith("s_cbranch"))
    assert branches <= 8, f"{branches} conditional branches in the NVFP4 loop"


# ---- the fallback for rows that are not 16-byte aligned, on the emulator --------------------


@pytest.fixture(scope="module")
def emu_ops():
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    return NativeOps(runtime_emu.EmuRuntime(cache), weight_dtype="bf16")


def _shifted(ops, buf_bytes: np.ndarray, shift: int) -> SimpleNamespace:
    """The bytes uploaded `shift` bytes past an aligned start: a misaligned device pointer."""
    buf = ops._upload_bytes(np.concatenate([np.zeros(shift, np.uint8), buf_bytes]))
    return SimpleNamespace(ptr=buf.ptr + shift, keep=buf)


@pytest.mark.parametrize("t", [1, 3])
def test_misaligned_rows_take_the_fallback(emu_ops, t):
    from tests.gpu.checks import random_weight

    rng = np.random.default_rng(5)
    x = rng.standard_normal((t, 96)).astype(np.float32)
    for fmt in ("bf16", "nvfp4"):
        w, wf = random_weight(fmt, 19, 96, rng)
        dw = emu_ops.prepare_weight(w)
        want = emu_ops.linear(emu_ops.asarray(x), dw).numpy()
        raw = np.empty(dw.rows * dw.row_bytes, np.uint8)
        emu_ops.rt.d2h(raw, dw.data)
        moved = {"data": _shifted(emu_ops, raw, 2)}
        if fmt == "nvfp4":
            sraw = np.empty(dw.rows * dw.srow_bytes, np.uint8)
            emu_ops.rt.d2h(sraw, dw.scales)
            moved["scales"] = _shifted(emu_ops, sraw, 1)
        got = emu_ops.linear(emu_ops.asarray(x), type(dw)(**{**vars(dw), **moved})).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=fmt)
        np.testing.assert_allclose(got, x @ wf.T, rtol=2e-4, atol=2e-4, err_msg=fmt)
