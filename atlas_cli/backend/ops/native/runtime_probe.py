"""What a GPU runtime's `probe()` returns: plain facts, no policy.

`runtime_cuda.probe()` and `runtime_hip.probe()` are the only places that ask cupy and
hip-python about the machine. They fill these records and never raise: where a call failed,
its raw error text is kept, so `hardware.py` can turn it into a fix for the user and
`native.device.probe` into a reason to skip the device.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from importlib import metadata

DISTRIBUTION = "atlas-cli"


def install_command(extra: str) -> str:
    """The `pip install` that adds what the `extra` ("cuda", "rocm") needs, read from this
    installation's own metadata: the packages themselves, which the package index has wherever
    atlas itself came from (a checkout, a wheel file)."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        requires = []
    marker = f'extra == "{extra}"'
    wanted = [r.split(";")[0].strip() for r in requires if marker in r.replace("'", '"')]
    if not wanted:
        return f"pip install '.[{extra}]' in atlas's source checkout"
    return "pip install " + " ".join(shlex.quote(w) for w in wanted)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str  # "NVIDIA H200", "AMD Radeon 8060S Graphics"
    arch: str  # "sm_90", "gfx1151"
    total_bytes: int
    free_bytes: int | None = None  # None where the runtime was not asked or could not say
    integrated: bool = False  # the runtime reports an integrated GPU (memory shared with CPU)


@dataclass(frozen=True)
class RuntimeProbe:
    runtime: str  # "cuda" | "hip"
    package: str  # "cupy", "hip-python"
    version: str | None = None  # the package's version; None where it is unknown
    installed: bool = False  # the package imports
    import_error: str | None = None  # raw text when it is installed but fails to import
    driver: str | None = None  # "13.0": what the driver supports
    runtime_version: str | None = None  # "13.0": the runtime library the package loaded
    compiler: str | None = None  # NVRTC's version ("12.8"); None where it is missing
    devices: tuple[DeviceInfo, ...] = ()
    error: str | None = None  # raw text of the call that failed (device count, dlopen, ...)
    reason: str | None = None  # why this runtime cannot start here; None: it can

    @property
    def available(self) -> bool:
        return self.reason is None
