"""Every kernel launcher, shared by the CUDA and HIP runtimes (and the CPU emulator).

`NativeOps(runtime)` implements the ops contract (ops/contract.py), so a model file runs on it
unchanged and tests can zip it with `numpy_ref`. Activations are float32 `DeviceArray`s;
weights are `DeviceWeight`s in their stored format (bf16, GGUF blocks, NVFP4), dequantized
inside the kernels. Every launch is preceded by asserts on dtype, shape and contiguity.

The launchers live by op family: native_weights.py (dequantize, embedding, linear),
native_elementwise.py (norms, activations, RoPE, DeviceArray arithmetic), native_attention.py
(the device KV cache, attention), native_gdn.py (Gated DeltaNet), native_sample.py (token
selection, FP8 conversions), on the plumbing of native_array.py; native_cache.py holds the
device hybrid cache of Gated DeltaNet models.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from atlas_cli.backend.layers import CacheLayout
from atlas_cli.backend.ops.native.attention import KV_DTYPES, AttentionLaunchers
from atlas_cli.backend.ops.native.cache import HybridCache
from atlas_cli.backend.ops.native.decoder import DeviceDecoder, supports
from atlas_cli.backend.ops.native.elementwise import ElementwiseLaunchers
from atlas_cli.backend.ops.native.gdn import GatedDeltaNetLaunchers
from atlas_cli.backend.ops.native.sample import SamplingLaunchers
from atlas_cli.backend.ops.native.weights import WeightLaunchers


class NativeOps(
    WeightLaunchers,
    ElementwiseLaunchers,
    AttentionLaunchers,
    GatedDeltaNetLaunchers,
    SamplingLaunchers,
):
    """The ops contract, run as our kernels on `runtime`."""

    # the contract's declarations (PREFILL_CHUNK: weights.py, with its reasons)
    KEEP_QUANTIZED = False  # placement.py uploads each weight in its device format instead
    DEVICE_SAMPLING = True  # sample.py's device_sampler
    KV_TYPES = KV_DTYPES

    fuse_graphs = True  # the fused decode step replays a captured graph (False: direct launches)

    def warmup(self) -> dict[str, Any]:
        """Every kernel compiled, which GEMM runs, and which prefill attention (both checked
        here on first use)."""
        return {**super().warmup(), "attention": self.prefill_report()}

    def fuse_decoder(self, model) -> DeviceDecoder | None:
        """The fused decode step (decoder.py) built from the model's declaration, when the
        kernels take its weights and shapes; None otherwise: the model runs op by op."""
        if not supports(model):
            return None
        return DeviceDecoder(self, model, graph=self.fuse_graphs)

    def device_cache(self, layout: CacheLayout, max_len: int):
        """The device cache of the declared layers (contract.Ops.device_cache): K/V only, or
        with the Gated DeltaNet layers' state."""
        if layout.hybrid:
            return HybridCache(self, layout, max_len, self.kv_dtype)
        n_layers = len(layout.kinds)
        return self.device_kv_cache(n_layers, layout.n_kv_heads, layout.head_dim, max_len)


# -- opening a device ----------------------------------------------------------------------


PREFILL_MODES = ("fast", "exact", "fp4")
LM_HEAD_FORMATS = ("stored", "q8_0", "nvfp4")


def prefill_mode() -> str:
    """The prefill GEMM the environment asks for: ATLAS_PREFILL=exact keeps every prefill
    product float32-exact (gemm.cu, three bf16 MMAs per product); the default "fast" rounds x
    and the weights to bf16 (gemm_fast.cu, one MMA per product), as llama.cpp and vLLM do;
    "fp4" multiplies NVFP4 weights by NVFP4-quantized x on Blackwell's FP4 tensor cores
    (gemm_fp4.cu; other weights and devices: "fast")."""
    return _env_choice("ATLAS_PREFILL", PREFILL_MODES)


def lm_head_format() -> str:
    """ATLAS_LM_HEAD: "q8_0" or "nvfp4" requantize an untied float lm_head at load (the 27B's
    bf16 head is ~15% of a decode step's bytes); "stored" (the default) keeps it as stored."""
    return _env_choice("ATLAS_LM_HEAD", LM_HEAD_FORMATS)


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name`, one of `choices` (unset or empty: the first); another
    value is a one-line error."""
    from atlas_cli.errors import UsageError

    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise UsageError(f"{name} must be {', '.join(choices)}, got {value!r}")
    return value


def open_device(device: str, kv_dtype: str = "bf16") -> NativeOps:
    """NativeOps on "cuda", "hip" or "emu" with the prefill GEMM of prefill_mode(); a
    DeviceError (one line, what to install) when the runtime cannot start."""
    from atlas_cli.errors import DeviceError

    prefill, lm_head = prefill_mode(), lm_head_format()

    if device == "cuda":
        from atlas_cli.backend.ops.native import runtime_cuda as mod

        unavailable = mod.CudaUnavailable
        make = mod.CudaRuntime
    elif device == "hip":
        from atlas_cli.backend.ops.native import runtime_hip as mod

        unavailable = mod.HipUnavailable
        make = mod.HipRuntime
    elif device == "emu":
        from atlas_cli.backend.ops.native import runtime_emu

        if not runtime_emu.available():  # it compiles the kernels with the host's C++ compiler
            raise DeviceError("--device emu needs a C++ compiler: install g++ (or set CXX)")
        unavailable = RuntimeError
        make = runtime_emu.EmuRuntime
    else:
        raise DeviceError(f"unknown native device {device!r} (cuda, hip, emu)")
    try:
        return NativeOps(make(), kv_dtype=kv_dtype, prefill=prefill, lm_head=lm_head)
    except unavailable as exc:
        raise DeviceError(f"--device {device}: {exc}") from None


def kernel_report(device: str) -> dict[str, Any]:
    """For `atlas hw`: compile (or load from the on-disk cache) every kernel file for this
    device and say, per file, how long it took and whether the cache was hit. Raises
    DeviceError when the device's runtime is unavailable."""
    return open_device(device).warmup()


def probe(device: str) -> dict[str, Any]:
    """For `atlas hw` and the GPU tests: whether the runtime for "cuda" / "hip" can start here,
    without compiling anything; the runtime's own probe record as a dict, with "available" and
    (when it cannot start) "reason". Never raises."""
    if device == "cuda":
        from atlas_cli.backend.ops.native import runtime_cuda as mod
    elif device == "hip":
        from atlas_cli.backend.ops.native import runtime_hip as mod
    else:
        return {"runtime": device, "available": False, "reason": "unknown device"}
    found = mod.probe()
    return {**dataclasses.asdict(found), "available": found.available}
