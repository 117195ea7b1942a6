"""Every kernel launcher, shared by the CUDA and HIP runtimes (and the CPU emulator).

`NativeOps(runtime)` implements the ops contract (ops/contract.py), so a model file runs on it
unchanged and tests can zip it with `numpy_ref`. Activations are float32 `DeviceArray`s;
weights are `DeviceWeight`s in their stored format (bf16, GGUF blocks, NVFP4), dequantized
inside the kernels. Every launch is preceded by asserts on dtype, shape and contiguity.

The launchers live by op family: native/weights.py (dequantize, embedding, linear),
native/elementwise.py (norms, activations, RoPE, DeviceArray arithmetic), native/attention.py
(the device KV cache, attention), native/gdn.py (Gated DeltaNet), native/sample.py (token
selection, FP8 conversions), on the plumbing of native/array.py; native/cache.py holds the
device hybrid cache of Gated DeltaNet models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from atlas_cli.backend.ops.native.attention import AttentionLaunchers
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

    fuse_graphs = True  # the fused decode step replays a captured graph (False: direct launches)

    def warmup(self) -> dict[str, Any]:
        """Every kernel compiled, which GEMM runs, and which prefill attention (both checked
        here on first use)."""
        return {**super().warmup(), "attention": self.prefill_report()}

    def fuse_decoder(self, model) -> DeviceDecoder | None:
        """The fused decode step (native/decoder.py) for a Qwen3.5 model whose weights it
        takes; None otherwise: the model runs op by op."""
        if not hasattr(getattr(model, "args", None), "layer_types") or not supports(model):
            return None
        return DeviceDecoder(self, model, graph=self.fuse_graphs)

    def device_hybrid_cache(
        self, layer_types, n_kv_heads: int, head_dim: int, conv_shape, recurrent_shape, max_len: int
    ) -> HybridCache:
        """The device cache of hybrid models (contract.Ops.device_hybrid_cache)."""
        return HybridCache(
            self,
            layer_types,
            n_kv_heads,
            head_dim,
            conv_shape,
            recurrent_shape,
            max_len,
            self.kv_dtype,
        )


# -- opening a device ----------------------------------------------------------------------


def open_device(device: str, kv_dtype: str = "bf16") -> NativeOps:
    """NativeOps on "cuda", "hip" or "emu"; a DeviceError (one line, what to install) when the
    runtime cannot start."""
    from atlas_cli.errors import DeviceError

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
        return NativeOps(make(), kv_dtype=kv_dtype)
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
