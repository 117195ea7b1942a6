"""Hardware classification on fake device records, and the probes on fake runtimes: fake cupy
and hip-python modules under the runtimes' own probes, and fake probe records under hardware."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from atlas_cli import hardware as hw
from atlas_cli import recipes
from atlas_cli.errors import DeviceError, UsageError

GB = 1 << 30
CUDA_OK = hw.Toolchain("cuda", "cupy 14.2.0", "13.0", "13.0")
HIP_OK = hw.Toolchain("hip", "hip-python", "7.0", "7.0")
NO_CUPY = hw.Toolchain("cuda", problem=f"cupy is not installed: {hw.cuda_install()}")
NO_HIP = hw.Toolchain("hip", problem=f"hip-python is not installed: {hw.rocm_install()}")

GB10 = hw.GPU("nvidia", "NVIDIA GB10", "sm_121", 119 * GB, unified_memory=True, source="cupy")
H200 = hw.GPU("nvidia", "NVIDIA H200", "sm_90", 141 * GB, free_bytes=139 * GB, source="cupy")
RTX4090 = hw.GPU("nvidia", "NVIDIA GeForce RTX 4090", "sm_89", 24 * GB, source="cupy")
V100 = hw.GPU("nvidia", "Tesla V100-SXM2-16GB", "sm_70", 16 * GB, source="cupy")
STRIX = hw.GPU("amd", "AMD Radeon 8060S", "gfx1151", 96 * GB, unified_memory=True)
RX7900 = hw.GPU("amd", "AMD Radeon RX 7900 XTX", "gfx1100", 24 * GB)
RX9070 = hw.GPU("amd", "AMD Radeon RX 9070 XT", "gfx1201", 16 * GB)
MI300 = hw.GPU("amd", "AMD Instinct MI300X", "gfx942", 192 * GB)


def probe(*gpus, cuda=CUDA_OK, hip=HIP_OK, ram=64 * GB, available=60 * GB):
    return hw.Probe(tuple(gpus), (cuda, hip), "Some CPU", 16, ram, available)


@pytest.mark.parametrize(
    "gpus, cls, backend",
    [
        ((GB10,), "gb10", "cuda"),
        ((STRIX,), "strix_halo", "hip"),
        ((H200,), "cuda", "cuda"),
        ((RTX4090,), "cuda", "cuda"),
        ((RX7900,), "amd", "hip"),
        ((RX9070,), "amd", "hip"),
        ((), "cpu", "cpu"),
        ((V100,), "cpu", "cpu"),
        ((MI300,), "cpu", "cpu"),
        ((RX7900, H200), "cuda", "cuda"),  # NVIDIA before other AMD
        ((RTX4090, H200), "cuda", "cuda"),
    ],
)
def test_classes(gpus, cls, backend):
    c = hw.classify(probe(*gpus))
    assert (c.hw_class, c.backend) == (cls, backend)


def test_gb10_is_sm121_with_unified_memory():
    # by compute capability alone, too
    anon = hw.GPU("nvidia", "NVIDIA Graphics Device", "sm_121", 119 * GB, unified_memory=True)
    for gpu in (GB10, anon):
        c = hw.classify(probe(gpu, available=110 * GB))
        assert c.hw_class == "gb10"
        assert c.memory_bytes == 110 * GB  # what the OS can give, not a VRAM size
    assert GB10.compute_capability == (12, 1)


def test_h200_by_compute_capability_uses_free_device_memory():
    c = hw.classify(probe(H200))
    assert c.gpu is H200 and c.memory_bytes == 139 * GB
    assert "compute capability 9.0" in c.reason
    assert "hip: no AMD GPU found" in c.notes


def test_largest_cuda_card_wins():
    assert hw.classify(probe(RTX4090, H200)).gpu is H200


def test_old_and_unsupported_gpus_say_why():
    c = hw.classify(probe(V100))
    assert any("compute capability 7.0" in n and "8.0 or newer" in n for n in c.notes)
    c = hw.classify(probe(MI300))
    assert any("gfx942" in n and "gfx11 and gfx12" in n for n in c.notes)


def test_no_gpu_says_why_for_each_backend():
    c = hw.classify(probe(cuda=NO_CUPY, hip=NO_HIP, available=20 * GB))
    assert (c.hw_class, c.memory_bytes) == ("cpu", 20 * GB)
    assert c.reason == "no usable GPU backend"
    cuda, hip = c.notes
    assert cuda.startswith("cuda: no NVIDIA GPU found (cupy is not installed: pip install")
    assert hip.startswith("hip: no AMD GPU found (hip-python is not installed: pip install")


def test_gpu_present_but_package_missing_says_how_to_fix():
    seen = hw.Toolchain("cuda", problem=NO_CUPY.problem, device_seen=True)
    c = hw.classify(probe(cuda=seen, hip=NO_HIP))
    assert c.hw_class == "cpu"
    assert "cuda: an NVIDIA GPU is present, but cupy is not installed: pip install" in c.notes[0]
    # the KFD topology shows a Strix Halo but hip-python is missing
    c = hw.classify(probe(STRIX, hip=NO_HIP))
    assert c.hw_class == "cpu"
    assert any("AMD Radeon 8060S found, but hip-python is not installed" in n for n in c.notes)


def test_old_driver_is_reported():
    problem = hw.cuda_problem(
        "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
        "0.0",
        "13.0",
    )
    assert "driver is missing or too old for cupy's CUDA 13.0 runtime" in problem
    assert "cupy-cuda12x" in problem
    tc = hw.Toolchain("cuda", "cupy 14.2.0", None, "13.0", problem, device_seen=True)
    c = hw.classify(probe(cuda=tc, hip=NO_HIP))
    assert "too old" in c.notes[0]


def test_hip_runtime_missing_is_reported():
    assert "install ROCm" in hw.hip_problem("failed to dlopen 'libamdhip64.so'")
    assert "hipErrorNoDevice" in hw.hip_problem("hipError_t.hipErrorNoDevice")


def test_overrides():
    both = probe(H200, STRIX)
    assert hw.classify(both).hw_class == "strix_halo"  # unified-memory APU first
    assert hw.classify(both, "cuda").hw_class == "cuda"
    assert hw.classify(both, "hip").hw_class == "strix_halo"
    cpu = hw.classify(both, "cpu")
    assert cpu.hw_class == "cpu" and "requested" in cpu.reason
    with pytest.raises(DeviceError, match="device cuda requested but it cannot run here: no "):
        hw.classify(probe(STRIX, cuda=NO_CUPY), "cuda")
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        hw.classify(both, "tpu")


def test_atlas_device_env(monkeypatch):
    monkeypatch.setattr(hw, "probe", lambda: probe(H200))
    monkeypatch.setenv("ATLAS_DEVICE", "cpu")
    assert hw.detect().hw_class == "cpu"
    monkeypatch.delenv("ATLAS_DEVICE")
    assert hw.detect().hw_class == "cuda"
    assert hw.detect("cpu").hw_class == "cpu"


def test_recipes_get_a_variant_for_every_class():
    for cls in hw.CLASSES:
        for recipe in recipes.all_recipes().values():
            assert recipe.variant_for(cls) in recipe.variants


# -- probes on fake runtimes -------------------------------------------------------------------


def test_gfx_names():
    assert hw.gfx_name(110501) == "gfx1151"
    assert hw.gfx_name(110000) == "gfx1100"
    assert hw.gfx_name(120001) == "gfx1201"
    assert hw.gfx_name(90010) == "gfx90a"
    assert hw.gfx_name(90402) == "gfx942"


def test_kfd_topology(tmp_path):
    cpu = tmp_path / "0"
    cpu.mkdir()
    (cpu / "properties").write_text("cpu_cores_count 32\nsimd_count 0\ngfx_target_version 0\n")
    gpu = tmp_path / "1"
    (gpu / "mem_banks" / "0").mkdir(parents=True)
    (gpu / "properties").write_text(
        "cpu_cores_count 0\nsimd_count 80\ngfx_target_version 110501\nvendor_id 4098\n"
    )
    (gpu / "mem_banks" / "0" / "properties").write_text("heap_type 1\nsize_in_bytes 536870912\n")
    (gpu / "name").write_text("gfx1151\n")
    (gpus,) = [hw.kfd_gpus(tmp_path)]
    assert len(gpus) == 1
    g = gpus[0]
    assert (g.vendor, g.arch, g.memory_bytes, g.unified_memory, g.source) == (
        "amd",
        "gfx1151",
        512 << 20,
        True,
        "kfd",
    )
    assert hw.kfd_gpus(tmp_path / "missing") == []


class FakeCUDARuntimeError(Exception):
    pass


def fake_cupy(count_error: str | None = None, devices=()):
    runtime = types.SimpleNamespace(
        driverGetVersion=lambda: 13000 if devices else 0,
        runtimeGetVersion=lambda: 13000,
        memGetInfo=lambda: (100 * GB, 141 * GB),
        getDeviceProperties=lambda i: devices[i],
    )

    def count():
        if count_error:
            raise FakeCUDARuntimeError(count_error)
        return len(devices)

    runtime.getDeviceCount = count

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cuda = types.SimpleNamespace(runtime=runtime, Device=Device)
    return types.SimpleNamespace(__version__="14.2.0", cuda=cuda)


def test_probe_cuda_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails
    gpus, tc = hw.probe_cuda()
    assert gpus == [] and "cupy is not installed" in tc.problem


def test_probe_cuda_without_driver(monkeypatch):
    msg = (
        "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(msg))
    gpus, tc = hw.probe_cuda()
    assert gpus == [] and tc.package == "cupy 14.2.0"
    assert "too old" in tc.problem


def test_probe_cuda_h200(monkeypatch):
    props = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "totalGlobalMem": 141 * GB}
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(devices=[props]))
    gpus, tc = hw.probe_cuda()
    assert tc.problem is None and tc.driver == "13.0"
    (g,) = gpus
    assert (g.name, g.arch, g.free_bytes, g.unified_memory) == (
        "NVIDIA H200",
        "sm_90",
        100 * GB,
        False,
    )
    assert hw.classify(hw.Probe((g,), (tc, NO_HIP))).hw_class == "cuda"


def fake_hip(count=None, error=None):
    class Err:
        def __init__(self, value, name):
            self.value, self.name = value, name

        def __str__(self):
            return f"hipError_t.{self.name}"

    ok = Err(0, "hipSuccess")

    def get_count():
        if error:
            raise RuntimeError(error)
        return (ok, count) if count else (Err(100, "hipErrorNoDevice"), 0)

    def get_properties(props, i):  # hip-python fills the hipDeviceProp_t it is given
        props.gcnArchName = b"gfx1151:sramecc-:xnack-"
        props.name = b"AMD Radeon 8060S"
        props.totalGlobalMem = 96 * GB
        return (ok,)

    hip = types.SimpleNamespace(
        hipGetDeviceCount=get_count,
        hipDeviceProp_t=types.SimpleNamespace,
        hipGetDeviceProperties=get_properties,
        hipDriverGetVersion=lambda: (ok, 70_000_000),
        hipRuntimeGetVersion=lambda: (ok, 70_000_000),
    )
    return types.SimpleNamespace(hip=hip)


def test_probe_hip_variants(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "hip", fake_hip(error="failed to dlopen 'libamdhip64.so'"))
    gpus, tc = hw.probe_hip(tmp_path)
    assert gpus == [] and "libamdhip64.so" in tc.problem
    monkeypatch.setitem(sys.modules, "hip", fake_hip(count=0))
    assert "hipErrorNoDevice" in hw.probe_hip(tmp_path)[1].problem
    monkeypatch.setitem(sys.modules, "hip", fake_hip(count=1))
    gpus, tc = hw.probe_hip(tmp_path)
    assert tc.problem is None and tc.runtime == "7.0"
    (g,) = gpus
    assert (g.arch, g.unified_memory) == ("gfx1151", True)
    assert hw.classify(hw.Probe((g,), (NO_CUPY, tc), memory_available=90 * GB)).hw_class == (
        "strix_halo"
    )


def test_probe_on_this_machine_runs():
    p = hw.probe()
    assert p.memory_bytes > 0 and p.cpu_count >= 1
    report = hw.report(p, hw.classify(p))
    assert report["backends"]["cpu"]["available"]


# -- the runtimes' probe records, and hardware's reading of them -------------------------------

H200_PROPS = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "totalGlobalMem": 141 * GB}


def test_cuda_runtime_probe_is_plain_data(monkeypatch):
    from atlas_cli.backend.ops.native import nvrtc, runtime_cuda

    monkeypatch.setattr(nvrtc, "version", lambda: (12, 8))
    gb10 = {"name": b"NVIDIA GB10", "major": 12, "minor": 1, "totalGlobalMem": 119 * GB}
    monkeypatch.setitem(
        sys.modules, "cupy", fake_cupy(devices=[H200_PROPS, gb10 | {"integrated": 1}])
    )
    found = runtime_cuda.probe()
    assert (found.version, found.driver, found.runtime_version, found.compiler) == (
        "14.2.0",
        "13.0",
        "13.0",
        "12.8",
    )
    assert found.available and found.error is None
    assert [
        (d.index, d.name, d.arch, d.total_bytes, d.free_bytes, d.integrated) for d in found.devices
    ] == [
        (0, "NVIDIA H200", "sm_90", 141 * GB, 100 * GB, False),
        (1, "NVIDIA GB10", "sm_121", 119 * GB, 100 * GB, True),
    ]
    monkeypatch.setattr(
        nvrtc, "version", lambda: (_ for _ in ()).throw(nvrtc.NvrtcUnavailable("x"))
    )
    found = runtime_cuda.probe()
    assert found.compiler is None and found.reason.startswith("libnvrtc not found")


def test_cuda_runtime_probe_keeps_the_raw_error(monkeypatch):
    from atlas_cli.backend.ops.native import runtime_cuda

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy("cudaErrorNoDevice: no CUDA-capable device"))
    found = runtime_cuda.probe()
    assert found.installed and not found.available and found.devices == ()
    assert found.error == "cudaErrorNoDevice: no CUDA-capable device"
    assert found.driver == "0.0"  # what cupy says without a driver
    monkeypatch.setitem(sys.modules, "cupy", None)
    found = runtime_cuda.probe()
    assert not found.installed and found.import_error is None and "pip install" in found.reason


def test_broken_gpu_packages_never_raise(monkeypatch):
    import builtins

    from atlas_cli.backend.ops.native import runtime_cuda, runtime_hip

    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name in ("cupy", "hip"):
            raise OSError(f"{name}: libfoo.so: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    for mod in (runtime_cuda, runtime_hip):
        found = mod.probe()
        assert not found.installed and "cannot open shared object" in found.import_error
    gpus, tc = hw.probe_cuda()
    assert gpus == [] and tc.problem.startswith("cupy fails to import (cupy: libfoo.so")
    assert tc.problem.endswith("reinstall it")


def test_hip_runtime_probe_is_plain_data(monkeypatch):
    from atlas_cli.backend.ops.native import runtime_hip

    monkeypatch.setitem(sys.modules, "hip", fake_hip(count=1))
    found = runtime_hip.probe()
    assert found.available and (found.driver, found.runtime_version) == ("7.0", "7.0")
    (d,) = found.devices
    assert (d.index, d.name, d.arch, d.total_bytes, d.free_bytes) == (
        0,
        "AMD Radeon 8060S",
        "gfx1151",
        96 * GB,
        None,
    )
    monkeypatch.setitem(sys.modules, "hip", fake_hip(count=0))
    found = runtime_hip.probe()
    assert found.error == "hipError_t.hipErrorNoDevice" and found.reason == "no HIP device"
    fake = fake_hip(count=1)
    fake.hip.hipGetDeviceProperties = lambda props, i: (_ for _ in ()).throw(ValueError("bad"))
    monkeypatch.setitem(sys.modules, "hip", fake)
    found = runtime_hip.probe()
    assert found.devices == () and found.error == "bad" and not found.available
    assert hw.probe_hip(Path("/nonexistent"))[1].problem == "the HIP runtime failed: bad"


def record(runtime, *devices, **kw):
    from atlas_cli.backend.ops.native.runtime_probe import RuntimeProbe

    package = "cupy" if runtime == "cuda" else "hip-python"
    return RuntimeProbe(runtime, package, "14.2.0", True, devices=tuple(devices), **kw)


def test_hardware_reads_the_runtime_records(monkeypatch):
    from atlas_cli.backend.ops.native import device as native
    from atlas_cli.backend.ops.native import runtime_cuda, runtime_hip
    from atlas_cli.backend.ops.native.runtime_probe import DeviceInfo

    # GB10 reports itself as not integrated on some drivers: the name says it shares memory
    gb10 = DeviceInfo(0, "NVIDIA GB10", "sm_121", 119 * GB, 110 * GB, integrated=False)
    monkeypatch.setattr(runtime_cuda, "probe", lambda: record("cuda", gb10, driver="13.0"))
    (g,), tc = hw.probe_cuda()
    assert (g.name, g.arch, g.memory_bytes, g.free_bytes, g.unified_memory, g.source) == (
        "NVIDIA GB10",
        "sm_121",
        119 * GB,
        110 * GB,
        True,
        "cupy",
    )
    assert (tc.package, tc.driver, tc.problem) == ("cupy 14.2.0", "13.0", None)
    # native.probe reads the same record
    info = native.probe("cuda")
    assert info["available"] and info["devices"][0]["arch"] == "sm_121"

    old = "cudaErrorInsufficientDriver: CUDA driver version is insufficient"
    monkeypatch.setattr(
        runtime_cuda,
        "probe",
        lambda: record("cuda", driver="0.0", runtime_version="13.0", error=old, reason="x"),
    )
    gpus, tc = hw.probe_cuda()
    assert gpus == [] and "too old for cupy's CUDA 13.0 runtime (no driver" in tc.problem
    assert not native.probe("cuda")["available"]

    dlopen = "failed to dlopen 'libamdhip64.so'"
    monkeypatch.setattr(runtime_hip, "probe", lambda: record("hip", error=dlopen, reason="x"))
    gpus, tc = hw.probe_hip(Path("/nonexistent"))
    assert gpus == [] and "install ROCm" in tc.problem and tc.package == "hip-python 14.2.0"
    assert native.probe("hip")["error"] == dlopen


def test_install_advice_names_packages_the_index_has():
    """atlas itself may not be on the package index (a checkout, a wheel file): the advice
    installs the extra's packages by name, read from this installation's metadata."""
    from atlas_cli.backend.ops.native.runtime_probe import install_command

    cuda, rocm = install_command("cuda"), install_command("rocm")
    assert (
        cuda.startswith("pip install ") and "cupy-cuda13x" in cuda and "nvidia-cuda-nvrtc" in cuda
    )
    assert rocm == "pip install hip-python"
    assert "atlas-cli[" not in hw.cuda_install() + hw.rocm_install()
