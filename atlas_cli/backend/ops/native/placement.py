"""Which loaded tensors an ops module takes as weight matrices (`ops.prepare_weight`) and which
as plain arrays: the one policy `backend.load` applies to every checkpoint."""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.formats import QuantizedWeight


def is_matrix(name: str, value) -> bool:
    """Weights that `linear` multiplies by: quantized ones, and float 2-D ones other than the
    embedding table (which is only indexed)."""
    if isinstance(value, QuantizedWeight):
        return True
    return name.endswith(".weight") and _is_2d(value) and "embed" not in name


def to_device(ops, name: str, w):
    """Every matrix the kernels multiply by (`is_matrix`: projections, `in_proj_*`, `out_proj`,
    `mtp.fc`, `lm_head`) and the embedding table, which the kernels index, as `prepare_weight`
    keeps them: in their stored format. Everything else (norms, biases, conv and decay
    vectors) as float32 device arrays."""
    if name == "rope_freqs":  # read on the host to build RoPE frequencies
        return w
    if name == "lm_head.weight" and ops.lm_head != "stored":
        w = _requantized_head(w, ops.lm_head)
    if is_matrix(name, w) or (name.endswith("embed_tokens.weight") and _is_2d(w)):
        return ops.prepare_weight(w)
    return ops.asarray(w)


def _is_2d(value) -> bool:
    return isinstance(value, np.ndarray) and value.ndim == 2


FLOAT_KERNELS = ("f32", "f16", "bf16")


def _requantized_head(w, fmt: str):
    """An untied float lm_head in `fmt` (ATLAS_LM_HEAD); a quantized one stays as it is (a
    GGUF's Q6_K head is already smaller than Q8_0)."""
    from atlas_cli.backend.requantize import requantize

    if isinstance(w, QuantizedWeight):
        if w.format.kernel not in FLOAT_KERNELS:
            return w
        w = w.dequantize()
    return requantize(np.asarray(w, np.float32), fmt) if _is_2d(np.asarray(w)) else w
