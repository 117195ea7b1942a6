"""Kernel-vs-numpy checks shared by the GPU tests (tests/gpu, on CUDA or HIP) and the CPU
emulator tests (tests/test_native_emu.py, on any machine).

Each check takes a NativeOps, a numpy Generator and a size scale; it draws fresh random inputs
of several shapes (odd sizes included), runs the op with output poisoning on (every new device
buffer starts as NaN, so an element a kernel forgot to write cannot pass), and compares with the
numpy reference: exactly for dequantization and conversions, within what the precision allows
otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from atlas_cli.backend import formats
from atlas_cli.backend import sample as host_sample
from atlas_cli.backend.loaders import quant
from atlas_cli.backend.loaders.gguf import QuantizedTensor
from atlas_cli.backend.loaders.safetensors import NVFP4Tensor
from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import decoder as nd
from atlas_cli.backend.ops.native.array import bf16_bits_to_f32, f32_to_bf16_bits
from atlas_cli.backend.ops.native.gemm_check import GGUF_IDS, random_gguf_blocks

# -- reference helpers -------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7.0)) * sign
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3 = e4m3_table()


def e4m3_encode_ref(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 code: nearest value (ties to the even code), saturating at 448."""
    pos = E4M3[:127]  # codes 0..126, ascending, finite
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(pos, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= pos[126], 126, pick)
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


class NVFP4(NVFP4Tensor):
    """An NVFP4 weight as the safetensors loader holds it (packed, scale, global_scale), with
    its own reference dequantization."""

    def dequantize(self) -> np.ndarray:
        # modelopt NVFP4QTensor.dequantize order: E2M1 * (fp8 scale * global scale)
        out, half = self.packed.shape
        codes = np.stack([self.packed & 15, self.packed >> 4], -1).reshape(out, -1)
        vals = E2M1[codes].reshape(out, -1, 16)
        s = E4M3[self.scale] * np.float32(self.global_scale)
        return (vals * s[..., None]).reshape(out, half * 2)


class GGUFWeight(QuantizedTensor):
    """A loaders.gguf.QuantizedTensor: blocks (rows, bytes_per_row) of one ggml type."""

    def dequantize(self) -> np.ndarray:
        return quant.dequantize(self.blocks, self.type_id, self.shape)


def random_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator, reference=True):
    """A random weight of `fmt` and its exact float32 dequantization (None unless
    `reference`: benchmarks skip the numpy work)."""
    if fmt in ("f32", "bf16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        if fmt == "bf16":
            w = bf16_bits_to_f32(f32_to_bf16_bits(w))
        return w, w
    if fmt == "f16":
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float16)
        return GGUFWeight(1, (rows, cols), w.view(np.uint8).reshape(rows, -1)), w.astype(np.float32)
    if fmt == "nvfp4":
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scale = rng.integers(0x20, 0x60, (rows, cols // 16), dtype=np.uint8)  # finite, > 0
        w = NVFP4(packed, scale, np.float32(rng.uniform(1e-3, 1e-2)))
        return w, w.dequantize() if reference else None
    tid = GGUF_IDS[fmt]
    w = GGUFWeight(tid, (rows, cols), random_gguf_blocks(tid, rows, cols, rng))
    return w, w.dequantize() if reference else None


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), "non-finite output (an unwritten, poisoned element?)"
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))


FORMATS = (
    *("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "nvfp4"),
    *("q5_0", "q5_1", "q3_k", "iq4_nl", "iq4_xs"),
)
assert set(FORMATS) == {f.kernel for f in formats.FORMATS.values() if f.native}
PLAIN = ("f32", "f16", "bf16")  # one element per block: rows of any length (a partial unit)
ODD_COLS = (8, 16, 48)  # tiny models' hidden sizes, not multiples of 32
# Rows wider than one chunk of x (dgemv stages 8,192 columns at a time, decode.cu
# DG_CHUNK_TILES): two chunks, the second with a partial last iteration (2 x 32 units per
# iteration of a single-row body, 32 units of the SwiGLU pair's); gemv.cu's T == 1 loop runs
# its whole tiles and then a partial one. K-quants: whole 256-element blocks.
CHUNKED_COLS = {f: 9472 for f in FORMATS if formats.FORMATS[f].block_elems == formats.QK_K}
CHUNKED_DEFAULT_COLS = 8192 + 1024 + 96


def col_step(fmt: str) -> int:
    """What a row's length is a multiple of: 32 (a unit), a K-quant's 256."""
    return max(32, formats.FORMATS[fmt].block_elems)


def _cols(fmt: str, base: int) -> int:
    step = col_step(fmt)
    return max(step, base // step * step)


# -- the checks ----------------------------------------------------------------------------------


def check_dequant(ops, rng, scale: int = 1) -> None:
    for fmt in FORMATS:
        for rows, cols in ((3, _cols(fmt, 64)), (5 * scale + 2, _cols(fmt, 512 * scale))):
            w, want = random_weight(fmt, rows, cols, rng)
            got = ops.dequantize(ops.prepare_weight(w)).numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"dequant {fmt} {rows}x{cols}")
    for fmt in PLAIN:
        for cols in ODD_COLS:
            w, want = random_weight(fmt, 5, cols, rng)
            got = ops.dequantize(ops.prepare_weight(w)).numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"dequant {fmt} 5x{cols}")


def check_fp8(ops, rng, scale: int = 1) -> None:
    codes = np.arange(256, dtype=np.uint8)
    got = ops.fp8_decode(codes)
    np.testing.assert_array_equal(got, E4M3, err_msg="fp8 decode of all 256 codes")
    # encode: every representable value, the midpoints between them (ties), and random values
    pos = E4M3[:127].astype(np.float64)
    mids = (pos[:-1] + pos[1:]) / 2
    x = np.concatenate(
        [
            pos,
            -pos,
            mids,
            -mids,
            rng.standard_normal(1000 * scale) * 50,
            [500.0, -1000.0, 448.0, 464.0, 463.9],
        ]
    ).astype(np.float32)
    np.testing.assert_array_equal(ops.fp8_encode(x), e4m3_encode_ref(x), err_msg="fp8 encode")


def check_linear(ops, rng, scale: int = 1) -> None:
    for fmt in FORMATS:
        for t, rows, cols in (
            (1, 37, _cols(fmt, 96)),
            (1, 21, CHUNKED_COLS.get(fmt, CHUNKED_DEFAULT_COLS)),
            (3, 64, _cols(fmt, 256)),
            (5, 19, _cols(fmt, 4096 + 1280)),  # T <= 8: whole 4-tile passes, then the rest
            (8, 33, _cols(fmt, 64)),
            (9, 70, _cols(fmt, 96)),
            (67 * scale, 129, _cols(fmt, 256 * scale)),
        ):
            w, wf = random_weight(fmt, rows, cols, rng)
            x = rng.standard_normal((t, cols)).astype(np.float32)
            bias = rng.standard_normal(rows).astype(np.float32) if t == 3 else None
            got = ops.linear(
                ops.asarray(x), ops.prepare_weight(w), None if bias is None else ops.asarray(bias)
            )
            want = ref.linear(x, wf, bias)
            assert rel_err(got, want) < 2e-5, f"linear {fmt} T={t} {rows}x{cols}"
    for fmt in PLAIN:  # gemv (T <= 8) and gemm over a partial last unit
        for t, cols in ((1, 16), (1, 8192 + 48), (3, 48), (9, 8), (70, 48)):
            w, wf = random_weight(fmt, 37, cols, rng)
            x = rng.standard_normal((t, cols)).astype(np.float32)
            got = ops.linear(ops.asarray(x), ops.prepare_weight(w))
            assert rel_err(got, ref.linear(x, wf)) < 2e-5, f"linear {fmt} T={t} 37x{cols}"


def check_gemm_fast(ops, rng, scale: int = 1) -> None:
    """The fast prefill GEMM (bf16 operands, one MMA per product) whatever ops.prefill is:
    numpy on the bf16-rounded operands up to summation order, and within 2 * 2^-8 sum |x w|
    of the float32 product (tests/test_gemm_fast.py's bounds)."""
    from tests.test_gemm_fast import check_fast

    for fmt in FORMATS:
        for t, rows, cols in ((9, 70, _cols(fmt, 96)), (67 * scale, 129, _cols(fmt, 256 * scale))):
            w, wf = random_weight(fmt, rows, cols, rng)
            x = rng.standard_normal((t, cols)).astype(np.float32)
            got = ops.gemm(ops.asarray(x), ops.prepare_weight(w), None, None, kind="fast")
            check_fast(got.numpy(), fmt, wf, x, None, f"gemm_fast {fmt} T={t} {rows}x{cols}")


def check_verify_gemv(ops, rng, scale: int = 1) -> None:
    """The MTP verify GEMV on the tensor cores (gemv_mma.cu; the emulator runs its fragment
    code) for every format it takes: within 2^-20 sum |x w| of the float32 product
    (tests/test_gemv_mma.py's bound)."""
    from atlas_cli.backend.ops.native.weights import MMA_VERIFY_FORMATS
    from tests.test_gemv_mma import check_verify

    defines = {"ATLAS_EMU_MMA": 1} if ops.rt.name == "emu" else None
    for fmt in FORMATS:
        if fmt not in MMA_VERIFY_FORMATS:
            continue
        for t, rows, cols in ((2, 37, _cols(fmt, 1536)), (8, 33 * scale, _cols(fmt, 5120))):
            w, wf = random_weight(fmt, rows, cols, rng)
            x = rng.standard_normal((t, cols)).astype(np.float32)
            bias = rng.standard_normal(rows).astype(np.float32)
            got = ops.gemv_mma(ops.asarray(x), ops.prepare_weight(w), ops.asarray(bias), defines)
            check_verify(got.numpy(), x, wf, bias, f"gemv_mma {fmt} T={t} {rows}x{cols}")


def check_embedding(ops, rng, scale: int = 1) -> None:
    for fmt in FORMATS:
        w, wf = random_weight(fmt, 50, _cols(fmt, 96), rng)
        ids = rng.integers(0, 50, 7 * scale)
        got = ops.embedding(ops.prepare_weight(w), ids).numpy()
        np.testing.assert_array_equal(got, ref.embedding(wf, ids), err_msg=f"embedding {fmt}")
    for fmt in PLAIN:
        w, wf = random_weight(fmt, 50, 16, rng)
        ids = rng.integers(0, 50, 5)
        got = ops.embedding(ops.prepare_weight(w), ids).numpy()
        np.testing.assert_array_equal(got, ref.embedding(wf, ids), err_msg=f"embedding {fmt} 16")


def check_norms(ops, rng, scale: int = 1) -> None:
    for rows, n in ((1, 64), (5, 100), (3 * scale, 1000 * scale + 7)):
        x = rng.standard_normal((rows, n)).astype(np.float32)
        r = rng.standard_normal((rows, n)).astype(np.float32)
        w = rng.standard_normal(n).astype(np.float32)
        for unit in (False, True):
            got = ops.rms_norm(ops.asarray(x), ops.asarray(w), 1e-6, unit)
            assert rel_err(got, ref.rms_norm(x, w, 1e-6, unit)) < 1e-5
            s, normed = ops.add_rms_norm(ops.asarray(x), ops.asarray(r), ops.asarray(w), 1e-5, unit)
            np.testing.assert_allclose(s.numpy(), x + r, rtol=0, atol=0)
            assert rel_err(normed, ref.rms_norm(x + r, w, 1e-5, unit)) < 1e-5
        got = ops.l2norm(ops.asarray(x))
        want = x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
        assert rel_err(got, want) < 1e-5
        z = rng.standard_normal((rows, n)).astype(np.float32)
        got = ops.rms_norm_gated(ops.asarray(x), ops.asarray(z), ops.asarray(w), 1e-6)
        want = ref.rms_norm(x, w, 1e-6) * (z / (1 + np.exp(-z)))
        assert rel_err(got, want) < 1e-5


def check_rope(ops, rng, scale: int = 1) -> None:
    for t, n, hd, rot, start in ((1, 4, 64, 64, 100), (7, 3, 128, 32, 0), (5, 2, 256, 64, 33)):
        x = rng.standard_normal((t, n, hd)).astype(np.float32)
        pos = np.arange(start, start + t)
        inv = (1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
        got = ops.rope(ops.asarray(x), pos, inv)
        assert rel_err(got, ref.rope(x, pos, inv)) < 1e-5, f"rope {t}x{n}x{hd} rot {rot}"


def check_elementwise(ops, rng, scale: int = 1) -> None:
    for shape in ((1, 33), (7, 100 * scale + 1)):
        a = rng.standard_normal(shape).astype(np.float32) * 4
        b = rng.standard_normal(shape).astype(np.float32)
        da, db = ops.asarray(a), ops.asarray(b)
        assert rel_err(ops.silu_mul(da, db), ref.silu_mul(a, b)) < 1e-6
        assert rel_err(ops.sigmoid_mul(da, db), a / (1 + np.exp(-b))) < 1e-6
        assert rel_err(ops.sigmoid(da), 1 / (1 + np.exp(-a))) < 1e-6
        assert rel_err(ops.silu(da), a / (1 + np.exp(-a))) < 1e-6
        assert rel_err(ops.softplus(da), np.logaddexp(0, a)) < 1e-6
        row = rng.standard_normal(shape[-1]).astype(np.float32)
        assert rel_err(da + ops.asarray(row), a + row) == 0
        assert rel_err(row * da, row * a) == 0
        assert rel_err(da - 2.0, a - 2.0) == 0
        assert rel_err(da[:, 3:20], a[:, 3:20]) == 0
        assert rel_err(da[-1:], a[-1:]) == 0


def _attention_case(ops, rng, t, nh, nkv, hd, start, kv_dtype, nsplit):
    from atlas_cli.backend.ops.native.attention import KVCache

    s = start + t
    q = rng.standard_normal((t, nh, hd)).astype(np.float32)
    k_all = rng.standard_normal((s, nkv, hd)).astype(np.float32)
    v_all = rng.standard_normal((s, nkv, hd)).astype(np.float32)
    kscale = 0.05 if kv_dtype == "fp8" else 1.0
    cache = KVCache(ops, 1, nkv, hd, s + 5, kv_dtype, kscale, kscale)
    cache.reserve(s)
    if start:
        cache.update(0, 0, ops.asarray(k_all[:start]), ops.asarray(v_all[:start]))
    kv, vv = cache.update(0, start, ops.asarray(k_all[start:]), ops.asarray(v_all[start:]))
    got = ops.attention(ops.asarray(q), kv, vv, start, nsplit=nsplit)
    # the reference sees exactly what the cache holds
    if kv_dtype == "bf16":
        dec = lambda a: bf16_bits_to_f32(f32_to_bf16_bits(a))  # noqa: E731
    elif kv_dtype == "fp8":
        dec = lambda a: E4M3[e4m3_encode_ref(a / np.float32(kscale))] * np.float32(kscale)  # noqa: E731
    else:
        dec = lambda a: a  # noqa: E731
    kr = dec(k_all).transpose(1, 0, 2)  # (nkv, S, hd)
    vr = dec(v_all).transpose(1, 0, 2)
    want = ref.attention(q, np.ascontiguousarray(kr), np.ascontiguousarray(vr), start)
    err = rel_err(got, want)
    assert err < 2e-5, f"attention {kv_dtype} T={t} nh={nh} nkv={nkv} hd={hd} start={start}: {err}"


def check_attention(ops, rng, scale: int = 1) -> None:
    cases = [
        (1, 4, 2, 32, 0, "f32", None),  # the first token
        (1, 6, 2, 64, 77, "bf16", None),  # decode, GQA 3
        (1, 6, 2, 64, 77, "bf16", 3),  # decode, split-K + combine
        (1, 8, 1, 128, 40 * scale, "fp8", 2),
        (13, 4, 4, 32, 0, "f32", None),  # prefill, MHA
        (9, 6, 3, 64, 20, "bf16", None),  # prefill after a cached prefix
        (5, 24, 4, 256, 3, "bf16", 2),  # Qwen3.5 geometry: head_dim 256, GQA 6
        (37 * scale, 9, 3, 64, 0, "fp8", None),  # SmolLM2 geometry
        (9, 2, 2, 8, 0, "f32", None),  # tiny Qwen3.5 fixtures: heads under 32 dims
        (1, 2, 1, 16, 70, "bf16", 3),
        (4, 4, 2, 16, 5, "fp8", None),
    ]
    for case in cases:
        _attention_case(ops, rng, *case)


def check_conv_gdn(ops, rng, scale: int = 1) -> None:
    for t, c, k in ((1, 40, 4), (9 * scale, 300, 4), (5, 64, 2)):
        x = rng.standard_normal((t, c)).astype(np.float32)
        w = rng.standard_normal((c, k)).astype(np.float32)
        st = rng.standard_normal((k - 1, c)).astype(np.float32)
        want, want_st = _conv_ref(x, w, st)
        out, new_st = ops.causal_conv1d(ops.asarray(x), ops.asarray(w), ops.asarray(st))
        assert rel_err(out, want) < 1e-5 and rel_err(new_st, want_st) == 0
        out, _ = ops.causal_conv1d(ops.asarray(x), ops.asarray(w), ops.asarray(st), act=True)
        assert rel_err(out, want / (1 + np.exp(-want))) < 1e-5
    shapes = ((1, 2, 4, 16, 16), (7 * scale, 2, 4, 32, 64), (3, 1, 2, 128, 128), (5, 2, 4, 8, 8))
    for t, nk, nv, dk, dv in shapes:
        q = _l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
        kk = _l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
        v = rng.standard_normal((t, nv, dv)).astype(np.float32)
        g = -rng.uniform(0.01, 1.0, (t, nv)).astype(np.float32)
        beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
        st = rng.standard_normal((nv, dk, dv)).astype(np.float32) * 0.1
        want, want_st = _gdn_ref(q, kk, v, g, beta, st)
        dst = ops.asarray(st)
        out, new_st = ops.gated_delta_rule(*(ops.asarray(a) for a in (q, kk, v, g, beta)), dst)
        assert rel_err(out, want) < 1e-4 and rel_err(new_st, want_st) < 1e-4
        np.testing.assert_array_equal(dst.numpy(), st)  # the input state is left alone


def _l2(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def _conv_ref(x, w, state):
    """docs/formats.md 3.2, Gated DeltaNet step 2, without the SiLU (numpy_ref.causal_conv1d on
    the qwen branch)."""
    k = w.shape[1]
    full = np.concatenate([state, x])
    out = sum(w[:, j] * full[j : j + x.shape[0]] for j in range(k))
    return out.astype(np.float32), full[full.shape[0] - (k - 1) :]


def _gdn_ref(q, k, v, g, beta, state):
    """docs/formats.md 3.2, Gated DeltaNet step 7 (numpy_ref.gated_delta_rule on the qwen
    branch), in float64."""
    nv, dk = v.shape[1], q.shape[2]
    r = nv // q.shape[1]
    q = np.repeat(q, r, axis=1).astype(np.float64) * dk**-0.5
    k = np.repeat(k, r, axis=1).astype(np.float64)
    s = state.astype(np.float64).copy()
    out = np.empty(v.shape)
    for t in range(v.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hk,hkv->hv", k[t], s)
        d = (v[t] - kv) * beta[t][:, None]
        s += k[t][:, :, None] * d[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], s)
    return out, s


def check_sampling(ops, rng, scale: int = 1) -> None:
    for v in (1, 100, 3000 * scale):
        logits = rng.standard_normal(v).astype(np.float32) * 3
        assert ops.argmax(ops.asarray(logits)) == int(np.argmax(logits))
    logits = np.zeros(300, np.float32)
    logits[[7, 200]] = 5.0  # a tie: the lowest index wins, as np.argmax
    assert ops.argmax(ops.asarray(logits)) == 7
    for v, top_k, top_p, min_p, temp in (
        (1000, 40, 0.95, 0.05, 0.8),
        (5000, 256, 1.0, 0.0, 1.3),
        (64, 1, 0.9, 0.0, 0.7),
        (3000, 100, 0.5, 0.1, 0.5),
    ):
        logits = (rng.standard_normal(v) * 2).astype(np.float32)
        ids, probs = host_sample.filtered_distribution(logits, top_k, top_p, min_p, temp)
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]
        d = ops.asarray(logits)
        for u in rng.uniform(0, 1, 6 * scale):
            if np.min(np.abs(cdf - u)) < 1e-4:
                continue  # float32 vs float64 rounding could pick the neighbour
            want = int(ids[np.searchsorted(cdf, u, side="right")])
            assert ops.sample(d, top_k, top_p, min_p, temp, float(u)) == want


# -- the fused decode step's GEMV (decode.cu dgemv_<fmt>, not in ALL_CHECKS: per format) -------


def _check_rows(got, xp: np.ndarray, w: np.ndarray, want: np.ndarray, what: str) -> None:
    """`got` against `want` (float64), relative to the sum of |x' w| of each row (one wrong
    weight of ~9,000 would be ~1e-4 of it)."""
    scale = np.abs(w).astype(np.float64) @ np.abs(xp).astype(np.float64)
    err = np.max(np.abs(np.asarray(got, np.float64) - want) / scale)
    assert err < 1e-6, f"{what}: {err:.2e} of the sum of |x w|"


def check_fused_gemv(ops, rng, fmt: str, aligned: bool) -> None:
    """Every body of dgemv_<fmt> against numpy: RMSNorm over two stacked matrices (the normed
    x written out, the position counter advanced), x times the gate added into y, the SwiGLU
    pair, no prologue; 21- and 37-row outputs leave blocks part empty; x in two chunks. Not
    `aligned`: x 4 bytes off 16-byte alignment, the fallback body."""
    kept = ops.weight_dtype  # bf16 and f32 weights as themselves, whatever the ops keep
    ops.weight_dtype = fmt if fmt in ("bf16", "f32") else kept
    try:
        _check_fused_gemv(ops, rng, fmt, aligned)
    finally:
        ops.weight_dtype = kept


def _check_fused_gemv(ops, rng, fmt: str, aligned: bool) -> None:
    eps = 1e-6
    cols = CHUNKED_COLS.get(fmt, CHUNKED_DEFAULT_COLS)
    (w1, f1), (w2, f2), (w3, f3) = (random_weight(fmt, n, cols, rng) for n in (21, 16, 21))
    d1, d2, d3 = (ops.prepare_weight(w) for w in (w1, w2, w3))
    x = rng.standard_normal(cols).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    gate = rng.uniform(0, 1, cols).astype(np.float32)
    buf = ops.asarray(x if aligned else np.concatenate([np.zeros(1, np.float32), x]))
    dx = SimpleNamespace(ptr=buf.ptr + (0 if aligned else 4))
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt(np.mean(x64 * x64) + eps) * norm_w

    y, xn_out, bump = ops.zeros((37,)), ops.zeros((cols,)), ops.zeros((1,), np.int32)
    args = (nd.PRO_NORM, ops.asarray(norm_w), nd.EPI_STORE)
    launches = nd.dgemv(
        nd.stack(ops, [d1, d2]), 21, cols, dx, y, *args, xn=xn_out, bump=bump, eps=eps
    )
    nd.run(ops, launches)
    w12 = np.concatenate([f1, f2])
    _check_rows(y.numpy(), xn, w12, w12.astype(np.float64) @ xn, f"{fmt} norm")
    np.testing.assert_allclose(xn_out.numpy(), xn, rtol=1e-6)
    assert bump.numpy()[0] == 1

    y0 = rng.standard_normal(21).astype(np.float32)
    y, xg = ops.asarray(y0), x64 * gate
    args = (nd.PRO_MUL, ops.asarray(gate), nd.EPI_ADD)
    nd.run(ops, nd.dgemv(nd.stack(ops, [d1]), 21, cols, dx, y, *args))
    _check_rows(y.numpy() - y0, xg, f1, f1.astype(np.float64) @ xg, f"{fmt} gate + add")

    y = ops.zeros((21,))
    args = (nd.PRO_NORM, ops.asarray(norm_w), nd.EPI_SWIGLU)
    nd.run(ops, nd.dgemv(nd.stack(ops, [d1, d3]), 21, cols, dx, y, *args, eps=eps))
    g, u = f1.astype(np.float64) @ xn, f3.astype(np.float64) @ xn
    sig = 0.5 * (1 + np.tanh(g / 2))
    # the errors of g and u carry over with weights |u| sig' (sig' <= 1.1) and |silu(g)|
    bound = np.abs(f1) @ np.abs(xn) * np.abs(u) * 1.1 + np.abs(g * sig) * (np.abs(f3) @ np.abs(xn))
    err = np.abs(y.numpy() - g * sig * u) / bound
    assert err.max() < 1e-6, f"{fmt} swiglu: {err.max():.2e} of the bound"

    y = ops.zeros((16,))
    nd.run(ops, nd.dgemv(nd.stack(ops, [d2]), 16, cols, dx, y))
    _check_rows(y.numpy(), x64, f2, f2.astype(np.float64) @ x64, f"{fmt} plain")


ALL_CHECKS = {
    "dequant": check_dequant,
    "fp8": check_fp8,
    "linear": check_linear,
    "gemm_fast": check_gemm_fast,
    "verify_gemv": check_verify_gemv,
    "embedding": check_embedding,
    "norms": check_norms,
    "rope": check_rope,
    "elementwise": check_elementwise,
    "attention": check_attention,
    "conv_gdn": check_conv_gdn,
    "sampling": check_sampling,
}
