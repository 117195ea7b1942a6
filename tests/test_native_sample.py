"""Sampling on the device (sample.cu `sample_chain`, ops/native/sample.py) against the CPU
Sampler of backend/sample.py, on the CPU emulator of the kernels: the same seed gives the same
tokens for the same logits, penalties, top-k, top-p, min-p, temperature and greedy included."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.backend.ops.native.sample import NONFINITE, OUT_OF_UNIFORMS, ChainSettings
from atlas_cli.backend.sample import Sampler, SamplingParams


@pytest.fixture(scope="module")
def ops():
    if not runtime_emu.available():
        if os.environ.get("CI"):
            pytest.fail("g++ is missing in CI")
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    return NativeOps(runtime_emu.EmuRuntime(cache))


def settings(p: SamplingParams) -> ChainSettings:
    return ChainSettings(
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repeat_penalty,
        p.presence_penalty,
        p.repeat_last_n,
    )


def random_params(rng) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])),
        top_k=int(rng.choice([1, 5, 40, 256])),
        top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repeat_penalty=float(rng.choice([1.0, 1.1, 1.5, 0.7])),
        repeat_last_n=int(rng.choice([1, 8, 64])),
        presence_penalty=float(rng.choice([0.0, 0.0, 0.5, -1.0])),
        seed=int(rng.integers(0, 2**63)),
    )


@pytest.mark.parametrize("case", range(24))
def test_device_chain_draws_what_the_cpu_sampler_draws(ops, case):
    rng = np.random.default_rng(1000 + case)
    params = random_params(rng)
    vocab = int(rng.choice([7, 300, 5000]))
    steps = 6
    history = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 20)))]
    cpu = Sampler(params)
    device = ops.device_sampler(settings(params), history, Sampler(params).uniforms(steps))
    scale = float(rng.choice([0.5, 3.0, 12.0]))
    for _ in range(steps):
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        if case % 3 == 0:  # the penalised tokens near the top, where they change the draw
            logits[history[-4:]] += 2 * scale
        want = cpu(logits, history)
        got, flag = device(ops.asarray(logits))
        assert flag == 0 and got == want, (params, vocab)
        history.append(want)


def test_the_device_chain_flags_non_finite_logits_and_the_end_of_its_uniforms(ops):
    p = SamplingParams(temperature=0.8, seed=3)
    logits = np.zeros(100, np.float32)
    logits[42] = np.inf
    device = ops.device_sampler(settings(p), [1, 2], Sampler(p).uniforms(1))
    assert device(ops.asarray(logits))[1] == NONFINITE
    logits[42] = np.nan
    assert device(ops.asarray(logits))[1] == NONFINITE
    logits[42] = 0.0
    assert device(ops.asarray(logits))[1] == 0  # the one uniform
    assert device(ops.asarray(logits))[1] == OUT_OF_UNIFORMS


def test_an_inf_logit_the_penalty_would_clip_is_still_flagged(ops):
    """The check reads the raw logits, before a penalty clips an Inf to float32's range."""
    p = SamplingParams(temperature=0, repeat_penalty=1.5)
    logits = np.zeros(50, np.float32)
    logits[5] = np.inf
    assert ops.device_sampler(settings(p), [5], np.zeros(1))(ops.asarray(logits))[1] == NONFINITE


def test_the_token_stays_on_the_device(ops):
    p = SamplingParams(temperature=0)
    device = ops.device_sampler(settings(p), [0], np.zeros(1))
    logits = np.arange(10, dtype=np.float32)
    assert device(ops.asarray(logits)) == (9, 0)
    assert device.token.shape == (1,) and int(device.token.numpy()[0]) == 9


def test_the_engine_raises_the_host_paths_error_on_device_nan_logits(ops):
    """engine.device_picker turns the kernel's flag into check_finite's one-line error."""
    from atlas_cli.backend import engine
    from atlas_cli.errors import CorruptModelError

    logits = np.zeros(64, np.float32)
    logits[3] = np.nan
    with pytest.raises(CorruptModelError) as host:
        engine.check_finite(logits, 5)
    pick = engine.device_picker(ops, SamplingParams(temperature=0.5, seed=1), [1], 4)
    with pytest.raises(CorruptModelError) as device:
        pick(ops.asarray(logits), [1], 5)
    assert str(device.value) == str(host.value) and "\n" not in str(device.value)


class RandomGrammar:
    """A stand-in for backend.constraint.Constraint: per step, a random third of the
    vocabulary is allowed (the same for the host and the device run of one case)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng, self.masks = vocab, np.random.default_rng(seed), 0
        self.accept(None)

    def accept(self, token) -> None:
        self.allowed = self.rng.random(self.vocab) < 0.3
        self.allowed[self.rng.integers(0, self.vocab)] = True  # never empty

    def allows(self, token: int) -> bool:
        return bool(self.allowed[token])

    def mask(self) -> np.ndarray:
        self.masks += 1
        return self.allowed.copy()

    def masked(self, logits: np.ndarray) -> np.ndarray:
        self.masks += 1
        return np.where(self.allowed, logits, -np.inf).astype(logits.dtype)


@pytest.mark.parametrize("case", range(12))
def test_grammar_masks_on_the_device_draw_what_the_cpu_sampler_draws(ops, case):
    """A draw the grammar rejects is drawn again on the device from the grammar's bitmask (no
    logits to the host): the same tokens as the CPU Sampler on masked logits, penalties and
    the ring of recent tokens included."""
    from atlas_cli.backend.engine import device_picker, host_picker

    rng = np.random.default_rng(7000 + case)
    params = random_params(rng)
    vocab = int(rng.choice([37, 300, 5000]))  # 37: the mask's last word is partial
    steps = 8
    prompt = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 20)))]
    host_grammar, device_grammar = RandomGrammar(vocab, case), RandomGrammar(vocab, case)
    host = host_picker(params, host_grammar)
    device = device_picker(ops, params, prompt, steps, constraint=device_grammar)
    history = list(prompt)
    for step in range(steps):
        logits = (rng.standard_normal(vocab) * 4.0).astype(np.float32)
        want = host(logits.copy(), history, step)
        got = device(ops.asarray(logits), history, step)
        assert got == want and host_grammar.allows(want), (params, vocab, step)
        host_grammar.accept(want)
        device_grammar.accept(got)
        history.append(want)
    assert device_grammar.masks == host_grammar.masks > 0  # rejections happened, and alike
