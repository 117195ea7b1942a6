"""The CUDA runtime: cupy owns device memory, streams, events and graphs; kernels are compiled
to cubin by NVRTC (ops/native/nvrtc.py) for the device's exact sm_XY and cached on disk. The only
module that imports cupy.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from atlas_cli.backend.ops.native import nvrtc
from atlas_cli.backend.ops.native import runtime as rt
from atlas_cli.backend.ops.native.runtime_probe import DeviceInfo, RuntimeProbe, install_command

# cupy's RawKernel takes numpy scalars, each of the width the kernel's C signature says.
_ARG_TYPES = {"p": np.uint64, "i": np.int32, "q": np.int64, "f": np.float32}


class CudaUnavailable(RuntimeError):
    """cupy, NVRTC, the driver or a device is missing; the message says which."""


_NEEDS_CUPY = f"the CUDA backend needs cupy: {install_command('cuda')}"


def _cupy():
    try:
        import cupy
    except ImportError:
        raise CudaUnavailable(_NEEDS_CUPY) from None
    return cupy


def probe() -> RuntimeProbe:
    """What cupy, the driver and NVRTC say about this machine, compiling nothing. The one place
    atlas asks cupy about devices (`atlas hw`, the hardware class, the GPU tests). Never
    raises: a failed call leaves its raw text in the record."""
    try:
        import cupy as cp
    except ImportError:
        return RuntimeProbe("cuda", "cupy", reason=_NEEDS_CUPY)
    except Exception as exc:  # a broken install raises from its own imports
        return RuntimeProbe(
            "cuda", "cupy", import_error=str(exc), reason=f"cupy fails to import ({exc})"
        )
    found = {
        "version": str(getattr(cp, "__version__", "")) or None,
        "installed": True,
        "driver": _version(cp.cuda.runtime.driverGetVersion),
        "runtime_version": _version(cp.cuda.runtime.runtimeGetVersion),
        "compiler": _nvrtc_version(),
    }
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError without a (new enough) driver
        reason = f"no usable CUDA driver ({exc})"
        return RuntimeProbe("cuda", "cupy", **found, error=str(exc), reason=reason)
    devices, error = _devices(cp, count)
    if not devices:
        reason = "no CUDA device"
    elif found["compiler"] is None:
        reason = "libnvrtc not found: pip install nvidia-cuda-nvrtc"
    else:
        reason = None
    return RuntimeProbe("cuda", "cupy", **found, devices=devices, error=error, reason=reason)


def _version(call) -> str | None:
    """CUDA encodes versions as 1000 * major + 10 * minor (13000 -> "13.0")."""
    try:
        v = int(call())
    except Exception:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvrtc_version() -> str | None:
    try:
        return ".".join(map(str, nvrtc.version()))
    except Exception:  # NvrtcUnavailable, or a library that fails its own call
        return None


def _devices(cp, count: int) -> tuple[tuple[DeviceInfo, ...], str | None]:
    """Each device's properties and free memory; a device whose properties fail is left out
    and its error kept."""
    devices, error = [], None
    for i in range(count):
        try:
            p = cp.cuda.runtime.getDeviceProperties(i)
        except Exception as exc:
            error = str(exc)
            continue
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        try:
            with cp.cuda.Device(i):
                free = int(cp.cuda.runtime.memGetInfo()[0])
        except Exception:
            free = None
        devices.append(
            DeviceInfo(
                index=i,
                name=name,
                arch=f"sm_{p['major']}{p['minor']}",
                total_bytes=int(p["totalGlobalMem"]),
                free_bytes=free,
                integrated=bool(p.get("integrated", 0)),
            )
        )
    return tuple(devices), error


class _Module:
    def __init__(self, mod):
        self.mod = mod
        self._fns: dict[str, Any] = {}

    def function(self, name: str):
        if name not in self._fns:
            self._fns[name] = self.mod.get_function(name)
        return self._fns[name]


class _Graph:
    def __init__(self, stream):
        self.stream = stream
        self.graph = None

    def replay(self) -> None:
        self.graph.launch(self.stream)


class CudaRuntime:
    name = "cuda"

    def __init__(self, device: int = 0):
        cp = _cupy()
        if not nvrtc.available():
            raise CudaUnavailable(f"libnvrtc not found: {install_command('cuda')}")
        try:
            cp.cuda.Device(device).use()
            props = cp.cuda.runtime.getDeviceProperties(device)
            self.driver = cp.cuda.runtime.driverGetVersion()
        except Exception as exc:
            raise CudaUnavailable(f"no usable CUDA device {device}: {exc}") from None
        self.cp = cp
        self.device_name = props["name"].decode()
        self.target = nvrtc.device_target(props["major"], props["minor"])  # sm_90a, sm_121a
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stats = rt.CompileStats()
        self._modules: dict[str, _Module] = {}
        self.toolchain = f"nvrtc-{'.'.join(map(str, nvrtc.version()))}-driver-{self.driver}"

    # -- memory: cupy's pool; buffers free themselves when dropped -------------------------
    def alloc(self, nbytes: int):
        return self.cp.cuda.alloc(max(int(nbytes), 1))

    def h2d(self, dst, host: np.ndarray, offset: int = 0) -> None:
        host = np.ascontiguousarray(host)
        (dst + offset).copy_from_host_async(
            ctypes.c_void_p(host.ctypes.data), host.nbytes, self.stream
        )
        self.stream.synchronize()  # host may be a temporary

    def d2h(self, host: np.ndarray, src, offset: int = 0) -> None:
        (src + offset).copy_to_host_async(
            ctypes.c_void_p(host.ctypes.data), host.nbytes, self.stream
        )
        self.stream.synchronize()

    def d2d(self, dst, dst_off: int, src, src_off: int, nbytes: int) -> None:
        (dst + dst_off).copy_from_device_async(src + src_off, nbytes, self.stream)

    # -- compile --------------------------------------------------------------------------
    def compile(self, file: str, defines: dict | None = None) -> _Module:
        key = f"{file}:{sorted((defines or {}).items())}"
        if key in self._modules:
            return self._modules[key]
        source = rt.expand_source(file)

        def build(path) -> None:
            out = nvrtc.compile_source(source, file, self.target, defines=defines)
            path.write_bytes(out.binary)

        path = rt.cached_compile(
            self.stats, file, source, self.target, self.toolchain, defines, ".cubin", build
        )
        mod = _Module(self.cp.RawModule(path=str(path)))
        self._modules[key] = mod
        return mod

    # -- launch, sync, events, graphs -----------------------------------------------------
    def launch(self, fn, grid: tuple, block: tuple, args: list[rt.Arg]) -> None:
        vals = rt.marshal(args, _ARG_TYPES)
        with self.stream:  # launches go to our stream (cupy launches on the current one)
            fn(tuple(grid), tuple(block), tuple(vals))

    def synchronize(self) -> None:
        self.stream.synchronize()

    def event(self):
        ev = self.cp.cuda.Event()
        stream = self.stream

        class _Ev:
            def record(self_inner) -> None:
                ev.record(stream)

        e = _Ev()
        e.ev = ev
        return e

    def elapsed_ms(self, start, end) -> float:
        end.ev.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start.ev, end.ev))

    @contextlib.contextmanager
    def capture(self):
        """Record the launches made inside the block into a CUDA graph (replay with
        graph.replay()); buffers used inside must outlive the graph."""
        graph = _Graph(self.stream)
        self.stream.begin_capture()
        try:
            yield graph
        finally:
            graph.graph = self.stream.end_capture()

    def info(self) -> dict[str, Any]:
        return {
            "runtime": "cuda",
            "device": self.device_name,
            "target": self.target,
            "toolchain": self.toolchain,
            **self.stats.summary(),
        }
