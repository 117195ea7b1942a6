"""The fused decode step of the native backend (ops/native/decoder.py) on the CPU emulator of
the kernels: the same logits as the op-by-op native path and the numpy reference over a
prefill and 32 cached greedy decode steps, a few fat launches per layer with no upload inside
the step, and a replayed graph equal to direct launches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend import load
from atlas_cli.backend.layers import LayerKind
from atlas_cli.backend.ops.native import decoder as nd
from atlas_cli.backend.ops.native.decoder import DeviceDecoder
from atlas_cli.backend.ops.native.runtime import i32, ptr
from tests.test_native_done import source
from tests.test_native_qwen35 import STEPS, emu_ops, greedy, rel_err

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"


def fixture_path(name: str) -> Path:
    path = FIXTURES / name
    return path / "model.gguf" if (path / "model.gguf").exists() else path


def prompt_of(name: str) -> np.ndarray:
    return np.load(FIXTURES / name / "reference.npz")["prompt"]


def native(name, kv_dtype: str = "f32", fused: bool = True, graphs: bool = True):
    """An engine on the emulator of the fixture `name` (or a model at a Path)."""
    ops = emu_ops(kv_dtype)
    ops.fuse_graphs = graphs
    path = name if isinstance(name, Path) else fixture_path(name)
    engine = load(path, device="emu", ops=ops).engine
    assert isinstance(engine.model.fused, DeviceDecoder)
    if not fused:
        engine.model.fused = None  # the op-by-op native path
    return engine


@pytest.mark.slow  # the emulator: about 10-40 s each on two busy cores
@pytest.mark.parametrize("name", ["qwen35-f32", "qwen35-text-bf16", "qwen35-nvfp4", "qwen35-gguf"])
def test_fused_step_matches_the_op_path_and_numpy(name):
    check_fused_step(fixture_path(name), prompt_of(name), op_path_tol=1e-4)


def check_fused_step(path: Path, prompt, op_path_tol: float) -> None:
    """The fused step on the emulator against the op-by-op native path (within
    `op_path_tol`) and the numpy reference: a prefill and STEPS greedy steps, the same tokens."""
    want_prefill, want_tokens, want_steps = greedy(
        load(path, device="cpu-ref").engine, prompt, STEPS
    )
    _, op_tokens, op_steps = greedy(native(path, fused=False), prompt, STEPS)
    prefill, tokens, steps = greedy(native(path), prompt, STEPS)
    assert rel_err(prefill, want_prefill) < 1e-4
    op_err, ref_err = rel_err(steps, op_steps), rel_err(steps, want_steps)
    assert op_err < op_path_tol, f"fused vs op path {op_err:.2e}"
    assert ref_err < 1e-4, f"fused vs numpy {ref_err:.2e}"
    assert tokens == op_tokens == want_tokens


@pytest.mark.slow  # the emulator
@pytest.mark.parametrize(
    "name",
    [
        "qwen3-mha-f32",
        "qwen3-gqa4-f16",
        "qwen3-tied-bf16",
        "qwen3-gguf",
        "qwen2-bf16",
        "qwen2-gguf",
        "llama",
    ],
)
def test_attention_only_models_run_the_fused_step(name, llama_dir):
    """Qwen3, Qwen2 (q/k/v biases in the GEMV epilogue) and Llama get the fused device step
    from their declaration: the op path's logits within 1e-5 over a prefill and 32 greedy
    steps, the same tokens."""
    path, prompt = source(name, llama_dir)
    check_fused_step(path, prompt, op_path_tol=1e-5)


def count_calls(rt, monkeypatch) -> dict[str, int]:
    counts = {"launch": 0, "h2d": 0}
    for name in counts:
        real = getattr(rt, name)

        def counted(*args, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(rt, name, counted)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen35-nvfp4", "qwen35-gguf"])
def test_a_decoded_token_is_a_few_launches_and_no_upload(name, monkeypatch):
    """The next token sampled on the device (argmax into `decoder.token`) and decoded: at most
    7 launches per layer (attention's split-K combine the seventh) plus the embedding and the
    lm_head, and no host-to-device copy; an int token is the one upload."""
    engine = native(name, graphs=False)
    model, dec = engine.model, engine.model.fused
    logits = engine.logits(list(prompt_of(name)))  # prefill; the cache holds the prompt
    pos = len(prompt_of(name))
    ops = model.ops
    ops.rt.h2d(dec.token.buf, np.asarray([int(np.argmax(logits[-1]))], np.int32))
    engine.cache.reserve(pos + 3)
    dec.decode(None, engine.cache, pos - 1)  # uploads its position: a jump from prefill
    counts = count_calls(ops.rt, monkeypatch)
    for step in range(2):
        last = dec.logits_for(dec._last[0])
        ops._launch(
            "sample.cu",
            "argmax",
            (1,),
            (1024,),
            [ptr(last.ptr), i32(last.size)] + [ptr(dec.token.ptr)],
        )
        counts["launch"] -= 1  # the sampler's own launch
        before = dict(counts)
        dec.decode(None, engine.cache, pos + step)
        launches = counts["launch"] - before["launch"]
        n_layers = len(dec.decl.kinds)
        linear = dec.decl.kinds.count(LayerKind.GATED_DELTANET)
        assert counts["h2d"] == before["h2d"], "an upload inside the decode step"
        assert launches <= 7 * n_layers + 2
        splits = nd.device_kv(engine.cache).capacity // nd.ATTN_SPLIT_MIN > 1  # + attn_combine
        assert launches == 1 + 5 * linear + (6 + splits) * (n_layers - linear) + 1
    before = dict(counts)
    dec.decode(5, engine.cache, pos + 2)
    assert counts["h2d"] - before["h2d"] == 1


@pytest.mark.slow
def test_graph_replay_equals_direct_launches(monkeypatch):
    prompt = list(prompt_of("qwen35-nvfp4"))
    runs = []
    for graphs in (False, True):
        engine = native("qwen35-nvfp4", kv_dtype="bf16", graphs=graphs)
        _, tokens, steps = greedy(engine, np.asarray(prompt), 8)
        runs.append((tokens, steps))
        if graphs:  # a replayed step launches only the lm_head GEMV by itself
            pos = len(engine.cached_ids)
            engine.cache.reserve(pos + 2)
            engine.model.fused.decode(tokens[-1], engine.cache, pos)  # may recapture
            counts = count_calls(engine.model.ops.rt, monkeypatch)
            engine.model.fused.decode(tokens[-1], engine.cache, pos + 1)
            assert counts["launch"] == 1
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.slow
def test_fused_step_follows_truncate_and_a_growing_cache():
    """After a cut back into the prompt (the state restored from a checkpoint: new buffers)
    and across the KV regrowing past its first capacity, the fused step still matches the op
    path."""
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 60, 250)]
    results = []
    for fused in (True, False):
        engine = native("qwen35-f32", fused=fused)
        logits, _ = engine.prefill(prompt)
        out = []
        for _ in range(10):  # crosses 256 positions: the cache grows
            tok = int(np.argmax(logits))
            out.append(np.asarray(logits))
            logits = engine.step(tok)
        again, common = engine.prefill(prompt[:200] + [7, 8, 9])
        out.append(np.asarray(again))
        for tok in (4, 5, 6):
            out.append(np.asarray(engine.step(tok)))
        results.append(np.stack(out))
    assert rel_err(results[0], results[1]) < 1e-4
