"""NativeOps on the CPU emulator of the kernels, with the compiled modules cached across test
runs (keyed by the expanded source, so an edited kernel compiles again)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from atlas_cli.backend.ops.native import runtime_emu


def emu_native_ops(**kwargs):
    """NativeOps(EmuRuntime(the shared cache), **kwargs), every new output NaN (`poison`: an
    element a kernel forgets to write fails the check); a skip without g++."""
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    ops = NativeOps(runtime_emu.EmuRuntime(cache), **kwargs)
    ops.poison = True
    return ops
