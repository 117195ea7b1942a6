"""The fused step's decode attention (ops/native/decoder.decode_attention: attention.cu with
split_len 0) on the CPU emulator, against numpy_ref.attention: the splits follow the length
read on the device, so one launch list for a 4,096-key cache serves every position, from one
key (a single split) through lengths around the 64-key split minimum to the whole cache."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import decoder as nd
from atlas_cli.backend.ops.native.attention import KVCache
from tests.test_native_qwen35 import emu_ops

CAP = 4096


@pytest.mark.parametrize("nh, nkv, hd", [(8, 2, 128), (4, 4, 64)])
def test_splits_follow_the_length(nh, nkv, hd):
    ops = emu_ops("f32")
    rng = np.random.default_rng(nh + hd)
    k = rng.standard_normal((CAP, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((CAP, nkv, hd)).astype(np.float32)
    kv = KVCache(ops, 1, nkv, hd, CAP, dtype="f32")
    kv.reserve(CAP)
    kv.update(0, 0, ops.asarray(k), ops.asarray(v))
    q = ops.zeros((nh * hd,))
    pos, out = ops.zeros((1,), np.int32), ops.zeros((nh * hd,))
    parts = (ops.zeros((nd.MAX_SPLITS, nh * hd)), ops.zeros((nd.MAX_SPLITS, nh, 2)))
    kb, vb = kv.layers[0]
    launches = nd.decode_attention(q, kb, vb, kv, pos, out, parts, nh)
    assert launches[0].grid[2] == nd.MAX_SPLITS  # built once, for the capacity
    for p in (0, 63, 64, 65, 200, 2047, 2999, CAP - 1):
        qh = rng.standard_normal((1, nh, hd)).astype(np.float32)
        q[:] = qh.reshape(-1)
        pos[:] = np.array([p], np.int32)
        nd.run(ops, launches)
        kc, vc = k[: p + 1].transpose(1, 0, 2), v[: p + 1].transpose(1, 0, 2)
        want = ref.attention(qh, kc, vc, p).reshape(-1)
        np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-6, err_msg=f"pos {p}")
