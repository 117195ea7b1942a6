"""The numpy reference ops: float32 math, the oracle every other backend is tested against.

Implements the ops contract (ops/contract.py). Shapes use T for tokens in this call, S for
cached positions, H for hidden size, nh/nkv for query/key-value heads and hd for the head
dimension. Imports numpy only.
"""

from __future__ import annotations

import numpy as np

NAME = "cpu-ref"
KEEP_QUANTIZED = False  # every weight as float32
PREFILL_CHUNK = None  # the engine's default
DEVICE_SAMPLING = False
KV_TYPES = ("f32",)


def prepare_weight(w):
    """What `linear` takes: float32 (out, in). Quantized weights are dequantized once at load
    (a loader's `QuantizedWeight` converts through the numpy array protocol)."""
    return np.ascontiguousarray(w, dtype=np.float32)


def fuse_decoder(model) -> None:
    """No fused decode step: models run op by op."""
    return None


def device_kv_cache(n_layers: int, n_kv_heads: int, head_dim: int, max_len: int) -> None:
    """Host arrays: the model's cache is `cache.KVCache`."""
    return None


def device_cache(layout, max_len: int) -> None:
    """Host arrays: the model's cache is `cache.host_cache(layout, max_len)`."""
    return None


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table (V, H), ids (T,) -> (T, H) float32."""
    return np.asarray(table[ids], dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, unit_offset: bool = False):
    """x (T, H) or (T, n, H): x / rms(x) * w, or * (1 + w) for Qwen3.5/Gemma-style norms."""
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    w = weight + 1.0 if unit_offset else weight
    return (x * scale * w).astype(np.float32, copy=False)


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x (T, in) @ w (out, in)^T -> (T, out)."""
    y = x @ w.T
    if bias is not None:
        y += bias
    return y


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, elementwise (T, I)."""
    return gate / (1.0 + np.exp(-gate)) * up


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Neox-style (rotate_half) RoPE on the first 2*len(inv_freq) dims of x (T, n, hd)."""
    rot = 2 * inv_freq.shape[0]
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # (T, rot/2)
    cos = np.cos(angles)[:, None, :]  # (T, 1, rot/2)
    sin = np.sin(angles)[:, None, :]
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    out = x.copy()
    out[..., : rot // 2] = x1 * cos - x2 * sin
    out[..., rot // 2 : rot] = x2 * cos + x1 * sin
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, nsplit=None):
    """Causal GQA attention of new queries against the whole cache.

    q (T, nh, hd) at positions start..start+T-1; k, v (nkv, S, hd) with S = start + T.
    Returns (T, nh, hd). `nsplit` (how a kernel splits the keys) changes nothing here.
    """
    t, nh, hd = q.shape
    nkv, s, _ = k.shape
    group = nh // nkv
    qg = q.reshape(t, nkv, group, hd).transpose(1, 2, 0, 3)  # (nkv, group, T, hd)
    scores = (qg @ k[:, None].swapaxes(-1, -2)) * (1.0 / np.sqrt(hd))  # (nkv, group, T, S)
    if t > 1:
        # query i sees keys 0..start+i
        mask = np.arange(s)[None, :] > (start + np.arange(t))[:, None]  # (T, S)
        scores = np.where(mask, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v[:, None]  # (nkv, group, T, hd)
    return out.transpose(2, 0, 1, 3).reshape(t, nh, hd).astype(np.float32, copy=False)


def argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


# -- Qwen3.5 / Qwen3-Next: gated attention and Gated DeltaNet -----------------------------------
# Shapes: T tokens, C conv channels, K conv kernel width, nk/nv key/value heads, dk/dv their
# head dims. Recurrent states are float32 (nv, dk, dv), as transformers and FLA keep them.


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), elementwise, any shape."""
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise, any shape."""
    return (x / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), elementwise, without overflow."""
    return np.logaddexp(np.float32(0.0), x).astype(np.float32, copy=False)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x (..., d) / sqrt(sum(x^2) + eps) over the last axis (FLA's and transformers' `l2norm`)."""
    inv = 1.0 / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv).astype(np.float32, copy=False)


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float):
    """Qwen3.5's `RMSNormGated`: rms_norm(x) * w * silu(gate), normalising over the last axis.

    x, gate (..., d); weight (d,) (a plain weight, not 1 + w). Returns float32 (..., d).
    """
    return rms_norm(x, weight, eps) * silu(gate)


def causal_conv1d(
    x: np.ndarray, weight: np.ndarray, state: np.ndarray, all_states=False, act=False
):
    """Depthwise causal conv over time, no bias; with `act`, SiLU of the result.

    x (T, C) new inputs; weight (C, K) with weight[:, K-1] multiplying the current token;
    state (K-1, C) the inputs before x (zeros at the start of a sequence).
    Returns (out (T, C) float32, new_state (K-1, C): the last K-1 inputs including x), or with
    `all_states` the state after every token, (T, K-1, C), in place of new_state.
    """
    t = x.shape[0]
    k = weight.shape[1]
    full = np.concatenate([state, x.astype(np.float32, copy=False)], axis=0)  # (K-1+T, C)
    out = np.zeros((t, x.shape[1]), np.float32)
    for j in range(k):  # tap j sees the input j-(K-1) steps back
        out += weight[:, j] * full[j : j + t]
    if act:
        out = silu(out)
    if all_states:
        windows = np.lib.stride_tricks.sliding_window_view(full, k - 1, axis=0)  # (T+1, C, K-1)
        return out, np.ascontiguousarray(windows[1:].transpose(0, 2, 1))
    return out, np.ascontiguousarray(full[full.shape[0] - (k - 1) :])


def _expand_heads(q: np.ndarray, k: np.ndarray, nv: int):
    """Repeat key heads so value head h uses key head h // (nv // nk) (repeat_interleave)."""
    r = nv // q.shape[1]
    if r > 1:
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    return q, k


def gated_delta_rule(q, k, v, g, beta, state, scale: float | None = None, all_states=False):
    """The gated delta rule, one token at a time (transformers' `torch_recurrent_gated_delta_rule`).

    q, k (T, nk, dk), already L2-normalised; v (T, nv, dv); g (T, nv) log-decay (<= 0);
    beta (T, nv); state (nv, dk, dv). q is scaled by `scale` (default dk^-0.5). Per token:
    S *= exp(g); d = (v - k.S) * beta; S += k (x) d; o = q.S.
    Returns (out (T, nv, dv) float32, new_state (nv, dk, dv) float32), or with `all_states`
    the state after every token, (T, nv, dk, dv), in place of new_state (to roll back drafts).
    """
    nv = v.shape[1]
    q, k = _expand_heads(q, k, nv)  # (T, nv, dk)
    q = q * np.float32(scale if scale is not None else q.shape[-1] ** -0.5)
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, np.float32)
    states = np.empty((v.shape[0], *s.shape), np.float32) if all_states else None
    decay = np.exp(g.astype(np.float32))
    for t in range(v.shape[0]):
        s *= decay[t][:, None, None]
        kv = np.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - kv) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], s)
        if states is not None:
            states[t] = s
    return out, (states if states is not None else s)


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale: float | None = None, chunk=64):
    """The same result as `gated_delta_rule`, computed `chunk` tokens at a time with the UT
    transform (transformers' `torch_chunk_gated_delta_rule`): within a chunk the delta-rule
    updates become triangular solves and matmuls; the state is carried between chunks.

    Same shapes and return value as `gated_delta_rule`. The last chunk may be shorter.
    """
    nv = v.shape[1]
    q, k = _expand_heads(q, k, nv)
    q = q * np.float32(scale if scale is not None else q.shape[-1] ** -0.5)
    # (nv, T, d) so that each head is a batch of matmuls
    q, k, v = (np.ascontiguousarray(x.transpose(1, 0, 2), np.float32) for x in (q, k, v))
    g, beta = (np.ascontiguousarray(x.T, np.float32) for x in (g, beta))  # (nv, T)
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, np.float32)  # (nv, T, dv)
    for c0 in range(0, v.shape[1], chunk):
        sl = slice(c0, min(c0 + chunk, v.shape[1]))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        n = qc.shape[1]
        cum = np.cumsum(g[:, sl], axis=1)  # (nv, n) log-decay from the chunk start
        lower = np.tril(np.ones((n, n), bool))
        pair = np.where(lower, np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], 0)), 0)
        k_beta = kc * bc[:, :, None]
        # (I + A) X = B with A the strictly lower part of (k_beta k^T) * decay: forward substitution
        a = np.tril((k_beta @ kc.swapaxes(1, 2)) * pair, -1)  # (nv, n, n)
        rhs = np.concatenate([vc * bc[:, :, None], k_beta * np.exp(cum)[:, :, None]], axis=2)
        sol = np.empty_like(rhs)
        for i in range(n):
            sol[:, i] = rhs[:, i] - np.einsum("hj,hjd->hd", a[:, i, :i], sol[:, :i])
        u, w = sol[:, :, : vc.shape[2]], sol[:, :, vc.shape[2] :]
        v_new = u - w @ s  # (nv, n, dv): what the old state does not already predict
        attn = (qc @ kc.swapaxes(1, 2)) * pair  # (nv, n, n), causal incl. the diagonal
        out[:, sl] = (qc * np.exp(cum)[:, :, None]) @ s + attn @ v_new
        last = cum[:, -1:]  # (nv, 1)
        s = (
            s * np.exp(last)[:, :, None]
            + (kc * np.exp(last - cum)[:, :, None]).swapaxes(1, 2) @ v_new
        )
    return out.transpose(1, 0, 2), s
