"""The HIP runtime: hip-python for memory, streams, events, graphs and module launches; hiprtc
compiles the same kernel sources for the device's gfx target, cached on disk. The only module
that imports hip-python.

Written against hip-python's documented API (every call returns (error, value...)); it has not
run on an AMD GPU yet (no such machine was available to this project when it was written).
"""

from __future__ import annotations

import contextlib
from importlib import metadata
from typing import Any

import numpy as np

from atlas_cli.backend.ops.native import runtime as rt
from atlas_cli.backend.ops.native.runtime_probe import DeviceInfo, RuntimeProbe, install_command


class HipUnavailable(RuntimeError):
    """hip-python, libamdhip64 or a device is missing; the message says which."""


_NEEDS_HIP = f"the HIP backend needs hip-python: {install_command('rocm')}"


def _hip():
    try:
        from hip import hip, hiprtc
    except ImportError:
        raise HipUnavailable(_NEEDS_HIP) from None
    return hip, hiprtc


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    name = getattr(err, "name", str(err))
    if "Success" not in name and "SUCCESS" not in name:
        raise RuntimeError(f"HIP call failed: {name}")
    return rest[0] if len(rest) == 1 else rest


def probe() -> RuntimeProbe:
    """What hip-python and libamdhip64 say about this machine, compiling nothing. The one
    place atlas asks HIP about devices. Never raises: a failed call leaves its raw text in the
    record. Free memory is not asked for (it needs hipSetDevice, which would change the
    caller's current device)."""
    try:
        from hip import hip
    except ImportError:
        return RuntimeProbe("hip", "hip-python", reason=_NEEDS_HIP)
    except Exception as exc:  # a broken install raises from its own imports
        reason = f"hip-python fails to import ({exc})"
        return RuntimeProbe("hip", "hip-python", import_error=str(exc), reason=reason)
    found: dict[str, Any] = {"version": _package_version(), "installed": True}
    try:
        err, count = hip.hipGetDeviceCount()
    except Exception as exc:  # RuntimeError: failed to dlopen libamdhip64.so
        reason = f"HIP runtime not loadable ({exc})"
        return RuntimeProbe("hip", "hip-python", **found, error=str(exc), reason=reason)
    found["driver"] = _version(hip.hipDriverGetVersion)
    found["runtime_version"] = _version(hip.hipRuntimeGetVersion)
    if not _ok(err) or not count:
        error = None if _ok(err) else str(err)
        return RuntimeProbe("hip", "hip-python", **found, error=error, reason="no HIP device")
    devices, error = _devices(hip, count)
    reason = None if devices else "no HIP device"
    return RuntimeProbe("hip", "hip-python", **found, devices=devices, error=error, reason=reason)


def _ok(err) -> bool:
    return "Success" in getattr(err, "name", str(err))


def _package_version() -> str | None:
    try:
        return metadata.version("hip-python")
    except Exception:  # not installed as a distribution (a source checkout on the path)
        return None


def _version(call) -> str | None:
    """HIP encodes versions as major * 10_000_000 + minor * 100_000 + patch."""
    try:
        err, v = call()
    except Exception:
        return None
    return f"{v // 10_000_000}.{(v // 100_000) % 100}" if _ok(err) else None


def _text(v) -> str:
    return v.decode(errors="replace").strip("\0 ") if isinstance(v, bytes) else str(v or "")


def _devices(hip, count: int) -> tuple[tuple[DeviceInfo, ...], str | None]:
    """Each device's properties; a device whose properties fail is left out and its error
    kept."""
    devices, error = [], None
    for i in range(count):
        try:
            props = hip.hipDeviceProp_t()
            (err,) = hip.hipGetDeviceProperties(props, i)
        except Exception as exc:
            error = str(exc)
            continue
        if not _ok(err):
            error = str(err)
            continue
        arch = _text(props.gcnArchName).split(":")[0]  # "gfx1151:sramecc-:xnack-"
        devices.append(
            DeviceInfo(
                index=i,
                name=_text(props.name) or arch,
                arch=arch,
                total_bytes=int(props.totalGlobalMem),
                integrated=bool(getattr(props, "integrated", 0)),
            )
        )
    return tuple(devices), error


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
        if not info.available:
            raise HipUnavailable(info.reason)
        found = [d for d in info.devices if d.index == device]
        if not found:
            raise HipUnavailable(f"no HIP device {device} ({len(info.devices)} found)")
        self.hip, self.hiprtc = hip, hiprtc
        _check(hip.hipSetDevice(device))
        self.device_name = found[0].name
        self.target = found[0].arch  # e.g. gfx1151
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
