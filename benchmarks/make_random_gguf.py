"""Random-weight GGUF files of real model shapes, quantized by llama.cpp itself.

    python benchmarks/make_random_gguf.py --out /tmp/shapes \\
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python

For each shape (`--shape`, repeatable; default all of SHAPES) it writes
`<shape>-F16.gguf` in llama.cpp's own layout (what convert_hf_to_gguf.py writes for the
`qwen3` and `qwen35` architectures: tensor names, metadata keys, numpy (rows, cols) shapes,
norms and 1-D tensors as F32, the Qwen3.5 norms stored as w + 1, `ssm_a` = -exp(A_log)), then
`<shape>-Q4_K_M.gguf` from it through llama.cpp's quantiser (`llama_model_quantize`, run by the
`--llama-python` interpreter, which has llama-cpp-python; atlas does not depend on it).

The weights are random (seeded, normal with std 0.02) so the files carry no model: they are for
speed and memory measurements (benchmarks/cpu_vs_llamacpp.py), where only the shapes matter.
The tokenizer is a byte-level BPE vocabulary: the 256 byte tokens and a few merges, Qwen's special
tokens at the ids the real vocabulary has them, and llama.cpp's `[PAD{i}]` filler up to the
model's vocabulary size (as the converter pads a vocabulary smaller than the embedding).
`--tokenizer-gguf` takes the tokenizer of another GGUF file instead (a real one of the family).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

# ---------------------------------------------------------------------------------------------
# The shapes. Qwen3-0.6B: Qwen/Qwen3-0.6B config.json. Qwen3.5-0.8B: the text_config of
# Qwen/Qwen3.5-0.8B as published with the model (hidden 1024, 24 layers = 6 x (3 Gated DeltaNet
# + 1 gated attention), 16 key and 16 value heads of 128 in the GDN layers, 8 query / 2 KV
# heads of 256 in the attention layers, partial rotary 0.25, vocab 248,320, tied embeddings);
# change them here if a release differs.


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    context: int
    specials_at: int  # id of <|endoftext|>; the other special tokens follow it
    eps: float = 1e-6
    extra: dict = field(default_factory=dict)  # qwen35's GDN sizes


SHAPES = {
    "qwen3-0.6b": Shape(
        "qwen3", 1024, 28, 16, 8, 128, 3072, 151_936, 1_000_000.0, 40_960, 151_643
    ),
    "qwen35-0.8b": Shape(
        "qwen35", 1024, 24, 8, 2, 256, 3584, 248_320, 10_000_000.0, 262_144, 248_044,
        extra=dict(
            full_attention_interval=4, conv_kernel=4, key_heads=16, value_heads=16,
            key_dim=128, value_dim=128, partial_rotary=0.25, mrope_sections=[11, 11, 10, 0],
        ),
    ),
}  # fmt: skip

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


# ---------------------------------------------------------------------------------------------
# tensors: (GGUF name, numpy shape, kind); kind says how the random values are made


def qwen3_tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """As llama.cpp's `Qwen3Model` writes it (tied: no output.weight)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, h), "w"), ("output_norm.weight", (h,), "norm")]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,), "norm"),
            (b + "attn_q.weight", (q, h), "w"),
            (b + "attn_k.weight", (kv, h), "w"),
            (b + "attn_v.weight", (kv, h), "w"),
            (b + "attn_output.weight", (h, q), "w"),
            (b + "attn_q_norm.weight", (s.head_dim,), "norm"),
            (b + "attn_k_norm.weight", (s.head_dim,), "norm"),
            (b + "ffn_norm.weight", (h,), "norm"),
            (b + "ffn_gate.weight", (s.intermediate, h), "w"),
            (b + "ffn_up.weight", (s.intermediate, h), "w"),
            (b + "ffn_down.weight", (h, s.intermediate), "w"),
        ]
    return out


def qwen35_tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """As llama.cpp's `Qwen3_5TextModel` writes it, without the MTP block (tied)."""
    x, h = s.extra, s.hidden
    nk, nv, dk, dv = x["key_heads"], x["value_heads"], x["key_dim"], x["value_dim"]
    conv = 2 * nk * dk + nv * dv
    out = [("token_embd.weight", (s.vocab, h), "w"), ("output_norm.weight", (h,), "norm")]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "norm")]
        if (i + 1) % x["full_attention_interval"] == 0:  # gated attention: q and its gate
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            out += [
                (b + "attn_q.weight", (2 * q, h), "w"),
                (b + "attn_k.weight", (kv, h), "w"),
                (b + "attn_v.weight", (kv, h), "w"),
                (b + "attn_output.weight", (h, q), "w"),
                (b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                (b + "attn_k_norm.weight", (s.head_dim,), "norm"),
            ]
        else:  # Gated DeltaNet
            out += [
                (b + "attn_qkv.weight", (conv, h), "w"),
                (b + "attn_gate.weight", (nv * dv, h), "w"),
                (b + "ssm_beta.weight", (nv, h), "w"),
                (b + "ssm_alpha.weight", (nv, h), "w"),
                (b + "ssm_conv1d.weight", (conv, x["conv_kernel"]), "conv"),
                (b + "ssm_a", (nv,), "ssm_a"),
                (b + "ssm_dt.bias", (nv,), "dt"),
                (b + "ssm_norm.weight", (dv,), "norm"),
                (b + "ssm_out.weight", (h, nv * dv), "w"),
            ]
        out += [
            (b + "post_attention_norm.weight", (h,), "norm"),
            (b + "ffn_gate.weight", (s.intermediate, h), "w"),
            (b + "ffn_up.weight", (s.intermediate, h), "w"),
            (b + "ffn_down.weight", (h, s.intermediate), "w"),
        ]
    return out


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Values of the size a trained model has, so that nothing overflows in F16 or Q4_K."""
    if kind == "w":
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
    if kind == "norm":  # plain norms near 1; Qwen3.5 stores its (1 + w) norms as w + 1: also ~1
        return (1.0 + 0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if kind == "conv":  # llama.cpp keeps ssm_conv1d in F32
        return (rng.standard_normal(shape, np.float32) * 0.2).astype(np.float32)
    if kind == "ssm_a":  # -exp(A_log), A_log = log(uniform(1, 16)) as transformers initialises
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    if kind == "dt":
        return rng.uniform(0.0, 1.0, shape).astype(np.float32)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------
# metadata


def add_shape_keys(w: gguf.GGUFWriter, s: Shape) -> None:
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.eps)
    if s.arch == "qwen35":
        x = s.extra
        w.add_rope_dimension_count(int(s.head_dim * x["partial_rotary"]))
        w.add_rope_dimension_sections(x["mrope_sections"])
        w.add_ssm_conv_kernel(x["conv_kernel"])
        w.add_ssm_state_size(x["key_dim"])
        w.add_ssm_group_count(x["key_heads"])
        w.add_ssm_time_step_rank(x["value_heads"])
        w.add_ssm_inner_size(x["value_heads"] * x["value_dim"])
        w.add_full_attention_interval(x["full_attention_interval"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the 256 byte tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled, n = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + n)
            n += 1
    return [spelled[b] for b in range(256)]


def add_tokenizer(w: gguf.GGUFWriter, s: Shape, source: Path | None) -> None:
    if source is not None:
        return copy_tokenizer(w, s, source)
    # llama.cpp refuses a BPE vocabulary without merges (an empty list is not written): a few
    merges = ["Ġ t", "h e", "i n", "Ġt he"]
    tokens = byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    while len(tokens) < s.vocab:
        i = len(tokens)
        if s.specials_at <= i < s.specials_at + len(SPECIALS):
            tokens.append(SPECIALS[i - s.specials_at])
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35" if s.arch == "qwen35" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(s.specials_at + SPECIALS.index("<|im_end|>"))
    w.add_pad_token_id(s.specials_at)
    w.add_bos_token_id(s.specials_at)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def copy_tokenizer(w: gguf.GGUFWriter, s: Shape, source: Path) -> None:
    """Every `tokenizer.*` key of `source`, its token list padded to the model's vocabulary."""
    reader = gguf.GGUFReader(str(source))
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = fld.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), s.vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (s.vocab - len(value))
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)


# ---------------------------------------------------------------------------------------------
# writing and quantizing


def write_f16(path: Path, s: Shape, seed: int, tokenizer: Path | None) -> None:
    """The F16 file, tensor by tensor (each is made, written and dropped: a few MB at a time)."""
    tensors = qwen3_tensors(s) if s.arch == "qwen3" else qwen35_tensors(s)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {path.stem}")
    add_shape_keys(w, s)
    add_tokenizer(w, s, tokenizer)
    for name, shape, kind in tensors:
        dtype = np.float16 if kind == "w" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, F16 if kind == "w" else F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_, shape, kind) in enumerate(tensors):
        w.write_tensor_data(random_tensor(np.random.default_rng([seed, i]), shape, kind))
    w.close()


QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                    ctypes.byref(params))
sys.exit(rc)
"""
FTYPES = {"Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2}


def quantize(llama_python: str, src: Path, dst: Path, ftype: str, threads: int) -> None:
    """llama.cpp's own quantiser (llama-cpp-python's `llama_model_quantize`), in a child."""
    cmd = [llama_python, "-c", QUANTIZE, str(src), str(dst), str(FTYPES[ftype]), str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"llama_model_quantize failed ({done.returncode}):\n{done.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the files")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: all")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python (for quantizing)")
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(FTYPES), help="quantized type")
    ap.add_argument("--layers", type=int, help="fewer layers than the real model (quick tests)")
    ap.add_argument("--tokenizer-gguf", type=Path, help="take the tokenizer from this GGUF")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="quantiser threads")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shape or sorted(SHAPES):
        s = SHAPES[name]
        if args.layers:
            s = Shape(**{**s.__dict__, "layers": args.layers})
        f16 = args.out / f"{name}-F16.gguf"
        t0 = time.perf_counter()
        write_f16(f16, s, args.seed, args.tokenizer_gguf)
        print(f"{f16}  {f16.stat().st_size / 1e6:.0f} MB  ({time.perf_counter() - t0:.0f} s)")
        if args.llama_python is None:
            continue
        quantized = args.out / f"{name}-{args.type}.gguf"
        t0 = time.perf_counter()
        quantize(args.llama_python, f16, quantized, args.type, args.threads)
        size = quantized.stat().st_size / 1e6
        print(f"{quantized}  {size:.0f} MB  ({time.perf_counter() - t0:.0f} s)")
        if not args.keep_f16:
            f16.unlink()


if __name__ == "__main__":
    main()
