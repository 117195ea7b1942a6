"""`--device emu`: the CPU emulator of the kernels as a device of its own, for `atlas run`,
`atlas bench` and `open_model` (slow; it gives the native code path anywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from atlas_cli import backend
from atlas_cli.backend.ops.native import device as native
from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.cli import app
from atlas_cli.errors import DeviceError

NVFP4 = Path(__file__).parent / "fixtures" / "qwen" / "qwen35-nvfp4"


def _run(device: str) -> str:
    args = ["run", "--device", device, str(NVFP4), "hi", "-n", "8", "--temperature", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_atlas_run_on_the_emulator_writes_what_the_reference_writes(emu_home):
    """The Qwen3.5 NVFP4 fixture (MTP speculation on) from the CLI: greedy text identical to
    the numpy reference's."""
    text = _run("emu")
    assert text.strip() and text == _run("cpu-ref")


@pytest.mark.slow
def test_atlas_bench_runs_on_the_emulator(emu_home):
    args = ["bench", "throughput", str(NVFP4), "-p", "8", "-n", "2", "-r", "1", "--device", "emu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "EMU" in result.output and "tg2" in result.output


def test_emu_is_a_device_everywhere_devices_are_listed():
    assert "emu" in backend.DEVICES and "emu" in backend.NATIVE_DEVICES
    from atlas_cli.commands.options import _complete_device

    assert "emu" in [c if isinstance(c, str) else c[0] for c in _complete_device("e")]
    if runtime_emu.available():
        assert "emu" in backend.installed_devices()


def test_emu_without_a_compiler_is_a_one_line_device_error(monkeypatch):
    monkeypatch.setattr(runtime_emu, "available", lambda: False)
    with pytest.raises(DeviceError, match="needs a C\\+\\+ compiler"):
        native.open_device("emu")
    assert "emu" not in backend.installed_devices()
