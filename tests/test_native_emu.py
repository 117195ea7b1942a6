"""The native launchers and every kernel's logic, run on the CPU emulator of the CUDA execution
model (backend/ops/native/runtime_emu.py) against the numpy reference: the same checks tests/gpu
runs on a GPU (tests/gpu/checks.py), at smaller sizes, on any machine with g++."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.native import runtime_emu
from tests.gpu import checks
from tests.gpu import models as model_checks


@pytest.fixture(scope="module")
def emu_ops():
    if not runtime_emu.available():
        if os.environ.get("CI"):
            pytest.fail("g++ is missing in CI")
        pytest.skip("g++ not installed")
    from atlas_cli.backend.ops.native.device import NativeOps

    # compiled modules are keyed by source hash, so a shared temp dir is never stale
    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    ops = NativeOps(runtime_emu.EmuRuntime(cache), weight_dtype="f32", prefill="exact")
    ops.poison = True
    return ops


@pytest.mark.parametrize("name", list(checks.ALL_CHECKS))
def test_kernel_matches_reference(emu_ops, name):
    checks.ALL_CHECKS[name](emu_ops, np.random.default_rng(abs(hash(name)) % 2**32))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_5"])
def test_tiny_model_logits_and_greedy_match_numpy(emu_ops, model_type):
    model_checks.check_model(emu_ops, model_type, np.random.default_rng(7), kv_dtype="f32")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_tiny_model_bf16_kv_cache(emu_ops, model_type):
    model_checks.check_model(emu_ops, model_type, np.random.default_rng(8), kv_dtype="bf16")


def test_conv_all_states_and_fused_silu_match_reference(emu_ops):
    """causal_conv1d with the contract's all_states and act: the states exactly, the output
    within float32 rounding."""
    rng = np.random.default_rng(21)
    for t, c, k in ((1, 40, 4), (6, 300, 4), (3, 64, 2), (4, 32, 1)):
        x = rng.standard_normal((t, c)).astype(np.float32)
        w = rng.standard_normal((c, k)).astype(np.float32)
        st = rng.standard_normal((k - 1, c)).astype(np.float32)
        for act in (False, True):
            want, want_states = numpy_ref.causal_conv1d(x, w, st, all_states=True, act=act)
            args = (emu_ops.asarray(x), emu_ops.asarray(w), emu_ops.asarray(st))
            got, states = emu_ops.causal_conv1d(*args, all_states=True, act=act)
            assert states.shape == (t, k - 1, c)
            np.testing.assert_array_equal(states.numpy(), want_states)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_gdn_all_states_match_reference(emu_ops):
    """gated_delta_rule with all_states: every intermediate state as numpy_ref's, the last one
    exactly the state a plain call returns, the input state untouched."""
    rng = np.random.default_rng(22)
    t, nk, nv, dk, dv = 5, 2, 4, 32, 64
    q = checks._l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
    k = checks._l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
    v = rng.standard_normal((t, nv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (t, nv)).astype(np.float32)
    beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
    st = rng.standard_normal((nv, dk, dv)).astype(np.float32) * 0.1
    want, want_states = numpy_ref.gated_delta_rule(q, k, v, g, beta, st, all_states=True)
    dev = [emu_ops.asarray(a) for a in (q, k, v, g, beta)]
    dst = emu_ops.asarray(st)
    got, states = emu_ops.gated_delta_rule(*dev, dst, all_states=True)
    assert states.shape == (t, nv, dk, dv)
    assert checks.rel_err(got, want) < 1e-4 and checks.rel_err(states, want_states) < 1e-4
    plain_out, plain_state = emu_ops.gated_delta_rule(*dev, dst)
    np.testing.assert_array_equal(states.numpy()[-1], plain_state.numpy())
    np.testing.assert_array_equal(got.numpy(), plain_out.numpy())
    np.testing.assert_array_equal(dst.numpy(), st)


def test_native_ops_hooks(emu_ops):
    from atlas_cli.backend.layers import CacheLayout, LayerKind
    from atlas_cli.backend.ops.native.array import DeviceArray
    from atlas_cli.backend.ops.native.attention import KVCache
    from atlas_cli.backend.ops.native.cache import HybridCache

    assert emu_ops.NAME == "emu" and emu_ops.fuse_decoder(object()) is None
    cache = emu_ops.device_kv_cache(2, 1, 32, 16)
    assert isinstance(cache, KVCache) and cache.truncate(5) == 0 and not cache.recording
    kinds = (LayerKind.GATED_DELTANET, LayerKind.ATTENTION)
    hybrid = emu_ops.device_cache(CacheLayout(kinds, 1, 32, (3, 48), (2, 8, 8)), 600)
    assert isinstance(hybrid, HybridCache) and hybrid.capacity == 256
    assert isinstance(hybrid.linear[0].recurrent, DeviceArray) and list(hybrid.slot) == [1]


def test_graph_capture_replays_launches(emu_ops):
    x = emu_ops.asarray(np.arange(64, dtype=np.float32))
    y = emu_ops.zeros((64,))
    with emu_ops.rt.capture() as graph:
        emu_ops._launch("elementwise.cu", "scalar_op", (1,), (256,), [*_args(x, y), *_tail()])
    np.testing.assert_array_equal(y.numpy(), 0)  # captured, not run
    graph.replay()
    np.testing.assert_array_equal(y.numpy(), np.arange(64) + 1)


def _args(x, y):
    from atlas_cli.backend.ops.native.runtime import f32, ptr

    return [ptr(x.ptr), f32(1.0), ptr(y.ptr)]


def _tail():
    from atlas_cli.backend.ops.native.runtime import i32, i64

    return [i64(64), i32(0), i32(0)]


def test_compile_cache_is_hit_the_second_time(tmp_path):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    first = runtime_emu.EmuRuntime(tmp_path)
    first.compile("rope.cu")
    assert first.info()["kernels"]["rope.cu"]["cache_hit"] is False
    second = runtime_emu.EmuRuntime(tmp_path)
    second.compile("rope.cu")
    info = second.info()
    assert info["kernels"]["rope.cu"]["cache_hit"] is True and info["cache_hits"] == 1


def test_divergent_barrier_is_reported_not_hung(tmp_path):
    """A barrier that can never complete (thread 0 waits at __syncthreads while the rest of its
    warp waits in a shuffle) is an error from the emulator, not a hang. (Threads that have
    exited drop out of barriers, as on current GPUs.)"""
    from atlas_cli.backend.ops.native import runtime as rt

    kdir = tmp_path / "k"
    kdir.mkdir()
    real = rt.kernels_dir()
    (kdir / "emu").mkdir()
    for f in ("atlas_common.cuh",):
        (kdir / f).write_text((real / f).read_text())
    for f in ("atlas_emu.h", "atlas_emu.cpp"):
        (kdir / "emu" / f).write_text((real / "emu" / f).read_text())
    (kdir / "bad.cu").write_text(
        '#include "atlas_common.cuh"\n'
        'extern "C" __global__ void bad(float* x) {\n'
        "    if (threadIdx.x == 0) __syncthreads();\n"
        "    else x[threadIdx.x] = warp_sum(1.0f);\n"
        "}\n"
    )
    runtime = runtime_emu.EmuRuntime(tmp_path)
    orig = rt.kernels_dir
    rt.kernels_dir = lambda: kdir
    try:
        fn = runtime.compile("bad.cu").function("bad")
    finally:
        rt.kernels_dir = orig
    buf = runtime.alloc(256)
    with pytest.raises(RuntimeError, match="divergent"):
        runtime.launch(fn, (1,), (64,), [rt.ptr(buf.ptr)])


def test_atlas_imports_without_gpu_packages():
    """Importing atlas (CLI, backend, native launchers) must not need cupy or hip-python."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('cupy', 'hip'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import atlas_cli.cli, atlas_cli.backend, atlas_cli.backend.ops.native.device\n"
        "from atlas_cli.session import open_model\n"
        "from atlas_cli.errors import DeviceError\n"
        "for dev, pkg in (('cuda', 'cupy-cuda13x'), ('hip', 'pip install hip-python')):\n"
        "    try:\n"
        "        open_model('x', device=dev)\n"
        "    except DeviceError as e:\n"
        "        assert pkg in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no DeviceError')\n"
        "print('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("fmt", sorted(checks.GGUF_IDS))
def test_dequant_and_embedding_are_bit_exact_with_gguf(emu_ops, fmt):
    """Every native GGUF block format in its device layout (formats.split_blocks) through
    dequant_<fmt> and embedding_<fmt>, against gguf-py's own dequantizer: blocks gguf quantizes
    from normal values where it can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else random bytes with
    finite f16 scales (checks.random_weight), which reach every code and bit pattern."""
    import gguf as gguf_package

    from atlas_cli.backend.loaders.gguf import QuantizedTensor

    rng = np.random.default_rng(sorted(checks.GGUF_IDS).index(fmt))
    rows, cols = 9, 4 * checks.col_step(fmt)
    qtype = gguf_package.GGMLQuantizationType(checks.GGUF_IDS[fmt])
    try:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = gguf_package.quants.quantize(values, qtype)
    except NotImplementedError:
        blocks = checks.random_weight(fmt, rows, cols, rng, reference=False)[0].blocks
    want = gguf_package.quants.dequantize(blocks, qtype)
    w = emu_ops.prepare_weight(QuantizedTensor(int(qtype), (rows, cols), blocks))
    np.testing.assert_array_equal(emu_ops.dequantize(w).numpy(), want)
    ids = np.array([4, 0, 8, 4])
    np.testing.assert_array_equal(emu_ops.embedding(w, ids).numpy(), want[ids])


def test_real_gguf_weights_on_device_layout(emu_ops, smollm2_path):
    """The default model's own Q4_1 and Q8_0 blocks, laid out as the native loader lays them
    out (load_model's `_to_device`): kernels dequantize, embed and multiply them exactly as the
    numpy reference does."""
    from atlas_cli.backend.loaders import gguf
    from atlas_cli.backend.ops.native.placement import to_device as _to_device
    from atlas_cli.store import paths

    gf = gguf.open_gguf(smollm2_path, cache_dir=paths.cache_dir())
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    weights = gguf.load_weights(gf, config, keep_quantized=True)
    rng = np.random.default_rng(3)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        w = weights[name]
        dw = _to_device(emu_ops, name, w)
        want = w.dequantize()
        rows = min(dw.rows, 64)  # a slice of rows keeps the emulator quick
        part = type(w)(w.type_id, (rows, w.shape[1]), w.blocks[:rows])
        dpart = emu_ops.prepare_weight(part)
        np.testing.assert_array_equal(emu_ops.dequantize(dpart).numpy(), want[:rows])
        x = rng.standard_normal((2, w.shape[1])).astype(np.float32)
        got = emu_ops.linear(emu_ops.asarray(x), dpart).numpy()
        np.testing.assert_allclose(got, x @ want[:rows].T, rtol=2e-5, atol=2e-5)
    table = weights["model.embed_tokens.weight"]  # Q8_0, also the tied lm_head
    dt = _to_device(emu_ops, "model.embed_tokens.weight", table)
    ids = np.array([1, 504, 49151])
    got = emu_ops.embedding(dt, ids).numpy()
    np.testing.assert_array_equal(got, table.dequantize()[ids])
