"""The fused step's Gated DeltaNet kernel (kernels/decode.cu gdn_decode) on the CPU emulator,
against numpy_ref: Qwen3.6-27B's head (128 x 128: four parts of 32 state rows per thread),
a key head dim that leaves the last part partly zero-padded, and the tiny models' 8 x 8."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.layers import GatedDeltaNet
from atlas_cli.backend.ops import numpy_ref as ref
from atlas_cli.backend.ops.native import decoder as nd
from tests.test_native_qwen35 import emu_ops


def mixer(nk: int, dk: int, nv: int, dv: int) -> GatedDeltaNet:
    return GatedDeltaNet(nk, dk, nv, dv, 4, ("q", "z", "b", "a"), "o", "c", "A", "dt", "n")


@pytest.mark.parametrize(
    "nk, dk, nv, dv",
    [(2, 128, 4, 128), (1, 72, 2, 96), (2, 8, 4, 8)],
    ids=["27B-head", "padded-part", "tiny"],
)
def test_gdn_decode_matches_numpy(nk, dk, nv, dv):
    rng = np.random.default_rng(dk + dv)
    m = mixer(nk, dk, nv, dv)
    assert nd._gdn_fits(m)
    f = np.float32
    conv = rng.standard_normal(m.conv_channels).astype(f)
    z = rng.standard_normal(nv * dv).astype(f)
    b, a = rng.standard_normal(nv).astype(f), rng.standard_normal(nv).astype(f)
    decay = -np.exp(rng.standard_normal(nv)).astype(f)  # A = -exp(A_log)
    dt_bias = rng.standard_normal(nv).astype(f)
    norm = rng.uniform(0.5, 1.5, dv).astype(f)
    state = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(f)
    eps = 1e-6

    q = ref.l2norm(conv[: nk * dk].reshape(1, nk, dk))
    k = ref.l2norm(conv[nk * dk : 2 * nk * dk].reshape(1, nk, dk))
    v = conv[2 * nk * dk :].reshape(1, nv, dv)
    g = (decay * ref.softplus(a + dt_bias))[None]
    o, want_state = ref.gated_delta_rule(q, k, v, g, ref.sigmoid(b)[None], state)
    want = ref.rms_norm_gated(o[0], z.reshape(nv, dv), norm, eps).reshape(-1)

    ops = emu_ops("f32")
    proj = ops.asarray(np.concatenate([conv, z, b, a]))
    dev_state, out = ops.asarray(state), ops.zeros((nv * dv,))
    weights = (ops.asarray(decay), ops.asarray(dt_bias), ops.asarray(norm))
    nd.run(ops, [nd.gdn_decode(proj, *weights, dev_state, out, m, eps)])
    np.testing.assert_allclose(dev_state.numpy(), want_state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)


def test_a_head_past_one_block_takes_the_op_by_op_path():
    assert not nd._gdn_fits(mixer(1, 256, 1, 128))  # 8 parts x 128 columns > 512 threads
