"""Dense Qwen3 (transformers' `Qwen3ForCausalLM`): Llama plus per-head RMSNorm on q and k
before RoPE."""

from __future__ import annotations

from atlas_cli.backend.models.llama import LlamaModel, ModelArgs

__all__ = ["ModelArgs", "Qwen3Model"]


class Qwen3Model(LlamaModel):
    qk_norm = True
