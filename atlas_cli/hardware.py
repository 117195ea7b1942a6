"""What this machine can run on: probe the GPUs, then classify.

`probe()` looks at the machine: NVIDIA through the CUDA runtime (cupy, when installed), AMD
through hip-python or, without it, the KFD topology in sysfs. It returns plain records. The
runtimes' own probes (backend/ops/native/runtime_cuda.py, runtime_hip.py) are the only code
that asks cupy and hip-python; this module turns their facts into records and into fixes for
the user.
`classify()` is a pure function of those records (tested on fake ones): it picks the hardware
class that recipes map to a variant, and says why the other backends cannot run.

Classes: gb10 (NVIDIA GB10, sm_121, unified memory), strix_halo (AMD gfx1151, unified memory),
cuda (any other NVIDIA card of compute capability 8.0 or newer), amd (other RDNA3/RDNA4:
gfx11xx, gfx12xx), cpu. `ATLAS_DEVICE` or `--device cpu|cuda|hip` overrides the choice.

Nothing here imports cupy or hip-python: importing atlas on a machine without them must work.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_cli.errors import DeviceError, UsageError

# the classes `classify` picks from; their home is hardware_classes, which recipes read too
from atlas_cli.hardware_classes import CLASSES as CLASSES

DEVICE_CHOICES = ("cpu", "cuda", "hip")
MIN_CUDA_CC = (8, 0)  # our kernels use bf16 and cp.async: Ampere or newer


def cuda_install() -> str:
    # numpy: not for --help
    from atlas_cli.backend.ops.native.runtime_probe import install_command

    return f"{install_command('cuda')} (for a CUDA 12 driver: cupy-cuda12x instead)"


def rocm_install() -> str:
    from atlas_cli.backend.ops.native.runtime_probe import install_command

    return f"{install_command('rocm')} (needs ROCm's libamdhip64.so)"


KFD_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")


# -- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    vendor: str  # "nvidia" | "amd"
    name: str  # "NVIDIA GB10", "AMD Radeon 8060S Graphics"
    arch: str  # "sm_121", "gfx1151"
    memory_bytes: int
    index: int = 0
    free_bytes: int | None = None
    unified_memory: bool = False  # device memory is the system's memory (GB10, APUs)
    source: str = ""  # "cupy", "hip-python", "kfd"

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        m = re.fullmatch(r"sm_(\d+)(\d)", self.arch)
        return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Toolchain:
    """One GPU backend's software: what is installed, and why it cannot run (if it cannot)."""

    backend: str  # "cuda" | "hip"
    package: str | None = None  # "cupy 14.2.0"
    driver: str | None = None
    runtime: str | None = None
    problem: str | None = None  # None: usable (when a device is present)
    device_seen: bool = False  # hardware seen without the runtime (/proc/driver/nvidia, KFD)


@dataclass(frozen=True)
class Probe:
    gpus: tuple[GPU, ...] = ()
    toolchains: tuple[Toolchain, ...] = ()
    cpu: str = ""
    cpu_count: int = 1
    memory_bytes: int = 0  # system RAM
    memory_available: int = 0

    def toolchain(self, backend: str) -> Toolchain:
        for tc in self.toolchains:
            if tc.backend == backend:
                return tc
        return Toolchain(backend, problem=f"{backend} was not probed")


@dataclass(frozen=True)
class Classification:
    hw_class: str  # one of CLASSES
    backend: str  # "cuda" | "hip" | "cpu"
    gpu: GPU | None
    memory_bytes: int  # what a model may use: device memory, or RAM for cpu/unified
    reason: str  # why this class
    notes: tuple[str, ...] = field(default_factory=tuple)  # why the other backends cannot run

    @property
    def device(self) -> str:
        return self.backend


# -- classification (pure) ---------------------------------------------------------------------


def gpu_class(gpu: GPU) -> tuple[str | None, str]:
    """(class, reason) for one GPU; class None when atlas has no kernels for it."""
    if gpu.vendor == "nvidia":
        cc = gpu.compute_capability
        if "GB10" in gpu.name.upper() or cc == (12, 1):
            return "gb10", f"{gpu.name} (sm_121, unified memory)"
        if cc is None:
            return None, f"{gpu.name}: unknown compute capability {gpu.arch!r}"
        if cc < MIN_CUDA_CC:
            return None, (
                f"{gpu.name} has compute capability {cc[0]}.{cc[1]}; atlas's CUDA kernels "
                f"need {MIN_CUDA_CC[0]}.{MIN_CUDA_CC[1]} or newer"
            )
        return "cuda", f"{gpu.name} (compute capability {cc[0]}.{cc[1]})"
    if gpu.vendor == "amd":
        if gpu.arch == "gfx1151":
            return "strix_halo", f"{gpu.name} (gfx1151, Strix Halo, unified memory)"
        if re.fullmatch(r"gfx1[12][0-9a-f]{2}", gpu.arch):
            return "amd", f"{gpu.name} ({gpu.arch})"
        return None, f"{gpu.name} ({gpu.arch}): atlas's HIP kernels target gfx11 and gfx12"
    return None, f"{gpu.name}: unknown vendor {gpu.vendor!r}"


_PREFERENCE = {"gb10": 0, "strix_halo": 1, "cuda": 2, "amd": 3}


def classify(probe: Probe, override: str | None = None) -> Classification:
    """Pick the hardware class for `probe`; `override` is cpu|cuda|hip (ATLAS_DEVICE)."""
    if override is not None and override not in DEVICE_CHOICES:
        raise UsageError(f"unknown device {override!r} (choose from {', '.join(DEVICE_CHOICES)})")
    notes: dict[str, list[str]] = {"cuda": [], "hip": []}
    candidates: list[tuple[int, int, GPU, str, str]] = []
    for backend in ("cuda", "hip"):
        tc = probe.toolchain(backend)
        gpus = [g for g in probe.gpus if g.vendor == _vendor(backend)]
        kind = "NVIDIA" if backend == "cuda" else "AMD"
        if not gpus:
            if tc.problem and tc.device_seen:
                notes[backend].append(f"an {kind} GPU is present, but {tc.problem}")
            elif tc.problem:
                notes[backend].append(f"no {kind} GPU found ({tc.problem})")
            else:
                notes[backend].append(f"no {kind} GPU found")
        for gpu in gpus:
            cls, why = gpu_class(gpu)
            if cls is None:
                notes[backend].append(why)
            elif tc.problem:
                notes[backend].append(f"{gpu.name} found, but {tc.problem}")
            else:
                candidates.append((_PREFERENCE[cls], -gpu.memory_bytes, gpu, cls, why))
    flat = tuple(f"{b}: {n}" for b in ("cuda", "hip") for n in notes[b])
    cpu = Classification("cpu", "cpu", None, probe.memory_available or probe.memory_bytes, "", flat)
    if override == "cpu":
        return _with_reason(cpu, "device cpu requested (ATLAS_DEVICE / --device)")
    usable = sorted(
        (c for c in candidates if override is None or _backend(c[3]) == override),
        key=lambda c: c[:2],
    )
    if not usable:
        if override is not None:
            why = "; ".join(notes[override]) or "no usable GPU"
            raise DeviceError(f"device {override} requested but it cannot run here: {why}")
        return _with_reason(cpu, "no usable GPU backend")
    _, _, gpu, cls, why = usable[0]
    memory = gpu.memory_bytes
    if gpu.unified_memory:
        # The GPU shares system memory: what the OS can give is the limit, not a VRAM size.
        memory = max(probe.memory_available, gpu.free_bytes or 0) or gpu.memory_bytes
    elif gpu.free_bytes:
        memory = gpu.free_bytes
    others = tuple(n for n in flat if not n.startswith(_backend(cls) + ":"))
    return Classification(cls, _backend(cls), gpu, memory, why, others)


def _backend(cls: str) -> str:
    return {"gb10": "cuda", "cuda": "cuda", "strix_halo": "hip", "amd": "hip"}.get(cls, "cpu")


def _vendor(backend: str) -> str:
    return "nvidia" if backend == "cuda" else "amd"


def _with_reason(c: Classification, reason: str) -> Classification:
    return Classification(c.hw_class, c.backend, c.gpu, c.memory_bytes, reason, c.notes)


# -- probing (impure) --------------------------------------------------------------------------


def detect(device: str | None = None) -> Classification:
    """Classify this machine; `device` (or ATLAS_DEVICE) forces cpu, cuda or hip."""
    override = device or os.environ.get("ATLAS_DEVICE") or None
    if override in ("cpu-ref",):
        override = "cpu"
    return classify(probe(), override)


def hardware_class(device: str | None = None) -> str:
    """The recipe hardware class for `device` (cpu, cpu-ref and emu skip the probe: the
    emulator runs in host memory, on whatever the CPU variant is)."""
    device = device or os.environ.get("ATLAS_DEVICE") or None
    if device in ("cpu", "cpu-ref", "emu"):
        return "cpu"
    return detect(device).hw_class


def probe(kfd_root: Path = KFD_TOPOLOGY) -> Probe:
    cuda_gpus, cuda_tc = probe_cuda()
    hip_gpus, hip_tc = probe_hip(kfd_root)
    total, available = system_memory()
    return Probe(
        gpus=tuple(cuda_gpus + hip_gpus),
        toolchains=(cuda_tc, hip_tc),
        cpu=cpu_name(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=total,
        memory_available=available,
    )


def probe_cuda() -> tuple[list[GPU], Toolchain]:
    """The CUDA runtime's facts (runtime_cuda.probe) as GPU records and a Toolchain."""
    from atlas_cli.backend.ops.native import runtime_cuda  # numpy and cupy: only when asked

    seen = nvidia_present()
    found = runtime_cuda.probe()
    if not found.installed:
        if found.import_error is None:
            problem = f"cupy is not installed: {cuda_install()}"
        else:
            problem = f"cupy fails to import ({found.import_error}): reinstall it"
        return [], Toolchain("cuda", problem=problem, device_seen=seen)
    package = _package(found)
    driver, rt = found.driver, found.runtime_version
    if found.error is not None and not found.devices:
        problem = cuda_problem(found.error, driver, rt)
        return [], Toolchain("cuda", package, driver, rt, problem, device_seen=seen)
    gpus = [
        GPU(
            "nvidia",
            d.name,
            d.arch,
            d.total_bytes,
            index=d.index,
            free_bytes=d.free_bytes,
            unified_memory=d.integrated or "GB10" in d.name,
            source="cupy",
        )
        for d in found.devices
    ]
    return gpus, Toolchain("cuda", package, driver, rt, None, device_seen=seen or bool(gpus))


def _package(found) -> str:
    """The package and its version, "cupy 14.2.0"; the bare name where it is unknown."""
    return f"{found.package} {found.version}" if found.version else found.package


def cuda_problem(message: str, driver: str | None, runtime: str | None) -> str:
    """A fix for the errors cupy raises without a working driver (see notes/toolchains.md)."""
    if "InsufficientDriver" in message:
        have = f"driver supports CUDA {driver}" if driver and driver != "0.0" else "no driver"
        return (
            f"the NVIDIA driver is missing or too old for cupy's CUDA {runtime or '?'} runtime "
            f"({have}; cudaErrorInsufficientDriver): install or update the NVIDIA driver, or "
            "install the cupy wheel that matches it (cupy-cuda12x for a CUDA 12 driver)"
        )
    if "NoDevice" in message:
        return "no CUDA device found (cudaErrorNoDevice)"
    return f"the CUDA runtime failed: {message}"


def nvidia_present() -> bool:
    if Path("/proc/driver/nvidia/gpus").is_dir():
        return True
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith(("0x0300", "0x0302")):
            return True
    return False


def probe_hip(kfd_root: Path = KFD_TOPOLOGY) -> tuple[list[GPU], Toolchain]:
    """The HIP runtime's facts (runtime_hip.probe) as GPU records and a Toolchain; where HIP
    cannot run, the GPUs the KFD topology shows, so `atlas hw` can say what is missing."""
    from atlas_cli.backend.ops.native import runtime_hip  # numpy and hip-python: when asked

    kfd = kfd_gpus(kfd_root)
    seen = bool(kfd)
    found = runtime_hip.probe()
    if not found.installed:
        if found.import_error is None:
            problem = f"hip-python is not installed: {rocm_install()}"
        else:
            problem = f"hip-python fails to import ({found.import_error})"
        return kfd, Toolchain("hip", problem=problem, device_seen=seen)
    package = _package(found)
    driver, rt = found.driver, found.runtime_version
    if not found.devices:
        # HIP answers hipErrorNoDevice for a count of 0; say so where it gave no text
        problem = hip_problem(found.error or "hipErrorNoDevice")
        return kfd, Toolchain("hip", package, driver, rt, problem, device_seen=seen)
    gpus = [
        GPU(
            "amd",
            d.name,
            d.arch,
            d.total_bytes,
            d.index,
            d.free_bytes,
            d.integrated or d.arch == "gfx1151",
            "hip-python",
        )
        for d in found.devices
    ]
    return gpus, Toolchain("hip", package, driver, rt, None, device_seen=seen or bool(gpus))


def hip_problem(message: str) -> str:
    if "dlopen" in message or "libamdhip64" in message:
        return (
            "hip-python is installed but the HIP runtime (libamdhip64.so) is not: install ROCm "
            "6.x or newer, or add its lib directory to LD_LIBRARY_PATH"
        )
    if "NoDevice" in message:
        return "no AMD GPU found by HIP (hipErrorNoDevice); check that /dev/kfd is accessible"
    return f"the HIP runtime failed: {message}"


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) -> "gfx1151"."""
    major, rest = divmod(target_version, 10000)
    minor, step = divmod(rest, 100)
    return f"gfx{major}{minor:x}{step:x}"


def parse_properties(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def kfd_gpus(root: Path = KFD_TOPOLOGY) -> list[GPU]:
    """GPU nodes of the KFD topology (works without ROCm's user-space libraries)."""
    gpus = []
    nodes = sorted(root.glob("[0-9]*"), key=lambda p: int(p.name)) if root.is_dir() else []
    for node in nodes:
        try:
            props = parse_properties((node / "properties").read_text())
        except OSError:
            continue
        target = props.get("gfx_target_version", 0)
        if not target or not props.get("simd_count"):
            continue  # a CPU node
        memory = 0
        for bank in node.glob("mem_banks/*/properties"):
            with contextlib.suppress(OSError):
                memory += parse_properties(bank.read_text()).get("size_in_bytes", 0)
        arch = gfx_name(target)
        try:
            name = (node / "name").read_text().strip() or arch
        except OSError:
            name = arch
        unified = bool(props.get("cpu_cores_count")) or arch == "gfx1151"
        gpus.append(GPU("amd", name, arch, memory, len(gpus), None, unified, "kfd"))
    return gpus


def system_memory() -> tuple[int, int]:
    """(total, available) RAM in bytes."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
        return total, total


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- report ------------------------------------------------------------------------------------


def report(probe_: Probe, chosen: Classification) -> dict:
    """`atlas hw --json`: devices, toolchains, the choice and why."""
    backends = {"cpu": {"available": True, "why_not": None}}
    for tc in probe_.toolchains:
        why = [n.partition(": ")[2] for n in chosen.notes if n.startswith(tc.backend + ":")]
        backends[tc.backend] = {
            "available": chosen.backend == tc.backend or not why,
            "package": tc.package,
            "driver": tc.driver,
            "runtime": tc.runtime,
            "why_not": "; ".join(why) or None,
        }
    return {
        "class": chosen.hw_class,
        "backend": chosen.backend,
        "reason": chosen.reason,
        "memory_bytes": chosen.memory_bytes,
        "cpu": {
            "name": probe_.cpu,
            "cores": probe_.cpu_count,
            "memory_bytes": probe_.memory_bytes,
            "memory_available_bytes": probe_.memory_available,
        },
        "gpus": [
            {
                "vendor": g.vendor,
                "name": g.name,
                "arch": g.arch,
                "memory_bytes": g.memory_bytes,
                "free_bytes": g.free_bytes,
                "unified_memory": g.unified_memory,
                "class": gpu_class(g)[0],
                "source": g.source,
            }
            for g in probe_.gpus
        ],
        "backends": backends,
        "notes": list(chosen.notes),
    }


# -- kernels -----------------------------------------------------------------------------------

NATIVE_DEVICES = ("cuda", "hip")


def kernel_reports(compile_kernels: bool = True) -> dict[str, dict[str, Any]]:
    """`atlas hw`: for each native backend whose runtime can start here, what compiling every
    kernel file took (or that the on-disk cache was hit); backends that cannot run are absent.
    Each value is native.kernel_report's dict, {"skipped": why} or {"error": message}: `hw` is a
    diagnostic, so a failed compile is reported, not raised."""
    from atlas_cli.backend.ops.native import device as native  # numpy, runtimes: when asked

    out: dict[str, dict[str, Any]] = {}
    for device in NATIVE_DEVICES:
        if not native.probe(device).get("available"):
            continue
        if not compile_kernels:
            out[device] = {"skipped": "--no-compile"}
            continue
        try:
            out[device] = native.kernel_report(device)
        except Exception as exc:  # NVRTC/hiprtc errors, DeviceError: say it, keep the report
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            out[device] = {"error": f"{type(exc).__name__}: {first}".rstrip(": ")}
    return out
