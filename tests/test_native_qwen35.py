"""Qwen3.5 (Gated DeltaNet + gated attention, MTP head) end to end on the native backend, run
on the CPU emulator of the kernels: the tiny checkpoints of tests/fixtures/qwen loaded with
their weights on the device in their stored formats and the device hybrid cache, against the
numpy reference (and the transformers logits stored with each fixture), prefill then 32
greedy cached decode steps."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend import load
from atlas_cli.backend.ops.native import runtime_emu
from atlas_cli.backend.ops.native.array import DeviceArray, DeviceWeight
from atlas_cli.backend.ops.native.cache import HybridCache

EMU_MMA = {"ATLAS_EMU_MMA": 1}  # the sm_80 fragment code of the MMA kernels, emulated
FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
STEPS = 32


def emu_ops(kv_dtype: str):
    if not runtime_emu.available():
        if os.environ.get("CI"):
            pytest.fail("g++ is missing in CI")
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"  # keyed by source hash
    cache.mkdir(exist_ok=True)
    ops = NativeOps(runtime_emu.EmuRuntime(cache), kv_dtype=kv_dtype, prefill="exact")
    ops.poison = True  # an element a kernel forgets to write is NaN, not a stale value
    return ops


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def greedy_tokens(net, prompt: list[int], draft: int, n: int = 6):
    """n greedy tokens after `prompt` on an Engine with `draft` MTP drafts a round (0: none),
    and the engine (its speculator's stats)."""
    from atlas_cli.backend.engine import Engine

    engine = Engine(net, None, 64, draft=draft)
    logits, _ = engine.prefill(prompt)
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(np.asarray(logits))))
        logits = engine.step(tokens[-1])
    return tokens, engine


def greedy(engine, prompt, steps: int, feed=None) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Prefill logits (T, V), then `steps` greedy tokens and the logits each was chosen from;
    with `feed`, those tokens are decoded instead of the model's own picks."""
    prefill = np.asarray(engine.logits(prompt))
    logits, tokens, seen = prefill[-1], [], []
    for i in range(steps):
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = np.asarray(engine.step(tokens[-1] if feed is None else feed[i]))
    return prefill, tokens, np.stack(seen)


def near_ties(want_steps: np.ndarray, got_steps: np.ndarray) -> list[int]:
    """Steps whose reference top two are closer than twice the backends' logit difference
    there: a lower precision may pick either (tests/gpu/models.py's rule)."""
    top2 = np.sort(want_steps, axis=-1)[:, -2:]
    diff = np.abs(got_steps - want_steps).max(axis=-1)
    return [i for i in range(len(diff)) if top2[i, 1] - top2[i, 0] <= 2 * diff[i]]


@pytest.fixture(scope="module")
def reference():
    runs = {}

    def get(name: str):
        if name not in runs:
            model = load(FIXTURES / name, device="cpu-ref")
            runs[name] = greedy(
                model.engine, np.load(FIXTURES / name / "reference.npz")["prompt"], STEPS
            )
        return runs[name]

    return get


@pytest.mark.slow  # the emulator: about 20-90 s each on two busy cores
@pytest.mark.parametrize(
    "name, kv_dtype, tol",
    [
        ("qwen35-f32", "f32", 1e-4),  # f32 weights and KV: float32 rounding only
        ("qwen35-nvfp4", "f32", 1e-4),  # NVFP4 + bf16 weights, MTP speculation on
        ("qwen35-nvfp4", "bf16", 2e-2),
        ("qwen35-text-bf16", "bf16", 2e-2),  # 70-token prompt: prefill crosses a GDN chunk
    ],
)
def test_qwen35_fixture_matches_numpy(reference, name, kv_dtype, tol):
    ops = emu_ops(kv_dtype)
    model = load(FIXTURES / name, device="emu", ops=ops)
    assert isinstance(model.engine.cache, HybridCache)
    assert model.engine.cache.device_kv.dtype == kv_dtype
    prompt = np.load(FIXTURES / name / "reference.npz")["prompt"]
    want_prefill, want_tokens, want_steps = reference(name)
    # f32 KV decodes its own greedy tokens, which must be the reference's; bf16 KV is fed the
    # reference's tokens and must pick the same ones wherever the choice is not a near tie
    feed = None if kv_dtype == "f32" else want_tokens
    prefill, tokens, steps = greedy(model.engine, prompt, STEPS, feed)
    hf = np.load(FIXTURES / name / "reference.npz")["logits"][: len(prompt)]
    err = rel_err(prefill, want_prefill)
    assert err < tol, f"prefill vs numpy {err:.2e}"
    assert rel_err(prefill, hf) < tol, f"prefill vs transformers {rel_err(prefill, hf):.2e}"
    err = rel_err(steps, want_steps)
    assert err < tol, f"decode vs numpy {err:.2e}"
    ties = [] if kv_dtype == "f32" else near_ties(want_steps, steps)
    assert len(ties) <= 2, f"too many near ties to judge greedy decoding: steps {ties}"
    differ = [i for i in range(STEPS) if tokens[i] != want_tokens[i] and i not in ties]
    assert not differ, f"greedy tokens differ from the numpy reference at steps {differ}"


def test_every_matrix_stays_on_the_device_in_its_stored_format():
    """in_proj_*, out_proj, the attention and MLP projections, mtp.*, lm_head and the embedding
    table are DeviceWeights in the checkpoint's own format (NVFP4 codes, bf16, f32); vectors
    are float32 device arrays."""
    ops = emu_ops("bf16")
    w = load(FIXTURES / "qwen35-nvfp4", device="emu", ops=ops).engine.model.w
    fmts = {name: v.fmt for name, v in w.items() if isinstance(v, DeviceWeight)}
    p = "model.layers.2.linear_attn."  # layer 0's linear attention is left in bf16 (ignore list)
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
        assert fmts[p + part + ".weight"] == "nvfp4", part
        assert fmts[f"model.layers.0.linear_attn.{part}.weight"] == "bf16", part
    assert fmts["mtp.fc.weight"] == "bf16" and fmts["lm_head.weight"] == "bf16"
    assert fmts["mtp.layers.0.self_attn.q_proj.weight"] == "nvfp4"
    assert fmts["model.embed_tokens.weight"] == "bf16"
    # `A` = -exp(A_log) is made on the host by the model's sanitize (nv floats per layer)
    host = sorted(n for n, v in w.items() if isinstance(v, np.ndarray))
    assert host == [f"model.layers.{i}.linear_attn.A" for i in (0, 2)]
    others = [n for n, v in w.items() if not isinstance(v, DeviceWeight) and n not in host]
    assert others and all(isinstance(w[n], DeviceArray) and w[n].ndim <= 2 for n in others)
    assert all(w[n].ndim == 1 or n.endswith("conv1d.weight") for n in others)
    f32 = load(FIXTURES / "qwen35-f32", device="emu", ops=ops).engine.model.w
    assert f32["model.layers.1.linear_attn.in_proj_qkv.weight"].fmt == "f32"


@pytest.fixture(scope="module")
def nvfp4_net():
    """The Qwen3.5 NVFP4 fixture's network on the emulator, f32 KV (one load for the tests
    below, each of which builds engines, and so caches, of its own)."""
    return load(FIXTURES / "qwen35-nvfp4", device="emu", ops=emu_ops("f32")).engine.model


@pytest.mark.slow  # the emulator: about 20-90 s each on two busy cores
def test_prefix_reuse_on_the_device_cache_matches_a_cold_prefill(nvfp4_net):
    """A second prompt sharing the first one's prefix restarts from the device cache's
    checkpoint (GDN state restored on the device) and gives a cold prefill's logits."""
    from atlas_cli.backend.engine import Engine

    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(3, 64, 12)]
    # the conversation goes on: the first prompt, part of the reply, then new text
    second = first + [5, 7] + [int(t) for t in rng.integers(3, 64, 4)]
    warm = Engine(nvfp4_net, None, 64, draft=0)
    warm.prefill(first)
    for tok in (5, 7, 11):  # a reply after the first prompt, then the prompt changes
        warm.step(tok)
    warm.cache.checkpoint()  # as a finished turn leaves it; truncation must skip past it
    logits, reused = warm.prefill(second)
    # the checkpoint before the first prompt's last token: the GDN state cannot be cut later
    assert reused == len(first) - 1, f"reused {reused} of {len(second)}"
    cold_logits, cold_reused = Engine(nvfp4_net, None, 64, draft=0).prefill(second)
    assert cold_reused == 0
    assert rel_err(logits, np.asarray(cold_logits)) < 1e-5
    steps = [np.asarray(warm.step(t)) for t in (3, 9)]
    cold = Engine(nvfp4_net, None, 64, draft=0)
    cold.prefill(second)
    assert rel_err(np.stack(steps), np.stack([np.asarray(cold.step(t)) for t in (3, 9)])) < 1e-5


@pytest.mark.slow  # the emulator: about 20-90 s each on two busy cores
def test_speculative_greedy_is_identical_to_plain(nvfp4_net):
    """MTP drafting on the device, K = 1..4 (verify forwards with the GDN state trail,
    rollback of rejected drafts): the greedy tokens are those of plain decoding."""
    accepted = 0
    for k in (1, 2, 3, 4):
        rng = np.random.default_rng(k)
        for _ in range(2):
            prompt = [int(t) for t in rng.integers(3, 64, int(rng.integers(2, 10)))]
            (plain, _), (spec, engine) = (greedy_tokens(nvfp4_net, prompt, d, 10) for d in (0, k))
            assert spec == plain, f"K={k}, prompt {prompt}"
            assert engine.speculator.stats.drafted > 0
            accepted += engine.speculator.stats.accepted
    assert accepted > 0, "no draft was ever accepted: only the rollback path was exercised"


@pytest.mark.slow  # the emulator: about a minute on two busy cores
def test_speculative_greedy_with_the_verify_on_tensor_cores():
    """The verify forwards' NVFP4 projections on gemv_mma.cu's fragment code (2..8 tokens on
    the MMA, x in two f16 parts): the greedy tokens are still those of plain decoding."""
    from atlas_cli.backend.ops.native.gemm_check import GemmChoice

    ops = emu_ops("f32")
    ops._gemm_choices = {"verify": GemmChoice("verify", "tensor-core", "emulated", EMU_MMA)}
    net = load(FIXTURES / "qwen35-nvfp4", device="emu", ops=ops).engine.model
    accepted = 0
    for k in (2, 4):
        prompt = [int(t) for t in np.random.default_rng(k).integers(3, 64, 6)]
        (plain, _), (spec, engine) = (greedy_tokens(net, prompt, d, 10) for d in (0, k))
        assert spec == plain, f"K={k}"
        accepted += engine.speculator.stats.accepted
    assert accepted > 0
    assert any(key[:2] == ("gemv_mma.cu", "gemv_mma_nvfp4") for key in ops._fns), "not used"
