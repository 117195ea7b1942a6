"""The fast CPU path (`--device cpu`) against the float32 numpy reference (`--device cpu-ref`).

Per op on random blocks of every supported GGUF type; the fused decode step on small random
Llama/Qwen3 models (with and without Q/K permutation, biases, q/k norms, cache growth); and the
real default model: logits within 1e-3 of the reference and the golden greedy answer. Decode
products here run on float32 activations (ATLAS_CPU_ACTIVATIONS) and a float32 KV cache
(--kv-type f32); test_cpu_int8.py and test_cpu_kv.py cover the defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend import cache as cache_module
from atlas_cli.backend.cache import GROW_STEP, StackedKVCache
from atlas_cli.backend.loaders import gguf, quant
from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import decode as cpu_decode
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu import kernels as cpu_kernels
from atlas_cli.backend.sample import SamplingOverrides

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2_france.json"
TYPES = sorted(cpu_kernels.BLOCKS)  # F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, ...


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(type_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes_per_row) uint8 of random GGUF blocks with finite, realistic scales."""
    elems, nbytes = cpu_kernels.BLOCKS[type_id]
    nb = cols // elems
    if type_id == 0:
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if type_id == 1:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if type_id == 30:
        bits = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    scales = rng.uniform(-0.02, 0.02, (rows, nb))
    if type_id in (2, 3, 6, 7, 8, 20):  # d first
        raw[:, :, 0:2] = _f16_bytes(scales)
    if type_id in (3, 7):  # Q4_1 and Q5_1 min
        raw[:, :, 2:4] = _f16_bytes(rng.uniform(-0.1, 0.1, (rows, nb)))
    if type_id in (12, 13):  # K-quants: d and dmin are non-negative
        raw[:, :, 0:2] = _f16_bytes(np.abs(scales) / 64)
        raw[:, :, 2:4] = _f16_bytes(rng.uniform(0, 0.001, (rows, nb)))
    if type_id == 10:  # Q2_K: d and dmin are last and non-negative
        raw[:, :, 80:82] = _f16_bytes(np.abs(scales) / 16)
        raw[:, :, 82:84] = _f16_bytes(rng.uniform(0, 0.001, (rows, nb)))
    if type_id == 11:  # Q3_K: d is last, the scales' codes are signed
        raw[:, :, 108:110] = _f16_bytes(scales / 32)
    if type_id == 23:  # IQ4_XS: the scales' codes are signed
        raw[:, :, 0:2] = _f16_bytes(scales / 32)
    if type_id == 14:  # Q6_K: d is last
        raw[:, :, 208:210] = _f16_bytes(scales / 64)
    return raw.reshape(rows, nb * nbytes)


def packed(type_id, blocks, perm=None) -> cpu_fast.PackedMatrix:
    rows = blocks.shape[0]
    cols = blocks.shape[1] // cpu_kernels.BLOCKS[type_id][1] * cpu_kernels.BLOCKS[type_id][0]
    qt = gguf.QuantizedTensor(type_id, (rows, cols), blocks, perm)
    out = cpu_fast.prepare_weight(qt)
    assert isinstance(out, cpu_fast.PackedMatrix)
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(7)


@pytest.fixture(autouse=True)
def float32_activations(monkeypatch):
    """These bounds are the float32 path's (activations and KV cache); the defaults, int8
    activations and a float16 cache, are held to their own in test_cpu_int8.py and
    test_cpu_kv.py."""
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", "float32")


@pytest.mark.parametrize("type_id", TYPES, ids=[quant.GGML_TYPES[t].name for t in TYPES])
def test_dequantize_is_bit_exact(type_id, rng):
    blocks = random_blocks(type_id, 8, 512, rng)
    got = packed(type_id, blocks).dequantize()
    want = quant.dequantize(blocks, type_id, (8, 512))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_id", TYPES, ids=[quant.GGML_TYPES[t].name for t in TYPES])
@pytest.mark.parametrize("n_tok", [1, 3, 9])  # on the blocks (decode) and tiled (prefill)
def test_linear_matches_reference(type_id, n_tok, rng):
    rows, cols = 40, 768  # rows not a multiple of the 16-row tiles
    blocks = random_blocks(type_id, rows, cols, rng)
    perm = rng.permutation(rows).astype(np.int64)
    w = packed(type_id, blocks, perm)
    dense = quant.dequantize(blocks, type_id, (rows, cols))[perm]
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    got = cpu_fast.linear(x, w, bias)
    want = numpy_ref.linear(x, dense, bias)
    assert got.shape == (n_tok, rows) and got.dtype == np.float32
    assert rel_err(got, want) < 1e-5
    # a (T, in) input with leading dims keeps them
    assert cpu_fast.linear(x[None], w).shape == (1, n_tok, rows)


def test_embedding_dequantizes_rows(rng):
    blocks = random_blocks(8, 50, 256, rng)
    table = packed(8, blocks)
    ids = np.array([3, 0, 49, 3])
    want = quant.dequantize(blocks, 8, (50, 256))[ids]
    np.testing.assert_array_equal(cpu_fast.embedding(table, ids), want)


@pytest.mark.parametrize("start", [0, 5])
def test_attention_matches_reference(start, rng):
    n_tok, nh, nkv, hd = 21, 6, 2, 32  # 21 queries: one full block of 16 and a partial one
    q = rng.standard_normal((n_tok, nh, hd)).astype(np.float32)
    k = rng.standard_normal((nkv, start + n_tok, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, start + n_tok, hd)).astype(np.float32)
    got = cpu_fast.attention(q, k, v, start)
    assert rel_err(got, numpy_ref.attention(q, k, v, start)) < 1e-5


def test_what_has_no_kernel_falls_back_to_float32(rng):
    dense = rng.standard_normal((4, 64)).astype(np.float32)
    assert cpu_fast.prepare_weight(dense) is not None
    assert isinstance(cpu_fast.prepare_weight(dense), np.ndarray)
    # F32 rows of 40 values are not whole 16-value kernel blocks: dequantized like the reference
    odd = gguf.QuantizedTensor(0, (4, 40), dense[:, :40].copy().view(np.uint8))
    got = cpu_fast.prepare_weight(odd)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, dense[:, :40])


# ---------------------------------------------------------------------------------------------
# The fused decode step on small random models


def tiny_model(rng, *, qk_norm=False, bias=False, permuted=True, type_id=3, kv="f32"):
    """The same random weights as (fast model, reference model). All matrices live in one
    uint8 buffer, as they do in a GGUF memory map."""
    from atlas_cli.backend.models.llama import LlamaModel, ModelArgs
    from atlas_cli.backend.models.qwen3 import Qwen3Model

    # 256-wide rows: whole K-quant super-blocks
    hidden, inter, hd, nq, nkv, vocab = 256, 256, 64, 4, 2, 300
    args = ModelArgs(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=nq,
        num_key_value_heads=nkv,
        vocab_size=vocab,
        head_dim=hd,
        rms_norm_eps=1e-5,
        max_position_embeddings=600,
        tie_word_embeddings=True,
        attention_bias=bias,
    )
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (nq * hd, hidden),
            p + "self_attn.k_proj.weight": (nkv * hd, hidden),
            p + "self_attn.v_proj.weight": (nkv * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, nq * hd),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    parts = {n: random_blocks(type_id, *s, rng) for n, s in shapes.items()}
    buf = np.concatenate([b.reshape(-1) for b in parts.values()])
    fast_w, ref_w = {}, {}
    offset = 0
    for name, b in parts.items():
        view = buf[offset : offset + b.size].reshape(b.shape)
        offset += b.size
        perm = None
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            perm = gguf.unpermute_index(b.shape[0], nq if "q_proj" in name else nkv)
        qt = gguf.QuantizedTensor(type_id, shapes[name], view, perm)
        fast_w[name] = cpu_fast.prepare_weight(qt)
        ref_w[name] = numpy_ref.prepare_weight(qt)
    for i in range(2):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            fast_w[p + n] = ref_w[p + n] = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
        if bias:
            for n, size in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                b = rng.standard_normal(size).astype(np.float32) * 0.1
                fast_w[p + f"self_attn.{n}.bias"] = ref_w[p + f"self_attn.{n}.bias"] = b
        if qk_norm:
            for n in ("q_norm.weight", "k_norm.weight"):
                wn = rng.uniform(0.5, 1.5, hd).astype(np.float32)
                fast_w[p + "self_attn." + n] = ref_w[p + "self_attn." + n] = wn
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    fast_w["model.norm.weight"] = ref_w["model.norm.weight"] = norm
    cls = Qwen3Model if qk_norm else LlamaModel
    fast = cls(args, fast_w, cpu_fast)
    if fast.fused is not None:
        fast.fused.use_kv_type(kv)  # --kv-type
    return fast, cls(args, ref_w, numpy_ref)


def run_tokens(model, ids, decode_from):
    """Logits for `ids`: a prefill of ids[:decode_from], then one decode step per token."""
    cache = model.new_cache(model.args.max_position_embeddings)
    out = []
    if decode_from:
        cache.reserve(decode_from)
        out.append(model.logits(model.forward(np.asarray(ids[:decode_from]), cache, 0)))
        cache.length = decode_from
    for pos in range(decode_from, len(ids)):
        cache.reserve(pos + 1)
        out.append(model.logits(model.forward(np.asarray([ids[pos]]), cache, pos)))
        cache.length = pos + 1
    return np.concatenate(out)


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(permuted=False, type_id=12),
        dict(bias=True, type_id=8),
        dict(qk_norm=True, permuted=False, type_id=14),
    ],
    ids=["llama-q4_1", "llama-q4_k", "bias-q8_0", "qwen3-q6_k"],
)
def test_fused_decode_matches_reference(variant, rng):
    fast, ref = tiny_model(rng, **variant)
    assert fast.fused is not None and ref.fused is None
    ids = rng.integers(0, 300, 12).tolist()
    want = run_tokens(ref, ids, decode_from=0)
    assert rel_err(run_tokens(fast, ids, decode_from=0), want) < 1e-4
    assert rel_err(run_tokens(fast, ids, decode_from=7), want) < 1e-4  # prefill, then fused


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_fused_decode_is_the_same_on_any_number_of_workers(workers, rng):
    """The step hands its rows and heads out through counters (cpu_ir_sync): workers beyond the
    threads run after the others and find the work done; who computed a row changes nothing."""
    fast, ref = tiny_model(rng, qk_norm=True, type_id=12)
    ids = rng.integers(0, 300, 10).tolist()
    fast.fused.workers = 1
    one = run_tokens(fast, ids, decode_from=3)
    fast.fused.workers = workers
    assert np.array_equal(run_tokens(fast, ids, decode_from=3), one)
    assert rel_err(one, run_tokens(ref, ids, decode_from=0)) < 1e-4


@pytest.mark.parametrize("lazy", [True, False])
def test_fused_decode_across_cache_growth(lazy, rng, monkeypatch):
    monkeypatch.setattr(cache_module, "LAZY_PAGES", lazy)
    fast, ref = tiny_model(rng)
    assert fast.new_cache(1000).lazy is lazy
    n = GROW_STEP + 6  # where a cache that grows doubles (a lazily mapped one never does)
    ids = rng.integers(0, 300, n).tolist()
    got = run_tokens(fast, ids, decode_from=GROW_STEP - 3)
    want = run_tokens(ref, ids, decode_from=GROW_STEP - 3)
    assert rel_err(got, want) < 1e-4


def test_float_weights_run_op_by_op(rng):
    from atlas_cli.backend.models.llama import LlamaModel

    _, ref = tiny_model(rng)
    model = LlamaModel(ref.args, dict(ref.w), cpu_fast)
    assert model.fused is None  # not GGUF blocks: the per-op path with numpy_ref's matmuls
    ids = rng.integers(0, 300, 5).tolist()
    assert rel_err(run_tokens(model, ids, 2), run_tokens(ref, ids, 2)) < 1e-5


# ---------------------------------------------------------------------------------------------
# The real default model


@pytest.fixture(scope="module")
def smollm2_fast(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu", kv_dtype="f32")


@pytest.mark.slow
def test_devices_pick_their_ops(smollm2_fast, smollm2):
    assert smollm2_fast.device == "cpu" and smollm2_fast.engine.model.ops is cpu_fast
    assert smollm2.engine.model.ops is numpy_ref
    lm_head = smollm2_fast.engine.model.w["lm_head.weight"]
    assert isinstance(lm_head, cpu_fast.PackedMatrix) and lm_head.type_id == 8  # Q8_0 blocks


@pytest.mark.slow
def test_default_model_logits_match_reference(smollm2_fast, smollm2):
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None
    prompt = golden["prompt_ids"] if golden else list(range(1000, 1037))
    ids = (prompt + list(range(2000, 2064)))[:64]
    want = smollm2.logits(ids)  # prefill on the reference
    assert rel_err(smollm2_fast.logits(ids), want) < 1e-3
    # cached decode (the fused step) for the last 8 positions
    engine = smollm2_fast.engine
    engine.reset()
    last, _ = engine.prefill(ids[:56])
    assert rel_err(last, want[55]) < 1e-3
    for pos in range(56, 64):
        assert rel_err(engine.step(ids[pos]), want[pos]) < 1e-3


@pytest.mark.slow
def test_default_model_greedy_golden(smollm2_fast):
    if not GOLDEN.exists():
        pytest.skip("golden reference not on this machine")
    golden = json.loads(GOLDEN.read_text())
    events = smollm2_fast.generate(
        golden["prompt_ids"], max_tokens=16, sampling=SamplingOverrides(temperature=0)
    )
    tokens = [e.token for e in events if e.token >= 0]
    stop = golden["greedy_ids_float32"][-1]  # <|im_end|> ends the turn and is not emitted
    assert tokens + [stop] == golden["greedy_ids_float32"]
    assert smollm2_fast.tokenizer.decode(tokens) == "The capital of France is Paris."


# ---------------------------------------------------------------------------------------------
# Loader and cache pieces the fast path relies on


def test_unpermute_index_matches_unpermute_rows(rng):
    rows = rng.integers(0, 256, (4 * 64, 20), dtype=np.uint8)  # 4 heads of 64 rows
    index = gguf.unpermute_index(rows.shape[0], 4)
    np.testing.assert_array_equal(rows[index], gguf.unpermute_rows(rows, 4))


@pytest.mark.slow
def test_lazy_unpermute_keeps_blocks_in_the_map(smollm2_path):
    from atlas_cli.store import paths

    gf = gguf.open_gguf(smollm2_path, cache_dir=paths.cache_dir())
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    lazy = gguf.load_weights(gf, config, keep_quantized=True, lazy_unpermute=True)
    copied = gguf.load_weights(gf, config, keep_quantized=True)
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    ):
        assert lazy[name].row_perm is not None and copied[name].row_perm is None
        assert np.shares_memory(lazy[name].blocks, gf._map)  # a view of the file, not a copy
        np.testing.assert_array_equal(lazy[name].dequantize(), copied[name].dequantize())
        w = cpu_fast.prepare_weight(lazy[name])
        np.testing.assert_array_equal(w.dequantize(), copied[name].dequantize())


def test_fit_counts_kept_blocks_at_their_size(rng):
    from atlas_cli import fit

    blocks = random_blocks(3, 8, 64, rng)  # Q4_1: 2 blocks of 20 bytes per row
    weights = {"a": gguf.QuantizedTensor(3, (8, 64), blocks), "b": np.zeros((8, 64), np.float32)}
    assert fit.weight_bytes(weights) == 8 * 40 + 8 * 64 * 4


def test_stacked_cache_grows_and_keeps_contents():
    cache = StackedKVCache(2, 3, 8, max_len=600, dtype=np.float32, lazy=False)
    assert cache.capacity == GROW_STEP and cache.k.shape == (2, 3, 256, 8)
    k = np.arange(5 * 3 * 8, dtype=np.float32).reshape(5, 3, 8)
    keys, _ = cache.update(1, 0, k, -k)
    cache.length = 5
    assert keys.shape == (3, 5, 8)
    cache.reserve(300)
    assert cache.capacity == 512 and cache.layers[1].k.base is cache.k
    np.testing.assert_array_equal(cache.k[1, :, :5], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.v[1, :, :5], -k.transpose(1, 0, 2))
    cache.reserve(600)
    assert cache.capacity == 600  # capped at the context
    with pytest.raises(ValueError):
        cache.reserve(601)
    assert cache.truncate(2) == 2


def test_kernels_still_run_after_releasing_compiler_pages(rng):
    cpu_decode.release_compiler_memory()
    blocks = random_blocks(3, 16, 64, rng)
    w = packed(3, blocks)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    want = x @ quant.dequantize(blocks, 3, (16, 64)).T
    assert rel_err(cpu_fast.linear(x, w), want) < 1e-5


# ---------------------------------------------------------------------------------------------
# Column-permuted blocks (qwen35's out_proj) and the one thread pool


@pytest.mark.parametrize("n_tok", [1, 8])
def test_column_permuted_blocks_match_their_dequantized_weight(n_tok, rng):
    """A QuantizedTensor with `col_perm` stays in its blocks; products gather the input."""
    rows, cols = 8, 256
    blocks = random_blocks(8, rows, cols, rng)  # Q8_0
    col_perm = rng.permutation(cols)
    qt = gguf.QuantizedTensor(8, (rows, cols), blocks, col_perm=col_perm)
    w = cpu_fast.prepare_weight(qt)
    assert isinstance(w, cpu_fast.PackedMatrix) and w.in_perm is not None
    dense = qt.dequantize()
    plain = gguf.QuantizedTensor(8, (rows, cols), blocks).dequantize()
    np.testing.assert_array_equal(dense, plain[:, col_perm])
    np.testing.assert_array_equal(w.dequantize(), dense)
    np.testing.assert_array_equal(cpu_fast.embedding(w, np.array([3, 0])), dense[[3, 0]])
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    assert rel_err(cpu_fast.linear(x, w), numpy_ref.linear(x, dense)) < 1e-5


QWEN35_GGUF = Path(__file__).parent / "fixtures" / "qwen" / "qwen35-gguf"


@pytest.mark.slow
def test_qwen35_out_proj_stays_quantized_and_matches_transformers():
    """The fixture has two value heads per key head, so out_proj's columns are in llama.cpp's
    tiled order: the fast path keeps its Q8_0 blocks (no float32 copy) and still matches."""
    from atlas_cli.session import open_model

    model = open_model(str(QWEN35_GGUF / "model.gguf"), device="cpu")
    w = model.engine.model.w["model.layers.0.linear_attn.out_proj.weight"]
    assert isinstance(w, cpu_fast.PackedMatrix) and w.in_perm is not None
    ref = np.load(QWEN35_GGUF / "reference.npz")
    t = len(ref["prompt"])
    assert rel_err(model.engine.logits(ref["prompt"]), ref["logits"][:t]) < 1e-3
    steps = np.stack([model.engine.step(int(tok)) for tok in ref["decode"]])
    assert rel_err(steps, ref["logits"][t:]) < 1e-3


QWEN2_GGUF = Path(__file__).parent / "fixtures" / "qwen" / "qwen2-gguf"


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_qwen2_biases_run_in_the_fused_step(activations, monkeypatch):
    """Qwen2 (q/k/v biases, llama.cpp's layout) on the fused step its declaration gets: the
    logits of transformers loading the same file, prefill and 32 cached steps."""
    from atlas_cli.backend.ops.cpu.fused import FusedDecoder
    from atlas_cli.session import open_model
    from tests.test_cpu_int8 import _greedy_agrees

    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", activations)
    kv = "f32" if activations == "float32" else None
    model = open_model(str(QWEN2_GGUF / "model.gguf"), device="cpu", kv_dtype=kv)
    net = model.engine.model
    assert isinstance(net.fused, FusedDecoder) and np.abs(net.fused.bias).max() > 0
    ref = np.load(QWEN2_GGUF / "reference.npz")
    t = len(ref["prompt"])
    prefill = model.engine.logits(ref["prompt"])
    steps = np.stack([model.engine.step(int(tok)) for tok in ref["decode"]])
    got = np.concatenate([prefill, steps])
    # int8 activations: as the qwen35 fixture (one int8 code is ~1e-3 of a 32-wide model's logits)
    assert rel_err(got, ref["logits"]) < (1e-4 if activations == "float32" else 3e-3)
    assert len(prefill) == t
    _greedy_agrees(got, ref["logits"])


def test_out_proj_in_hf_order_is_kept_quantized_everywhere():
    """One value head per key head (Qwen3.5-0.8B): the stored order is HF's, so every backend
    that keeps blocks gets them, with no column permutation."""
    raw = random_blocks(8, 4, 64, np.random.default_rng(1))
    info = gguf.TensorInfo("blk.0.ssm_out.weight", 8, (4, 64), 0, raw.nbytes)
    w = gguf._qwen35_out_proj(raw, info, (2, 1, 32), keep=True, lazy=False)
    assert isinstance(w, gguf.QuantizedTensor) and w.col_perm is None
    tiled = gguf._qwen35_out_proj(raw, info, (2, 2, 16), keep=True, lazy=False)
    assert isinstance(tiled, np.ndarray)  # a backend without column permutations: float32
    np.testing.assert_array_equal(
        gguf._qwen35_out_proj(raw, info, (2, 2, 16), keep=True, lazy=True).dequantize(), tiled
    )


BLAS_PROBE = """
import json, sys
from threadpoolctl import threadpool_info
from atlas_cli.cpu_threads import use_threads
use_threads(2)
from atlas_cli.backend.ops import numpy_ref
seen = []
def blas():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
def spy(name):
    real = getattr(numpy_ref, name)
    def wrapped(*a, **k):
        seen.append([name, blas()])
        return real(*a, **k)
    setattr(numpy_ref, name, wrapped)
spy("gated_delta_rule_chunked"); spy("linear")
from atlas_cli.session import open_model
m = open_model(sys.argv[1], device="cpu")
m.engine.prefill(list(range(3, 40)))
import numpy as np
from atlas_cli.backend.ops.cpu import fast as cpu_fast
cpu_fast.linear(np.ones((4, 8), np.float32), np.ones((8, 8), np.float32))  # a float32 matrix
import numba
print(json.dumps({"seen": seen, "outside": blas(), "numba": numba.get_num_threads()}))
"""


@pytest.mark.slow
def test_blas_runs_on_one_thread_inside_the_fast_path(tmp_path):
    """`-t 2` gives numba two threads and BLAS two; while the fast path runs a numpy op (a
    float32 matrix) BLAS is on one thread, and gets its two back. The Qwen3.5 prefill runs no
    numpy Gated DeltaNet (cpu_gdn.py has its own)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATLAS_HOME": str(tmp_path), "NUMBA_NUM_THREADS": "2"}
    env.pop("ATLAS_THREADS", None)
    cmd = [sys.executable, "-c", BLAS_PROBE, str(QWEN35_GGUF / "model.gguf")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["outside"] != [2]:
        pytest.skip(f"BLAS here cannot run 2 threads ({out['outside']})")
    assert out["numba"] == 2
    names = {name for name, _ in out["seen"]}
    assert "linear" in names and "gated_delta_rule_chunked" not in names, out
    assert all(counts == [1] for _, counts in out["seen"]), out
