"""A KL divergence from a reference kept as its top k logits per row (and each row's
log-sum-exp) to full logits: over "each of the top k tokens, and all the rest as one", which is
at most the whole rows' KL (the log-sum inequality). Shared by tests/test_real_coder_reference.py
and scripts/make_coder_reference.py (which imports it from the checkout)."""

from __future__ import annotations

import numpy as np

DECIDED = 0.05  # top-two logit gap below which a top-1 disagreement is a near tie


def log_sum_exp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, in float64, without overflow."""
    x = x.astype(np.float64)
    peak = x.max(-1)
    return np.log(np.exp(x - peak[..., None]).sum(-1)) + peak


def judged(reference, engine: str, logits: np.ndarray) -> dict[str, float]:
    """KL (top 32 + the rest) from `engine`'s distribution to `logits`', top-1 agreement
    outside near ties, and the reference's mass outside its top 32."""
    top_ids = reference[f"{engine}_top_ids"][: len(logits)]
    top = reference[f"{engine}_top_logits"][: len(logits)].astype(np.float64)
    log_p = top - reference[f"{engine}_lse"][: len(logits), None]
    kls, tails, agree = [], [], []
    for rows in np.array_split(np.arange(len(logits)), max(1, len(logits) // 256)):
        x = logits[rows].astype(np.float64)
        log_q = np.take_along_axis(x, top_ids[rows], -1) - log_sum_exp(x)[:, None]
        p = np.exp(log_p[rows])
        p_rest = np.clip(1 - p.sum(-1), 1e-30, None)
        q_rest = np.clip(1 - np.exp(log_q).sum(-1), 1e-30, None)
        kls.append((p * (log_p[rows] - log_q)).sum(-1) + p_rest * np.log(p_rest / q_rest))
        tails.append(p_rest)
        decided = top[rows, 0] - top[rows, 1] >= DECIDED
        agree.append((x.argmax(-1) == top_ids[rows, 0])[decided])
    return {
        "kl": float(np.concatenate(kls).mean()),
        "top1": float(np.concatenate(agree).mean()),
        "tail": float(np.concatenate(tails).mean()),
    }
