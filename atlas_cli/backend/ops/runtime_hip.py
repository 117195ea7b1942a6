"""The HIP runtime: hip-python for memory, streams, events, graphs and module launches; hiprtc
compiles the same kernel sources for the device's gfx target, cached on disk. The only module
that imports hip-python.

Written against hip-python's documented API (every call returns (error, value...)); it has not
run on an AMD GPU yet (no such machine was available to this project when it was written).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from atlas_cli.backend.ops import runtime as rt


class HipUnavailable(RuntimeError):
    """hip-python, libamdhip64 or a device is missing; the message says which."""


def _hip():
    try:
        from hip import hip, hiprtc
    except ImportError:
        raise HipUnavailable(
            "the HIP backend needs hip-python: pip install 'atlas-cli[rocm]'"
        ) from None
    return hip, hiprtc


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    name = getattr(err, "name", str(err))
    if "Success" not in name and "SUCCESS" not in name:
        raise RuntimeError(f"HIP call failed: {name}")
    return rest[0] if len(rest) == 1 else rest


def probe() -> dict[str, Any]:
    """Whether hip-python, libamdhip64 and a device are there. Never raises."""
    out: dict[str, Any] = {"runtime": "hip", "available": False}
    try:
        hip, _ = _hip()
    except HipUnavailable as exc:
        out["reason"] = str(exc)
        return out
    try:
        err, n = hip.hipGetDeviceCount()
    except Exception as exc:  # RuntimeError: failed to dlopen libamdhip64.so
        out["reason"] = f"HIP runtime not loadable ({exc})"
        return out
    if "Success" not in getattr(err, "name", str(err)) or n == 0:
        out["reason"] = "no HIP device"
        return out
    devices = []
    for i in range(n):
        props = hip.hipDeviceProp_t()
        _check(hip.hipGetDeviceProperties(props, i))
        arch = props.gcnArchName
        arch = arch.decode() if isinstance(arch, bytes) else str(arch)
        devices.append({"name": str(props.name), "target": arch.split(":")[0]})
    out["devices"] = devices
    out["available"] = True
    return out


class _Buffer:
    def __init__(self, hip, nbytes: int):
        self.hip = hip
        self.nbytes = nbytes
        self._p = _check(hip.hipMalloc(nbytes))
        self.ptr = int(self._p)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.hip.hipFree(self._p)


class _Module:
    def __init__(self, hip, module):
        self.hip = hip
        self.module = module
        self._fns: dict[str, Any] = {}

    def function(self, name: str):
        if name not in self._fns:
            self._fns[name] = _check(self.hip.hipModuleGetFunction(self.module, name.encode()))
        return self._fns[name]


class _Graph:
    def __init__(self, hip, stream):
        self.hip, self.stream, self.exe = hip, stream, None

    def replay(self) -> None:
        _check(self.hip.hipGraphLaunch(self.exe, self.stream))


class HipRuntime:
    name = "hip"

    def __init__(self, device: int = 0):
        hip, hiprtc = _hip()
        info = probe()
        if not info["available"]:
            raise HipUnavailable(info.get("reason", "no HIP device"))
        self.hip, self.hiprtc = hip, hiprtc
        _check(hip.hipSetDevice(device))
        self.device_name = info["devices"][device]["name"]
        self.target = info["devices"][device]["target"]  # e.g. gfx1151
        self.stream = _check(hip.hipStreamCreate())
        self.driver = _check(hip.hipDriverGetVersion())
        self.toolchain = f"hiprtc-driver-{self.driver}"
        self.stats = rt.CompileStats()
        self._modules: dict[str, _Module] = {}

    def alloc(self, nbytes: int) -> _Buffer:
        return _Buffer(self.hip, max(int(nbytes), 1))

    def h2d(self, dst: _Buffer, host: np.ndarray, offset: int = 0) -> None:
        host = np.ascontiguousarray(host)
        kind = self.hip.hipMemcpyKind.hipMemcpyHostToDevice
        _check(self.hip.hipMemcpy(dst.ptr + offset, host.ctypes.data, host.nbytes, kind))

    def d2h(self, host: np.ndarray, src: _Buffer, offset: int = 0) -> None:
        _check(self.hip.hipStreamSynchronize(self.stream))
        kind = self.hip.hipMemcpyKind.hipMemcpyDeviceToHost
        _check(self.hip.hipMemcpy(host.ctypes.data, src.ptr + offset, host.nbytes, kind))

    def d2d(self, dst: _Buffer, dst_off: int, src: _Buffer, src_off: int, nbytes: int) -> None:
        kind = self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice
        _check(
            self.hip.hipMemcpyAsync(dst.ptr + dst_off, src.ptr + src_off, nbytes, kind, self.stream)
        )

    def compile(self, file: str, defines: dict | None = None) -> _Module:
        key = f"{file}:{sorted((defines or {}).items())}"
        if key in self._modules:
            return self._modules[key]
        source = rt.expand_source(file)
        hiprtc = self.hiprtc

        def build(path) -> None:
            prog = _check(hiprtc.hiprtcCreateProgram(source.encode(), file.encode(), 0, [], []))
            opts = [f"--offload-arch={self.target}".encode(), b"-O3", b"-std=c++17"]
            opts += [f"-D{k}={v}".encode() for k, v in (defines or {}).items()]
            (err,) = hiprtc.hiprtcCompileProgram(prog, len(opts), opts)
            if "SUCCESS" not in getattr(err, "name", str(err)):
                size = _check(hiprtc.hiprtcGetProgramLogSize(prog))
                log = bytearray(size)
                _check(hiprtc.hiprtcGetProgramLog(prog, log))
                raise RuntimeError(f"hiprtc failed on {file}:\n{log.decode(errors='replace')}")
            size = _check(hiprtc.hiprtcGetCodeSize(prog))
            code = bytearray(size)
            _check(hiprtc.hiprtcGetCode(prog, code))
            path.write_bytes(bytes(code))

        path = rt.cached_compile(
            self.stats, file, source, self.target, self.toolchain, defines, ".hsaco", build
        )
        data = path.read_bytes()
        module = _check(self.hip.hipModuleLoadData(data))
        mod = _Module(self.hip, module)
        self._modules[key] = mod
        return mod

    def launch(self, fn, grid: tuple, block: tuple, args: list[rt.Arg]) -> None:
        vals = rt.marshal(args, rt.CTYPES_ARGS)
        grid, block = rt.dims3(grid), rt.dims3(block)
        _check(
            self.hip.hipModuleLaunchKernel(
                fn,
                *grid,
                *block,
                sharedMemBytes=0,
                stream=self.stream,
                kernelParams=None,
                extra=tuple(vals),
            )
        )

    def synchronize(self) -> None:
        _check(self.hip.hipStreamSynchronize(self.stream))

    def event(self):
        hip, stream = self.hip, self.stream
        ev = _check(hip.hipEventCreate())

        class _Ev:
            def record(self_inner) -> None:
                _check(hip.hipEventRecord(ev, stream))

        e = _Ev()
        e.ev = ev
        return e

    def elapsed_ms(self, start, end) -> float:
        _check(self.hip.hipEventSynchronize(end.ev))
        return float(_check(self.hip.hipEventElapsedTime(start.ev, end.ev)))

    @contextlib.contextmanager
    def capture(self):
        hip = self.hip
        graph = _Graph(hip, self.stream)
        mode = hip.hipStreamCaptureMode.hipStreamCaptureModeGlobal
        _check(hip.hipStreamBeginCapture(self.stream, mode))
        try:
            yield graph
        finally:
            g = _check(hip.hipStreamEndCapture(self.stream))
            graph.exe = _check(hip.hipGraphInstantiate(g, None, None, 0))

    def info(self) -> dict[str, Any]:
        return {
            "runtime": "hip",
            "device": self.device_name,
            "target": self.target,
            "toolchain": self.toolchain,
            **self.stats.summary(),
        }
