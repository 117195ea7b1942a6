"""The CUDA runtime: cupy owns device memory, streams, events and graphs; kernels are compiled
to cubin by NVRTC (ops/nvrtc.py) for the device's exact sm_XY and cached on disk. The only
module that imports cupy.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from atlas_cli.backend.ops import nvrtc
from atlas_cli.backend.ops import runtime as rt

# cupy's RawKernel takes numpy scalars, each of the width the kernel's C signature says.
_ARG_TYPES = {"p": np.uint64, "i": np.int32, "q": np.int64, "f": np.float32}


class CudaUnavailable(RuntimeError):
    """cupy, NVRTC, the driver or a device is missing; the message says which."""


def _cupy():
    try:
        import cupy
    except ImportError:
        raise CudaUnavailable(
            "the CUDA backend needs cupy: pip install 'atlas-cli[cuda]'"
        ) from None
    return cupy


def probe() -> dict[str, Any]:
    """What `atlas hw` can show without compiling anything: whether cupy, NVRTC, a driver and
    a device are there. Never raises."""
    out: dict[str, Any] = {"runtime": "cuda", "available": False}
    try:
        cp = _cupy()
    except CudaUnavailable as exc:
        out["reason"] = str(exc)
        return out
    out["nvrtc"] = ".".join(map(str, nvrtc.version())) if nvrtc.available() else None
    try:
        n = cp.cuda.runtime.getDeviceCount()
        out["driver"] = cp.cuda.runtime.driverGetVersion()
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver
        out["reason"] = f"no usable CUDA driver ({exc})"
        return out
    devices = []
    for i in range(n):
        p = cp.cuda.runtime.getDeviceProperties(i)
        devices.append(
            {
                "name": p["name"].decode(),
                "sm": f"sm_{p['major']}{p['minor']}",
                "memory_gb": round(p["totalGlobalMem"] / 2**30, 1),
            }
        )
    out["devices"] = devices
    out["available"] = bool(devices) and out["nvrtc"] is not None
    if not devices:
        out["reason"] = "no CUDA device"
    elif out["nvrtc"] is None:
        out["reason"] = "libnvrtc not found: pip install nvidia-cuda-nvrtc"
    return out


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
            raise CudaUnavailable("libnvrtc not found: pip install 'atlas-cli[cuda]'")
        try:
            cp.cuda.Device(device).use()
            props = cp.cuda.runtime.getDeviceProperties(device)
            self.driver = cp.cuda.runtime.driverGetVersion()
        except Exception as exc:
            raise CudaUnavailable(f"no usable CUDA device {device}: {exc}") from None
        self.cp = cp
        self.device_name = props["name"].decode()
        self.target = f"sm_{props['major']}{props['minor']}"
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
