"""How many prompt tokens one prefill forward takes: 256 on the CPU backends (their attention
materialises the (heads, T, S) scores), PREFILL_CHUNK of the native ops (1-2K: attention.cu
keeps no score matrix, and every forward streams each weight once) — checked on the emulator
against the numpy reference with a 260-token prompt."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend import engine as engine_mod
from atlas_cli.backend import load
from atlas_cli.backend.ops.native.device import NativeOps
from tests.test_native_qwen35 import FIXTURES, emu_ops, rel_err

FIXTURE = FIXTURES / "qwen3-tied-bf16"  # 2 layers, hidden 32: a long prompt is cheap


def _counting(engine) -> list[int]:
    """The token count of every forward the engine's model runs from now on."""
    sizes: list[int] = []
    forward = engine.model.forward

    def counted(ids, cache, start):
        sizes.append(len(ids))
        return forward(ids, cache, start)

    engine.model.forward = counted
    return sizes


def test_native_ops_name_a_chunk_of_1_to_2k_tokens():
    assert 1024 <= NativeOps.PREFILL_CHUNK <= 2048
    assert engine_mod.PREFILL_CHUNK == 256


@pytest.mark.slow  # the emulator: a 260-token prefill (~100 s on two busy cores)
def test_a_native_device_prefills_260_tokens_in_one_forward():
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 64, 260)]
    cpu = load(FIXTURE, device="cpu-ref", ctx_size=512).engine
    emu = load(FIXTURE, device="emu", ops=emu_ops("f32"), ctx_size=512).engine
    assert (cpu.prefill_chunk, emu.prefill_chunk) == (256, NativeOps.PREFILL_CHUNK)
    cpu_sizes, emu_sizes = _counting(cpu), _counting(emu)
    (want, _), (got, cached) = cpu.prefill(prompt), emu.prefill(prompt)
    # all but the last token in one forward; the last one again for its logits
    assert cached == 0 and (cpu_sizes, emu_sizes) == ([256, 3, 1], [259, 1])
    assert rel_err(got, want) < 1e-4, f"{rel_err(got, want):.2e}"


def test_logits_takes_the_ops_chunk(monkeypatch):
    """Engine.logits (the raw forward) steps by the same number: a 40-token prompt in chunks
    of 16 on the emulator gives the reference's logits."""
    monkeypatch.setattr(NativeOps, "PREFILL_CHUNK", 16)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 64, 40)]
    emu = load(FIXTURE, device="emu", ops=emu_ops("f32")).engine
    sizes = _counting(emu)
    got = emu.logits(prompt)
    assert sizes == [16, 16, 8]
    want = load(FIXTURE, device="cpu-ref").engine.logits(prompt)
    assert rel_err(got, want) < 1e-4, f"{rel_err(got, want):.2e}"
