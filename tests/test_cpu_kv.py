"""The fast CPU path's KV cache: float16 by default (`--kv-type f16`, as llama.cpp's), float32
on request. Conversions bit-exact with numpy, attention on a float16 cache equal to numpy's on
the same rounded keys and values, the fused decoders within the default path's bounds, and the
stacked cache that maps its whole context at once (no growth copies) or grows where it cannot."""

from __future__ import annotations

import os

import numpy as np
import pytest
from numba import njit

from atlas_cli.backend.cache import GROW_STEP, LAZY_PAGES, StackedKVCache
from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.cpu import decode as cpu_decode
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu.ir import narrow_half, widen_half
from atlas_cli.backend.ops.cpu.kernels import kv_bits
from tests.test_cpu_fast import QWEN35_GGUF, rel_err, run_tokens, tiny_model
from tests.test_cpu_qwen35 import tiny_qwen35


@njit
def _widen(bits, out):
    widen_half(bits, 0, out, 0, bits.shape[0])


@njit
def _narrow(x, bits):
    narrow_half(x, 0, bits, 0, x.shape[0])


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(11)


def test_float16_conversions_are_numpys():
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every float16, 16 at a time
    got = np.empty(every.size, np.float32)
    _widen(every, got)
    want = every.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()
    rng = np.random.default_rng(0)
    edges = [0.0, -0.0, 6e-8, 3e-8, 65504.0, 65519.0, 65520.0, 1e9, -np.inf, 2.0**-24 * 1.5]
    x = np.concatenate([rng.standard_normal(1001) * 30, edges]).astype(np.float32)
    bits = np.empty(x.size, np.uint16)  # 1011: whole vectors and a tail
    _narrow(x, bits)
    with np.errstate(over="ignore"):
        assert np.array_equal(bits, x.astype(np.float16).view(np.uint16))  # nearest even


@pytest.mark.parametrize(("n_tok", "start"), [(1, 40), (19, 0), (7, 70)])
def test_attention_on_a_float16_cache_is_numpys(n_tok, start, rng):
    q = rng.standard_normal((n_tok, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, start + n_tok, 64)).astype(np.float16)
    v = rng.standard_normal((2, start + n_tok, 64)).astype(np.float16)
    got = cpu_fast.attention(q, k, v, start)
    want = numpy_ref.attention(q, k.astype(np.float32), v.astype(np.float32), start)
    assert rel_err(got, want) < 1e-5


def _close_and_same_greedy(got, want, bound):
    """The default path's rule: within `bound` of the reference, greedy tokens equal wherever
    the reference's top-2 margin exceeds 1e-2 of its largest logit."""
    assert rel_err(got, want) < bound
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-2 * np.abs(want).max()
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_fused_llama_decode_on_a_float16_cache(activations, rng, monkeypatch):
    monkeypatch.setenv("ATLAS_CPU_ACTIVATIONS", activations)
    fast, ref = tiny_model(rng, qk_norm=True, permuted=False, type_id=12, kv="f16")
    assert fast.new_cache(64).k.dtype == np.float16
    ids = rng.integers(0, 300, 14).tolist()
    want = run_tokens(ref, ids, decode_from=0)
    _close_and_same_greedy(run_tokens(fast, ids, decode_from=6), want, 3e-3)


def test_fused_qwen35_decode_on_a_float16_cache(rng):
    fast, ref = tiny_qwen35(rng, 12, kv="f16")
    cache = fast.new_cache(64)
    assert {kv.k.dtype for kv in cache.kv.values()} == {np.dtype(np.float16)}
    ids = rng.integers(0, 300, 14).tolist()
    want = run_tokens(ref, ids, decode_from=0)
    _close_and_same_greedy(run_tokens(fast, ids, decode_from=5), want, 3e-3)


@pytest.mark.parametrize("lazy", [True, False])
def test_stacked_cache_maps_its_context_or_grows(lazy, rng):
    cache = StackedKVCache(2, 2, 32, 1000, np.float16, lazy=lazy)
    assert cache.lazy is lazy and cache.capacity == (1000 if lazy else GROW_STEP)
    written = []
    for start, n in [(0, 200), (200, 150), (350, 3)]:  # past the first growth step
        cache.reserve(start + n)
        k = rng.standard_normal((n, 2, 32)).astype(np.float32)
        keys, _ = cache.update(0, start, k, k)
        cache.length = start + n
        written.append(k.astype(np.float16).transpose(1, 0, 2))
        assert keys.shape == (2, start + n, 32)
    assert np.array_equal(cache.layers[0].k[:, :353], np.concatenate(written, axis=1))
    per_position = 2 * 2 * 2 * 32 * 2  # K and V, 2 layers, 2 heads of 32, float16
    assert cache.nbytes == per_position * (353 if lazy else 512)
    saved = cache.export()  # float32 on disk whatever the cache holds
    assert saved["k0"].dtype == np.float32
    again = StackedKVCache(2, 2, 32, 1000, np.float16, lazy=lazy)
    again.load(saved)
    assert np.array_equal(again.layers[0].k[:, :353], cache.layers[0].k[:, :353])
    clone = cache.clone(300)
    assert clone.dtype == np.float16 and clone.length == 300
    assert np.array_equal(clone.layers[1].v[:, :300], cache.layers[1].v[:, :300])


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not LAZY_PAGES or not os.path.exists("/proc/self/status"), reason="Linux")
def test_a_mapped_cache_holds_only_the_positions_written():
    """SmolLM2's shape at 8K positions: 94 MB of keys and as much of values mapped. A few
    positions written keep a few pages per (layer, head) row resident, not the context:
    numpy's huge pages and `zeros_like`'s fill made all 189 MB resident for each conversation
    the prefix pool kept."""
    caches, before = [], resident_bytes()
    for _ in range(4):
        cache = StackedKVCache(30, 3, 64, 8192, np.float16)
        assert cache.lazy
        cache.reserve(24)
        for layer in range(30):
            k = np.ones((24, 3, 64), np.float32)
            cache.update(layer, 0, k, k)
        caches.append(cache)
    grown = resident_bytes() - before
    pages = 4 * 2 * 30 * 3 * 4096  # one page per row of K and of V in each cache
    assert grown < 2 * pages, f"{grown:,} bytes resident for 24 positions of 4 caches"
    assert all(c.nbytes == 2 * 30 * 3 * 64 * 2 * 24 for c in caches)


def test_the_kv_type_reaches_the_caches(smollm2_path):
    from atlas_cli.session import open_model

    default = open_model(str(smollm2_path), device="cpu").engine.model
    f32 = open_model(str(smollm2_path), device="cpu", kv_dtype="f32").engine.model
    assert default.new_cache(64).k.dtype == np.float16
    assert f32.new_cache(64).k.dtype == np.float32
    hybrid = open_model(str(QWEN35_GGUF / "model.gguf"), device="cpu", draft=0).engine.model
    assert {kv.k.dtype for kv in hybrid.new_cache(64).kv.values()} == {np.dtype(np.float16)}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("hd", "n_pos", "g"),
    [(64, 133, 3), (128, 70, 2), (128, 9, 1), (48, 40, 3), (80, 33, 9), (256, 17, 4), (64, 300, 7)],
)
@pytest.mark.parametrize("slab", ["rows", "strided"])
def test_decode_attention_of_one_group_is_numpys(dtype, hd, n_pos, g, slab, rng):
    """cpu_decode.attend_group: in place on a slab of whole rows (scores on dots16 per 16 keys,
    the tail on tile_dots; values on pv64_* / pv16_* in sets of 4, 2, 1 heads, 16 columns where
    hd % 64 != 0), and through widened tiles where the rows are strided or hd % 16 != 0."""
    q = rng.standard_normal(g * hd).astype(np.float32)
    width = hd if slab == "rows" else hd + 16  # the cache holds more than n_pos (and columns)
    k = rng.standard_normal((n_pos + 5, width)).astype(dtype)[:, :hd]
    v = rng.standard_normal((n_pos + 5, width)).astype(dtype)[:, :hd]
    scores, out = np.empty((g, n_pos + 5), np.float32), np.empty(g * hd, np.float32)
    scale = np.float32(1.0 / np.sqrt(hd))
    cpu_decode.attend_group(q, kv_bits(k), kv_bits(v), n_pos, scale, scores, out)
    keys, vals = (a[None, :n_pos].astype(np.float32) for a in (k, v))
    want = numpy_ref.attention(q.reshape(1, g, hd), keys, vals, n_pos - 1).reshape(-1)
    assert rel_err(out, want) < 1e-5
