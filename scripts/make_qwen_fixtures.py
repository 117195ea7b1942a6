"""Build the tiny Qwen3 / Qwen3.5 checkpoints and transformers reference logits under
tests/fixtures/qwen/. Run with an environment that has torch and transformers (CI does not:
the tests only read what this script writes):

    .refvenv/bin/python scripts/make_qwen_fixtures.py [qwen2|qwen3|qwen35 ...]  # default: all
                                                      # (the venv scripts/make_reference.py makes)

Every checkpoint is random (seeded) and tiny (hidden 16 or 32, vocab 64). Each directory gets a
`reference.npz`: `prompt` (T,) and `decode` (32,) token ids, and `logits` (T + 32, V) float32 from
transformers (float32, CPU): the prompt's logits from one prefill, then one row per cached decode
step fed with `decode[i]`.

What is built, and what it covers:
- qwen3-tied-bf16, qwen3-gqa4-f16, qwen3-mha-f32: Qwen3ForCausalLM checkpoints (tied/untied
  embeddings, GQA 2 and 4, MHA, head_dim != hidden/heads, bf16/fp16/fp32 storage).
- qwen35-text-bf16: Qwen3_5ForCausalLM layout (`qwen3_5_text`), layers [lin, lin, lin, full],
  partial rotary 0.25, tied, a 70-token prompt (crosses a 64-token GDN chunk).
- qwen35-vlm-bf16: the released Qwen3.5/3.6 layout: `qwen3_5` config with `text_config`,
  `model.language_model.*` names, a `model.visual.*` tensor, `mtp.*` weights, two shards with an
  index; layers [lin, full, lin], partial rotary 0.5, untied, 2 value heads per key head.
- qwen35-f32: layers [full, lin], partial rotary 1.0, one value head per key head, float32.
- qwen35-nvfp4: qwen35-vlm-bf16 quantized as NVIDIA ModelOpt NVFP4 (packed E2M1, FP8-E4M3 per-16
  scales, FP32 global scale), mixed: layer 0's GDN, lm_head and mtp.fc stay bf16 and one MLP
  weight is FP8 with a per-tensor scale. Reference: transformers on the dequantized weights,
  dequantized here in torch with modelopt's formula; `dequant_*` arrays hold two of them.
- qwen2-bf16: Qwen2ForCausalLM (q/k/v biases, no q/k norms), GQA 2, untied.
- qwen3-gguf, qwen35-gguf, qwen2-gguf: a `model.gguf` laid out as llama.cpp's
  convert_hf_to_gguf.py writes it (see `write_qwen35_gguf`), Q8_0/Q4_0 weights (qwen2: F32
  biases); the reference logits come from transformers loading the GGUF file itself, so its
  (independent) GGUF mapping checks our loader.

The steps are in scripts/fixtures/ (qwen_models, qwen_nvfp4, qwen_gguf); this file lists what is
built, with which seed and config.
"""

from __future__ import annotations

import sys

import torch
from fixtures.qwen_checkpoint import OUT
from fixtures.qwen_gguf import make_gguf, write_qwen2_gguf, write_qwen3_gguf, write_qwen35_gguf
from fixtures.qwen_models import (
    make_qwen2,
    make_qwen3,
    make_qwen35_text,
    make_qwen35_vlm,
    qwen35_model,
)
from fixtures.qwen_nvfp4 import make_nvfp4

# The config of each checkpoint, over the defaults in fixtures/qwen_models.py.
QWEN3_TIED = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
QWEN3_GQA4 = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=False,
)
QWEN3_MHA = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
QWEN35_TEXT = dict(
    num_hidden_layers=4,
    linear_value_head_dim=8,
    tie_word_embeddings=True,
    rope={"partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
)
QWEN35_VLM = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    full_attention_interval=2,
    linear_num_value_heads=4,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=3,
    tie_word_embeddings=False,
    rope={"partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
)
QWEN35_F32 = dict(
    hidden_size=16,
    num_hidden_layers=2,
    layer_types=["full_attention", "linear_attention"],
    num_key_value_heads=2,
    head_dim=8,
    linear_value_head_dim=8,
    tie_word_embeddings=True,
    rope={"partial_rotary_factor": 1.0, "mrope_section": [2, 1, 1]},
)
QWEN2 = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
VLM_SEED = 50


def qwen2() -> None:
    model, prompt, decode, _ = make_qwen2("qwen2-bf16", 70, torch.bfloat16, **QWEN2)
    make_gguf("qwen2-gguf", write_qwen2_gguf, prompt, decode, model, model.config)


def qwen3() -> None:
    make_qwen3("qwen3-tied-bf16", 10, torch.bfloat16, **QWEN3_TIED)
    q3, q3_prompt, q3_decode, _ = make_qwen3("qwen3-gqa4-f16", 20, torch.float16, **QWEN3_GQA4)
    make_qwen3("qwen3-mha-f32", 30, torch.float32, **QWEN3_MHA)
    # transformers' qwen3 GGUF config mapping ignores attention.key_length (it assumes
    # head_dim 128), so give it the config; the weights still come from the GGUF file.
    make_gguf("qwen3-gguf", write_qwen3_gguf, q3_prompt, q3_decode, q3, q3.config, config=q3.config)


def qwen35() -> None:
    make_qwen35_text("qwen35-text-bf16", 40, torch.bfloat16, prompt_len=70, **QWEN35_TEXT)
    model, config, tensors, prompt, decode, _ = make_qwen35_vlm(
        "qwen35-vlm-bf16", VLM_SEED, torch.bfloat16, **QWEN35_VLM
    )
    make_qwen35_text("qwen35-f32", 60, torch.float32, **QWEN35_F32)
    print("nvfp4")
    make_nvfp4("qwen35-nvfp4", OUT / "qwen35-vlm-bf16", model, tensors, prompt, decode)
    # a fresh copy of the bf16 VLM model: make_nvfp4 overwrote its weights in place
    model = qwen35_model(config, VLM_SEED, torch.bfloat16)
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    make_gguf("qwen35-gguf", write_qwen35_gguf, prompt, decode, model, config, mtp)


FAMILIES = {"qwen2": qwen2, "qwen3": qwen3, "qwen35": qwen35}


def main(families: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for family in families or FAMILIES:
        print(family)
        FAMILIES[family]()
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"total fixture size: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
