"""`atlas run` on a native device samples on the device (engine.device_picker) when nothing
needs the logits on the host: the same text as the CPU Sampler's path, greedy and seeded, and
one 8-byte readback per token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from atlas_cli import backend
from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.backend.ops.native import sample as native_sample
from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.cli import app

pytestmark = pytest.mark.slow  # the emulator runs the kernels on the CPU

NVFP4 = Path(__file__).parent / "fixtures" / "qwen" / "qwen35-nvfp4"


def run_on(device: str, *flags: str) -> str:
    args = ["run", "--device", device, str(NVFP4), "hi", "-n", "8", "--draft", "0", *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def run(*flags: str) -> str:
    return run_on("emu", *flags)


@pytest.mark.parametrize("flags", [("--temperature", "0"), ("--temperature", "0.9", "--seed", "7")])
def test_device_sampling_writes_what_the_host_sampler_writes(emu_home, monkeypatch, flags):
    from atlas_cli.backend import engine

    used = []
    real = engine.device_picker
    monkeypatch.setattr(engine, "device_picker", lambda *a: used.append(1) or real(*a))
    on_device = run(*flags)
    assert used, "the device path was not taken"
    monkeypatch.setattr(native_sample.ChainSettings, "fits", lambda self: False)
    assert on_device.strip() and on_device == run(*flags)
    if flags[1] == "0":  # and greedy, what the numpy reference writes
        assert on_device == run_on("cpu-ref", "--temperature", "0")


def test_one_small_readback_per_token_on_the_emulator(emu_home):
    from atlas_cli.backend.ops.native.device import NativeOps
    from atlas_cli.backend.ops.native.runtime_count import CountingRuntime

    rt = CountingRuntime(runtime_emu.EmuRuntime())
    model = backend.load(NVFP4, device="emu", ops=NativeOps(rt), draft=0)
    gen = model.generate("hi", max_tokens=6, sampling=SamplingOverrides(temperature=0.7, seed=3))
    with rt.phase("prompt"):
        first = next(gen)
    with rt.phase("decode") as counts:
        rest = list(gen)
    tokens = [first.token] + [e.token for e in rest if e.token >= 0]
    n = len(tokens) - 1
    assert n >= 1 and counts.launches["sample_chain"] == n
    assert counts.d2h == n and counts.d2h_bytes == 8 * n and counts.syncs == 0
    assert np.all(np.array(tokens) >= 0)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=5)])
def test_a_grammar_on_the_device_writes_what_the_host_writes(emu_home, monkeypatch, sampling):
    """A grammar on a native device: its mask goes to the device (a rejected draw is drawn
    again there), the logits never come back; the same text as the host Sampler's path. (The
    fixture's 64-token vocabulary has no braces for JSON: a tuple of numbers instead.)"""
    from atlas_cli.backend.constraint import new_constraint
    from atlas_cli.backend.ops.native.device import NativeOps
    from atlas_cli.backend.ops.native.runtime_count import CountingRuntime

    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'

    def answer(model):
        grammar = new_constraint(model.tokenizer, lark)
        assert grammar is not None
        params = SamplingOverrides(**sampling).params()
        gen = model.engine.generate("hi", max_tokens=12, sampling=params, constraint=grammar)
        return "".join(e.text for e in gen), grammar.masks

    rt = CountingRuntime(runtime_emu.EmuRuntime())
    model = backend.load(NVFP4, device="emu", ops=NativeOps(rt), draft=0)
    with rt.phase("all") as counts:
        on_device, masks = answer(model)
    assert on_device.startswith("(") and masks > 0
    assert counts.launches["sample_chain"] >= 12
    assert counts.d2h_bytes <= 8 * counts.launches["sample_chain"]  # token ids only
    monkeypatch.setattr(native_sample.ChainSettings, "fits", lambda self: False)
    assert answer(model) == (on_device, masks)
