"""The numpy reference ops: float32 math, the oracle every other backend is tested against.

Shapes use T for tokens in this call, S for cached positions, H for hidden size, nh/nkv for
query/key-value heads and hd for the head dimension. Imports numpy only.
"""

from __future__ import annotations

import numpy as np

NAME = "cpu-ref"


def prepare_weight(w):
    """What `linear` takes: float32 (out, in). Quantized weights are dequantized once at load."""
    if hasattr(w, "dequantize"):
        w = w.dequantize()
    return np.ascontiguousarray(w, dtype=np.float32)


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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA attention of new queries against the whole cache.

    q (T, nh, hd) at positions start..start+T-1; k, v (nkv, S, hd) with S = start + T.
    Returns (T, nh, hd).
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
