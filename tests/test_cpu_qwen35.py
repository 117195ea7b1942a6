"""The fused Qwen3.5 decode step of the fast CPU path (cpu_qwen35.py) against the op path and
numpy_ref, on tiny random hybrid models in each K-quant and Q8_0 (grouped value heads, partial
RoPE, both layer kinds), and against transformers on the GGUF fixture; with both activation
modes; across cache growth; and with the cache's checkpoints, which the step's in-place state
updates must leave alone."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.cache import GROW_STEP
from atlas_cli.backend.loaders import gguf
from atlas_cli.backend.models.qwen3_5 import ModelArgs, Qwen3_5Model
from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu.fused import FusedLayers
from tests.test_cpu_fast import QWEN35_GGUF, random_blocks, rel_err, run_tokens
from tests.test_cpu_int8 import _greedy_agrees

VOCAB = 300


def tiny_qwen35(rng, type_id: int, kv: str = "f32") -> tuple[Qwen3_5Model, Qwen3_5Model]:
    """The same random weights as (fast model, reference model): hidden 256 (whole K-quant
    super-blocks), 2 key and 4 value heads of 64, gated attention with 2 query heads and
    1 KV head of 128 (RoPE on 32 of their dims), layers linear, full, linear, full."""
    args = ModelArgs(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        head_dim=128,
        max_position_embeddings=600,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=("linear_attention", "full_attention") * 2,
        tie_word_embeddings=True,
    )
    required, _ = Qwen3_5Model.weight_shapes(args, set())
    shapes = {name: options[-1] for name, options in required.items()}  # conv1d: GGUF's (C, K)
    matrices = {n: s for n, s in shapes.items() if len(s) == 2 and "conv1d" not in n}
    blocks = {n: random_blocks(type_id, *s, rng) for n, s in matrices.items()}
    buf = np.concatenate([b.reshape(-1) for b in blocks.values()])  # one buffer, as a GGUF map
    fast_w, ref_w = {}, {}
    offset = 0
    for name, b in blocks.items():
        view = buf[offset : offset + b.size].reshape(b.shape)
        offset += b.size
        qt = gguf.QuantizedTensor(type_id, matrices[name], view)
        fast_w[name] = cpu_fast.prepare_weight(qt)
        ref_w[name] = numpy_ref.prepare_weight(qt)
    for name, shape in shapes.items():
        if name in matrices:
            continue
        if name.endswith("A_log"):
            value = rng.uniform(-1, 1, shape)
        elif name.endswith("dt_bias") or name.endswith("conv1d.weight"):
            value = rng.standard_normal(shape) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            value = rng.uniform(0.5, 1.5, shape)  # a plain weight
        else:
            value = rng.uniform(-0.3, 0.3, shape)  # the (1 + w) norms
        fast_w[name] = ref_w[name] = value.astype(np.float32)
    fast = Qwen3_5Model(args, fast_w, cpu_fast)
    fast.fused.use_kv_type(kv)  # --kv-type
    return fast, Qwen3_5Model(args, ref_w, numpy_ref)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(35)


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("type_id", [8, 12, 13, 14], ids=["q8_0", "q4_k", "q5_k", "q6_k"])
def test_fused_step_matches_the_op_path_and_the_reference(type_id, activations, rng, monkeypatch):
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", activations)
    fast, ref = tiny_qwen35(rng, type_id)
    assert isinstance(fast.fused, FusedLayers) and ref.fused is None
    ids = rng.integers(0, VOCAB, 14).tolist()
    fused = run_tokens(fast, ids, decode_from=5)
    fast.fused, kept = None, fast.fused
    op_path = run_tokens(fast, ids, decode_from=5)
    fast.fused = kept
    want = run_tokens(ref, ids, decode_from=5)
    # the same products as the op path, float32 rounding apart; with int8 activations a
    # value that rounding moved can land on the neighbouring code (1/256 of its group's step)
    assert rel_err(fused, op_path) < (1e-5 if activations == "float32" else 5e-4)
    assert rel_err(fused, want) < (1e-4 if activations == "float32" else 1e-3)
    assert np.array_equal(fused[5:].argmax(-1), op_path[5:].argmax(-1))


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_fused_step_is_the_same_on_any_number_of_workers(workers, rng):
    """Each layer's loop hands its rows, conv channels and heads out through counters
    (cpu_ir_sync): who computed a row changes nothing, and workers beyond the threads find the
    work done."""
    fast, ref = tiny_qwen35(rng, 13)
    ids = rng.integers(0, VOCAB, 10).tolist()
    fast.fused.workers = 1
    one = run_tokens(fast, ids, decode_from=3)
    fast.fused.workers = workers
    assert np.array_equal(run_tokens(fast, ids, decode_from=3), one)
    assert rel_err(one, run_tokens(ref, ids, decode_from=3)) < 1e-3


def test_fused_step_runs_and_checkpoints_survive_it(rng):
    """A checkpoint taken before fused steps restores the state they started from: the step
    updates the live state in place, never a checkpoint's copy."""
    fast, _ = tiny_qwen35(rng, 12)
    calls = []
    decode = fast.fused.decode
    fast.fused.decode = lambda *a: calls.append(a[2]) or decode(*a)
    cache = fast.new_cache(64)
    prompt = rng.integers(0, VOCAB, 6)
    cache.reserve(6)
    fast.forward(prompt, cache, 0)
    cache.length = 6
    cache.checkpoint()
    steps = rng.integers(0, VOCAB, 4).tolist()

    def decode_steps():
        out = []
        for pos, token in enumerate(steps, start=cache.length):
            cache.reserve(pos + 1)
            out.append(fast.logits(fast.forward(np.asarray([token]), cache, pos)))
            cache.length = pos + 1
        return np.concatenate(out)

    first = decode_steps()
    assert calls == [6, 7, 8, 9]
    assert cache.truncate(6) == 6  # back to the checkpoint
    assert np.array_equal(decode_steps(), first)


def test_fused_step_across_cache_growth(rng, monkeypatch):
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "float32")
    fast, ref = tiny_qwen35(rng, 14)
    ids = rng.integers(0, VOCAB, GROW_STEP + 4).tolist()  # the KV slabs grow past 256
    got = run_tokens(fast, ids, decode_from=GROW_STEP - 3)
    want = run_tokens(ref, ids, decode_from=GROW_STEP - 3)
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_gguf_fixture_matches_transformers_through_the_fused_step(activations, monkeypatch):
    """llama.cpp's layout (tiled value heads, 2 per key head, column-permuted out_proj),
    untied lm_head, an MTP head the plain step does not use."""
    from atlas_cli.session import open_model

    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", activations)
    kv = "f32" if activations == "float32" else None  # int8: the defaults, a float16 cache
    path = str(QWEN35_GGUF / "model.gguf")
    model = open_model(path, device="cpu", draft=0, kv_dtype=kv).engine.model
    assert isinstance(model.fused, FusedLayers)
    assert model.w["model.layers.0.linear_attn.out_proj.weight"].in_perm is not None
    ref = np.load(QWEN35_GGUF / "reference.npz")
    ids = [*ref["prompt"].tolist(), *ref["decode"].tolist()]
    t = len(ref["prompt"])
    got = run_tokens(model, ids, decode_from=t)
    want = ref["logits"]
    if activations == "float32":
        assert rel_err(got, want) < 1e-4
        return
    # int8: on this 32-wide model one code (1/256 of a group's step) is worth ~1e-3 of the
    # logits, and which values land on a neighbouring code depends on float32 roundings that
    # change with how LLVM compiled the kernels (a fresh cache gave 1.26e-3, a warm one 8e-4)
    assert rel_err(got, want) < 3e-3
    _greedy_agrees(got, want)


def test_shapes_outside_the_kernels_run_op_by_op(rng):
    fast, _ = tiny_qwen35(rng, 12)
    w = dict(fast.w)
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    w[name] = numpy_ref.prepare_weight(w[name].dequantize())  # a float32 matrix: no blocks
    assert cpu_fast.fuse_decoder(Qwen3_5Model(fast.args, w, cpu_fast)) is None
