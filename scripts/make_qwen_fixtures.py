"""Build the tiny Qwen3 / Qwen3.5 checkpoints and transformers reference logits under
tests/fixtures/qwen/. Run with an environment that has torch and transformers (CI does not:
the tests only read what this script writes):

    /work/refvenv/bin/python scripts/make_qwen_fixtures.py

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
- qwen3-q8.gguf, qwen35-q8.gguf: GGUF files laid out as llama.cpp's convert_hf_to_gguf.py writes
  them (see `write_qwen35_gguf`), Q8_0/Q4_0 weights; the reference logits come from transformers
  loading the GGUF file itself, so its (independent) GGUF mapping checks our loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen"
DECODE_STEPS = 32
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<unk>",
]
CHARS = list("\n !\"'(),-.0123456789:;?abcdefghijklmnopqrstuvwxyz<>/=_|*")
VOCAB = SPECIALS + CHARS  # 64 tokens
assert len(VOCAB) == 64 and len(set(VOCAB)) == 64
V = len(VOCAB)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- tokenizer -----------------------------------------------------------------------------------


def write_tokenizer(d: Path) -> None:
    """A character-level tokenizer (BPE without merges) with Qwen's special tokens."""
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)}, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(d / "tokenizer.json"))
    config = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# -- random weights ------------------------------------------------------------------------------


def randomize(model: torch.nn.Module, seed: int, zero_centered_norms: bool) -> None:
    """Weights with unit-scale activations, so that logits spread and parity tests can fail."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 10 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * randn(p.shape))
            elif "norm" in name:
                plain = not zero_centered_norms or name.endswith("linear_attn.norm.weight")
                p.copy_((1.0 if plain else 0.0) + 0.2 * randn(p.shape))
            elif "embed_tokens" in name:
                p.copy_(0.5 * randn(p.shape))
            elif p.ndim == 1:
                p.copy_(0.1 * randn(p.shape))
            else:
                p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)


def round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the float32 weights to `dtype` and back, so the stored checkpoint is exact."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


@torch.no_grad()
def reference_logits(model, prompt: np.ndarray, decode: np.ndarray) -> np.ndarray:
    """One prefill of `prompt`, then `decode` fed one token at a time through the cache."""
    model.eval()
    out = model(torch.tensor(prompt[None]), use_cache=True)
    rows = [out.logits[0]]
    cache = out.past_key_values
    for tok in decode:
        out = model(torch.tensor([[int(tok)]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0])
    return torch.cat(rows).float().numpy()


def token_ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, n).astype(np.int64)


def save_reference(d: Path, prompt, decode, logits, **extra) -> None:
    np.savez(d / "reference.npz", prompt=prompt, decode=decode, logits=logits, **extra)


def fresh_dir(name: str) -> Path:
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def check_reload(d: Path, logits: np.ndarray, prompt, decode) -> None:
    """transformers reads the directory back to the same logits (the layout is real)."""
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    again = reference_logits(model, prompt, decode)
    diff = float(np.abs(again - logits).max())
    assert diff < 1e-5, f"{d.name}: reload differs by {diff}"
    print(f"  {d.name}: {type(model).__name__} reloads, max diff {diff:.1e}")


# -- Qwen3 ---------------------------------------------------------------------------------------

QWEN3_COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    eos_token_id=2,
    pad_token_id=0,
)


def save_hf(name, model, seed, dtype, prompt_len):
    """`model` saved as an HF checkpoint in `dtype`, with tokenizer and reference logits."""
    prompt, decode = token_ids(seed, prompt_len), token_ids(seed + 1, DECODE_STEPS)
    logits = reference_logits(model, prompt, decode)
    d = fresh_dir(name)
    model.to(dtype).save_pretrained(d)
    write_tokenizer(d)
    save_reference(d, prompt, decode, logits)
    check_reload(d, logits, prompt, decode)
    return model.float(), prompt, decode, logits


def make_qwen3(name, seed, dtype, prompt_len=9, **cfg):
    config = Qwen3Config(**{**QWEN3_COMMON, **cfg})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    randomize(model, seed, zero_centered_norms=False)
    round_to(model, dtype)
    return save_hf(name, model, seed, dtype, prompt_len)


# -- Qwen3.5 -------------------------------------------------------------------------------------


def qwen35_config(**cfg) -> Qwen3_5TextConfig:
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "mrope_interleaved": True}
    rope.update(cfg.pop("rope", {}))
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(cfg)
    return Qwen3_5TextConfig(rope_parameters=rope, **base)


def qwen35_model(config, seed, dtype):
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    randomize(model, seed, zero_centered_norms=True)
    round_to(model, dtype)
    return model


def mtp_weights(config, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP block with the names of the released checkpoints (vLLM qwen3_5_mtp.py)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, hd, i = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    )

    def lin(o, n):
        return torch.randn((o, n), generator=g) * n**-0.5

    def norm(n):
        return 0.2 * torch.randn((n,), generator=g)

    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": lin(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h),
        "mtp.norm.weight": norm(h),
        p + "input_layernorm.weight": norm(h),
        p + "post_attention_layernorm.weight": norm(h),
        p + "self_attn.q_proj.weight": lin(2 * nh * hd, h),
        p + "self_attn.k_proj.weight": lin(nkv * hd, h),
        p + "self_attn.v_proj.weight": lin(nkv * hd, h),
        p + "self_attn.o_proj.weight": lin(h, nh * hd),
        p + "self_attn.q_norm.weight": norm(hd),
        p + "self_attn.k_norm.weight": norm(hd),
        p + "mlp.gate_proj.weight": lin(i, h),
        p + "mlp.up_proj.weight": lin(i, h),
        p + "mlp.down_proj.weight": lin(h, i),
    }


def vlm_tensors(model, config, seed) -> dict[str, torch.Tensor]:
    """State dict in the Qwen3_5ForConditionalGeneration layout, plus vision and MTP tensors."""
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensors[k.replace("model.", "model.language_model.", 1)] = v
    g = torch.Generator().manual_seed(seed)
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn((16, 3, 2, 2, 2), generator=g)
    tensors.update(mtp_weights(config, seed + 7))
    return {k: v.contiguous() for k, v in tensors.items()}


def vlm_config(config: Qwen3_5TextConfig, extra: dict | None = None) -> dict:
    text = config.to_dict()
    text.update({"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1})
    text.update(extra or {})
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": config.hidden_size,
        },
        "tie_word_embeddings": config.tie_word_embeddings,
        "image_token_id": 90,
        "video_token_id": 91,
        "vision_start_token_id": 92,
        "vision_end_token_id": 93,
    }


def save_sharded(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def make_qwen35_text(name, seed, dtype, prompt_len=9, **cfg):
    model = qwen35_model(qwen35_config(**cfg), seed, dtype)
    return save_hf(name, model, seed, dtype, prompt_len)


def make_qwen35_vlm(name, seed, dtype, **cfg):
    config = qwen35_config(**cfg)
    model = qwen35_model(config, seed, dtype)
    prompt, decode = token_ids(seed, 9), token_ids(seed + 1, DECODE_STEPS)
    logits = reference_logits(model, prompt, decode)
    d = fresh_dir(name)
    tensors = {k: v.to(dtype) for k, v in vlm_tensors(model, config, seed).items()}
    save_sharded(d, tensors)
    (d / "config.json").write_text(json.dumps(vlm_config(config), indent=1))
    write_tokenizer(d)
    save_reference(d, prompt, decode, logits)
    check_reload(d, logits, prompt, decode)
    return model, config, tensors, prompt, decode, logits


# -- NVFP4 (ModelOpt) ----------------------------------------------------------------------------

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def quantize_nvfp4(w: torch.Tensor):
    """ModelOpt's NVFP4 weight quantization: global scale amax/(6*448), per-16 FP8 scales,
    nearest E2M1 code. Returns (packed U8 (out, in/2), scale F8_E4M3 (out, in/16), scale_2 F32)."""
    out, n = w.shape
    ws2 = (w.abs().max() / (6 * 448)).float()
    blocks = w.float().reshape(out, n // 16, 16)
    scale = (blocks.abs().amax(-1) / 6 / ws2).to(torch.float8_e4m3fn)
    eff = scale.float() * ws2
    x = blocks / torch.where(eff == 0, torch.ones_like(eff), eff)[..., None]
    idx = (x.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    codes = (idx | ((x < 0).long() << 3)).reshape(out, n).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble = even column
    return packed.contiguous(), scale.contiguous(), ws2.reshape(())


def dequantize_nvfp4(packed, scale, ws2) -> torch.Tensor:
    """modelopt `NVFP4QTensor.dequantize` (formats.md section 2.2), in float32."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    vals = E2M1[codes.long()]
    s = scale.to(torch.float32) * ws2.to(torch.float32)
    return (vals.view(vals.shape[0], -1, 16) * s.unsqueeze(-1)).reshape(vals.shape)


def make_nvfp4(name, source_dir: Path, model, config, tensors, prompt, decode):
    """Quantize every linear weight except the excluded modules; one MLP weight as FP8."""
    exclude = ["lm_head", "model.visual*", "mtp.fc", "model.language_model.layers.0.linear_attn*"]
    fp8_name = "model.language_model.layers.1.mlp.down_proj.weight"
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        quantizable = k.endswith(".weight") and v.ndim == 2 and "norm" not in k
        quantizable &= "embed_tokens" not in k and "model.visual" not in k
        quantizable &= k not in ("lm_head.weight", "mtp.fc.weight") and ".layers.0.linear" not in k
        if k == fp8_name:
            w = v.float()
            s = (w.abs().max() / 448).reshape(())
            q = (w / s).to(torch.float8_e4m3fn)
            out[k], out[k[: -len("weight")] + "weight_scale"] = q, s
            deq[k] = q.float() * s
        elif quantizable:
            packed, scale, ws2 = quantize_nvfp4(v.float())
            base = k[: -len(".weight")]
            out[k] = packed
            out[base + ".weight_scale"] = scale
            out[base + ".weight_scale_2"] = ws2
            out[base + ".input_scale"] = torch.tensor(1.0 / 448)  # unused by W4A16 emulation
            deq[k] = dequantize_nvfp4(packed, scale, ws2)
        else:
            out[k] = v
    # reference: transformers on the dequantized weights
    state = model.state_dict()
    with torch.no_grad():
        for k, w in deq.items():
            if k.startswith("model.language_model."):
                state[k.replace("model.language_model.", "model.", 1)].copy_(w)
    logits = reference_logits(model, prompt, decode)
    d = fresh_dir(name)
    save_sharded(d, out)
    quant = {
        "producer": {"name": "modelopt", "version": "0.37.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }
    (d / "hf_quant_config.json").write_text(json.dumps(quant, indent=1))
    cfg = json.loads((source_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": exclude,
        "config_groups": {
            "group_0": {
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "input_activations": {
                    "dynamic": False,
                    "num_bits": 4,
                    "type": "float",
                    "group_size": 16,
                },
                "targets": ["Linear"],
            }
        },
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(d)
    keep = ["model.language_model.layers.2.linear_attn.in_proj_qkv.weight", fp8_name]
    extra = {"dequant_" + k: deq[k].numpy() for k in keep}
    save_reference(d, prompt, decode, logits, **extra)
    print(f"  {name}: {len(deq)} quantized weights")


# -- GGUF ----------------------------------------------------------------------------------------


def gguf_tokenizer(w: gguf.GGUFWriter, pre: str) -> None:
    """Our vocabulary as a byte-level BPE token list (GPT-2 byte->unicode spelling)."""
    b2u = {}
    n = 0
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    for b in range(256):
        if b in printable:
            b2u[b] = chr(b)
        else:
            b2u[b] = chr(256 + n)
            n += 1
    tokens = [t if t in SPECIALS else "".join(b2u[b] for b in t.encode()) for t in VOCAB]
    types = [3 if t in SPECIALS else 1 for t in VOCAB]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def add(w: gguf.GGUFWriter, name: str, t, qtype: QT = QT.F32) -> None:
    a = t.detach().float().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)
    if qtype == QT.F32 or a.ndim == 1 or a.shape[-1] % 32:
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    else:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)


def add_shape(w: gguf.GGUFWriter, config, block_count: int) -> None:
    """The transformer shape keys both Qwen writers start with, in convert_hf_to_gguf's order."""
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(block_count)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_qwen3_gguf(path: Path, model, config) -> None:
    """As llama.cpp's `Qwen3Model` (-> Qwen2Model -> TextModel) writes it: plain renames, no Q/K
    row permutation (only the llama arch permutes), norms as stored."""
    sd = model.state_dict()
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_shape(w, config, config.num_hidden_layers)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    gguf_tokenizer(w, "qwen2")
    add(w, "token_embd.weight", sd["model.embed_tokens.weight"], QT.Q8_0)
    add(w, "output_norm.weight", sd["model.norm.weight"])
    if not config.tie_word_embeddings:
        add(w, "output.weight", sd["lm_head.weight"], QT.Q8_0)
    names = {
        "input_layernorm": ("attn_norm", QT.F32),
        "self_attn.q_proj": ("attn_q", QT.Q8_0),
        "self_attn.k_proj": ("attn_k", QT.Q8_0),
        "self_attn.v_proj": ("attn_v", QT.Q8_0),
        "self_attn.o_proj": ("attn_output", QT.Q8_0),
        "self_attn.q_norm": ("attn_q_norm", QT.F32),
        "self_attn.k_norm": ("attn_k_norm", QT.F32),
        "post_attention_layernorm": ("ffn_norm", QT.F32),
        "mlp.gate_proj": ("ffn_gate", QT.Q4_0),
        "mlp.up_proj": ("ffn_up", QT.Q4_0),
        "mlp.down_proj": ("ffn_down", QT.Q8_0),
    }
    for i in range(config.num_hidden_layers):
        for hf, (gg, qt) in names.items():
            add(w, f"blk.{i}.{gg}.weight", sd[f"model.layers.{i}.{hf}.weight"], qt)
    finish(w)


def tiled(t: torch.Tensor, nk: int, r: int, head_dim: int, dim: int = 0) -> torch.Tensor:
    """llama.cpp `_reorder_v_heads`: value heads grouped by key head -> tiled for ggml repeat."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(path: Path, model, config, mtp: dict[str, torch.Tensor]) -> None:
    """As llama.cpp's `Qwen3_5TextModel` (conversion/qwen.py: _Qwen35MtpMixin,
    _LinearAttentionVReorderBase, Qwen3NextModel) writes it:
    - norms stored as w + 1, except linear_attn.norm (`ssm_norm`);
    - A_log stored as ssm_a = -exp(A_log); dt_bias as `ssm_dt.bias`; conv1d squeezed to (C, K);
    - value heads reordered grouped -> tiled on in_proj_qkv's v rows, conv1d's v channels,
      in_proj_z rows, in_proj_a/b rows, A_log, dt_bias and out_proj's columns;
    - the MTP block as layer `num_hidden_layers` (`nextn.eh_proj/enorm/hnorm/shared_head_norm`
      plus the usual attention/FFN names), counted in block_count, `nextn_predict_layers` = 1.
    """
    sd = {k: v.float() for k, v in model.state_dict().items()}
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, r = config.linear_key_head_dim, config.linear_value_head_dim, nv // nk
    n_layers = config.num_hidden_layers
    rot = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    w = gguf.GGUFWriter(str(path), "qwen35")
    add_shape(w, config, n_layers + 1)
    w.add_rope_dimension_count(rot)
    w.add_rope_dimension_sections([*config.rope_parameters["mrope_section"], 0])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(nv * dv)
    w.add_full_attention_interval(config.full_attention_interval)
    w.add_nextn_predict_layers(1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    gguf_tokenizer(w, "qwen35")

    def norm(t):
        return t + 1

    add(w, "token_embd.weight", sd["model.embed_tokens.weight"], QT.Q8_0)
    add(w, "output_norm.weight", norm(sd["model.norm.weight"]))
    if not config.tie_word_embeddings:
        add(w, "output.weight", sd["lm_head.weight"], QT.Q8_0)

    def block(i: int, get) -> None:
        b = f"blk.{i}."
        add(w, b + "attn_norm.weight", norm(get("input_layernorm.weight")))
        add(w, b + "post_attention_norm.weight", norm(get("post_attention_layernorm.weight")))
        add(w, b + "ffn_gate.weight", get("mlp.gate_proj.weight"), QT.Q8_0)
        add(w, b + "ffn_up.weight", get("mlp.up_proj.weight"), QT.Q8_0)
        add(w, b + "ffn_down.weight", get("mlp.down_proj.weight"), QT.Q8_0)

    def attention(i: int, get) -> None:
        b = f"blk.{i}."
        add(w, b + "attn_q.weight", get("self_attn.q_proj.weight"), QT.Q8_0)
        add(w, b + "attn_k.weight", get("self_attn.k_proj.weight"), QT.Q8_0)
        add(w, b + "attn_v.weight", get("self_attn.v_proj.weight"), QT.Q8_0)
        add(w, b + "attn_output.weight", get("self_attn.o_proj.weight"), QT.Q8_0)
        add(w, b + "attn_q_norm.weight", norm(get("self_attn.q_norm.weight")))
        add(w, b + "attn_k_norm.weight", norm(get("self_attn.k_norm.weight")))

    for i, kind in enumerate(config.layer_types):

        def get(name, i=i):
            return sd[f"model.layers.{i}.{name}"]

        block(i, get)
        if kind == "full_attention":
            attention(i, get)
            continue
        b, qk = f"blk.{i}.", 2 * nk * dk
        qkv = get("linear_attn.in_proj_qkv.weight")
        qkv = torch.cat([qkv[:qk], tiled(qkv[qk:], nk, r, dv)])
        conv = get("linear_attn.conv1d.weight").squeeze(1)
        conv = torch.cat([conv[:qk], tiled(conv[qk:], nk, r, dv)])
        add(w, b + "attn_qkv.weight", qkv, QT.Q8_0)
        add(
            w,
            b + "attn_gate.weight",
            tiled(get("linear_attn.in_proj_z.weight"), nk, r, dv),
            QT.Q8_0,
        )
        add(w, b + "ssm_beta.weight", tiled(get("linear_attn.in_proj_b.weight"), nk, r, 1), QT.Q8_0)
        add(
            w, b + "ssm_alpha.weight", tiled(get("linear_attn.in_proj_a.weight"), nk, r, 1), QT.Q8_0
        )
        add(w, b + "ssm_conv1d.weight", conv)
        add(w, b + "ssm_a", tiled(-torch.exp(get("linear_attn.A_log")), nk, r, 1))
        add(w, b + "ssm_dt.bias", tiled(get("linear_attn.dt_bias"), nk, r, 1))
        add(w, b + "ssm_norm.weight", get("linear_attn.norm.weight"))
        out = tiled(get("linear_attn.out_proj.weight"), nk, r, dv, dim=1)
        add(w, b + "ssm_out.weight", out, QT.Q8_0)

    m = n_layers  # the MTP block

    def get_mtp(name):
        return mtp["mtp.layers.0." + name].float()

    block(m, get_mtp)
    attention(m, get_mtp)
    add(w, f"blk.{m}.nextn.eh_proj.weight", mtp["mtp.fc.weight"].float(), QT.Q8_0)
    add(w, f"blk.{m}.nextn.enorm.weight", norm(mtp["mtp.pre_fc_norm_embedding.weight"].float()))
    add(w, f"blk.{m}.nextn.hnorm.weight", norm(mtp["mtp.pre_fc_norm_hidden.weight"].float()))
    add(w, f"blk.{m}.nextn.shared_head_norm.weight", norm(mtp["mtp.norm.weight"].float()))
    finish(w)


def make_gguf(name: str, writer, prompt, decode, *args, config=None) -> None:
    d = fresh_dir(name)
    path = d / "model.gguf"
    writer(path, *args)
    kwargs = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=path.name, dtype=torch.float32, **kwargs
    )
    logits = reference_logits(model, prompt, decode)
    save_reference(d, prompt, decode, logits)
    print(f"  {name}: transformers loads it as {type(model).__name__}")


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    print("qwen3")
    make_qwen3(
        "qwen3-tied-bf16",
        10,
        torch.bfloat16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    q3, q3_prompt, q3_decode, _ = make_qwen3(
        "qwen3-gqa4-f16",
        20,
        torch.float16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
    )
    make_qwen3(
        "qwen3-mha-f32",
        30,
        torch.float32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    print("qwen3_5")
    make_qwen35_text(
        "qwen35-text-bf16",
        40,
        torch.bfloat16,
        prompt_len=70,
        num_hidden_layers=4,
        linear_value_head_dim=8,
        tie_word_embeddings=True,
        rope={"partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    )
    model, config, tensors, prompt, decode, _ = make_qwen35_vlm(
        "qwen35-vlm-bf16",
        50,
        torch.bfloat16,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        full_attention_interval=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=3,
        tie_word_embeddings=False,
        rope={"partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
    )
    make_qwen35_text(
        "qwen35-f32",
        60,
        torch.float32,
        hidden_size=16,
        num_hidden_layers=2,
        layer_types=["full_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        tie_word_embeddings=True,
        rope={"partial_rotary_factor": 1.0, "mrope_section": [2, 1, 1]},
    )
    print("nvfp4")
    make_nvfp4("qwen35-nvfp4", OUT / "qwen35-vlm-bf16", model, config, tensors, prompt, decode)
    print("gguf")
    # transformers' qwen3 GGUF config mapping ignores attention.key_length (it assumes
    # head_dim 128), so give it the config; the weights still come from the GGUF file.
    make_gguf("qwen3-gguf", write_qwen3_gguf, q3_prompt, q3_decode, q3, q3.config, config=q3.config)
    # a fresh copy of the bf16 VLM model: make_nvfp4 overwrote its weights in place
    model = qwen35_model(config, 50, torch.bfloat16)
    mtp = {k: v.float() for k, v in tensors.items() if k.startswith("mtp.")}
    make_gguf("qwen35-gguf", write_qwen35_gguf, prompt, decode, model, config, mtp)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"total fixture size: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
