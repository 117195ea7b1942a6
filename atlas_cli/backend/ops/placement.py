"""Which loaded tensors an ops module takes as weight matrices (`ops.prepare_weight`) and which
as plain arrays: the one policy `backend.load_model` applies to every checkpoint."""

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
    """Matrices the kernels read in their stored format (linear layers, the embedding table);
    everything else (norms, biases, conv and decay vectors) as float32 device arrays."""
    if name == "rope_freqs":  # read on the host to build RoPE frequencies
        return w
    linear = name.endswith(("proj.weight", "embed_tokens.weight")) or name == "lm_head.weight"
    if linear and (isinstance(w, QuantizedWeight) or _is_2d(w)):
        return ops.prepare_weight(w)
    return ops.asarray(w)


def _is_2d(value) -> bool:
    return isinstance(value, np.ndarray) and value.ndim == 2
