"""First-use check of the tensor-core prefill attention on a real device.

The MMA fragments of attention_mma.cuh (inline mma.sync / WMMA builtins) are only exercised on
hardware; the emulator runs the same kernel with the MMA emulated. So before a device's first
prefill of a given KV type and head dim, attn_prefill_* runs once on random data next to the
portable build of the same source (-DATLAS_PORTABLE: the emulated MMA) and the two must agree.
On a mismatch the launcher turns the tensor-core prefill off (the row kernel runs every T) and
the reason is kept in `ops.prefill_check_failures`. The verdict is cached beside the compiled
kernels, keyed by the source, the target and the compiler, so it runs once per build.
"""

from __future__ import annotations

import copy
import json

import numpy as np

from atlas_cli.backend.ops.native import runtime as rt

TOLERANCE = 1e-4  # relative; a wrong fragment layout is off by O(1), rounding by ~1e-6
CASE = (77, 4, 2, 19)  # T, nh, nkv, start: two 64-row blocks, GQA 2, a cached prefix


def _portable(ops):
    """These ops with every attention.cu kernel taken from its ATLAS_PORTABLE build."""
    other = copy.copy(ops)
    other._fns = {}
    module = ops.rt.compile("attention.cu", {"ATLAS_PORTABLE": 1})

    def launch(file, name, grid, block, args):
        fn = module.function(name) if file == "attention.cu" else ops._fn(file, name)
        ops.rt.launch(fn, grid, block, args)

    other._launch = launch
    return other


def _verdict_path(ops, kv_dtype: str, hd: int):
    source = rt.expand_source("attention.cu")
    key = rt.cache_key(source, str(ops.rt.target), ops.rt.name, {"check": f"{kv_dtype}/{hd}"})
    base = getattr(ops.rt, "cache_dir", None) or rt.kernel_cache_dir()
    return base / f"attention-check-{key}.json"


def compare(ops, kv_dtype: str, hd: int) -> float:
    """max|tensor-core - portable| / max|portable| of attn_prefill_<kv>_hd<hd> on random data."""
    t, nh, nkv, start = CASE
    rng = np.random.default_rng(hd)
    q = rng.standard_normal((t, nh, hd)).astype(np.float32)
    kv = rng.standard_normal((2, start + t, nkv, hd)).astype(np.float32)
    cache = ops.with_kv_dtype(kv_dtype).device_kv_cache(1, nkv, hd, start + t)
    cache.reserve(start + t)
    k, v = cache.update(0, 0, ops.asarray(kv[0]), ops.asarray(kv[1]))
    got = ops.attention(ops.asarray(q), k, v, start, nsplit=1).numpy()
    want = _portable(ops).attention(ops.asarray(q), k, v, start, nsplit=1).numpy()
    scale = float(np.abs(want).max())
    return float(np.abs(got - want).max() / scale) if np.isfinite(got).all() else float("inf")


def check_prefill(ops, kv_dtype: str, hd: int) -> bool:
    """Whether the tensor-core prefill of (kv_dtype, hd) agrees with the portable build, from
    the cached verdict or by running both once."""
    path = _verdict_path(ops, kv_dtype, hd)
    try:
        err = float(json.loads(path.read_text())["rel_err"])
    except (OSError, ValueError, KeyError, TypeError):
        err = compare(ops, kv_dtype, hd)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"rel_err": err}))
        except OSError:
            pass  # an unwritable cache only means checking again next time
    if err <= TOLERANCE:
        return True
    ops.__dict__.setdefault("prefill_check_failures", []).append(
        f"attn_prefill_{kv_dtype}_hd{hd}: {err:.2e} off the portable kernel; using the row kernel"
    )
    return False
