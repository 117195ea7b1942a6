"""Whole-model parity: a tiny random checkpoint of each supported architecture run on the native
ops and on the numpy reference; logits and greedy generation must agree."""

from __future__ import annotations

import importlib

import numpy as np

from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.native.array import bf16_bits_to_f32, f32_to_bf16_bits

from .checks import rel_err

VOCAB = 96


def tiny_config(model_type: str) -> dict:
    base = dict(
        model_type=model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=model_type == "qwen3",
    )
    if model_type == "qwen3_5":
        base.update(
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            partial_rotary_factor=0.25,
            rope_theta=1e7,
            rms_norm_eps=1e-6,
        )
    return base


def tiny_weights(model_type: str, cfg: dict, rng: np.random.Generator) -> dict:
    """Random float32 weights, rounded to bf16 so that the device's bf16 copy is exact."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]

    def r(*shape, s=0.08):
        return bf16_bits_to_f32(f32_to_bf16_bits(rng.standard_normal(shape) * s)).reshape(shape)

    def norm(k):  # plain norms near 1; (1+w) norms (qwen3_5) near 0
        return r(k, s=0.1) + (0.0 if model_type == "qwen3_5" else 1.0)

    w = {"model.embed_tokens.weight": r(VOCAB, h, s=0.5), "model.norm.weight": norm(h)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = r(VOCAB, h)
    for i in range(n):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = r(inter, h)
        w[p + "mlp.up_proj.weight"] = r(inter, h)
        w[p + "mlp.down_proj.weight"] = r(h, inter)
        linear = model_type == "qwen3_5" and (i + 1) % cfg["full_attention_interval"] != 0
        if linear:
            nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            c = 2 * nk * dk + nv * dv
            q = p + "linear_attn."
            w[q + "in_proj_qkv.weight"] = r(c, h)
            w[q + "in_proj_z.weight"] = r(nv * dv, h)
            w[q + "in_proj_b.weight"] = r(nv, h)
            w[q + "in_proj_a.weight"] = r(nv, h)
            w[q + "conv1d.weight"] = r(c, 1, cfg["linear_conv_kernel_dim"], s=0.3)
            w[q + "norm.weight"] = r(dv, s=0.1) + 1.0
            w[q + "A_log"] = r(nv, s=0.5)
            w[q + "dt_bias"] = r(nv, s=0.5)
            w[q + "out_proj.weight"] = r(h, nv * dv)
        else:
            q = p + "self_attn."
            gate = 2 if model_type == "qwen3_5" else 1
            w[q + "q_proj.weight"] = r(gate * nh * hd, h)
            w[q + "k_proj.weight"] = r(nkv * hd, h)
            w[q + "v_proj.weight"] = r(nkv * hd, h)
            w[q + "o_proj.weight"] = r(h, nh * hd)
            if model_type in ("qwen3", "qwen3_5"):
                w[q + "q_norm.weight"] = norm(hd)
                w[q + "k_norm.weight"] = norm(hd)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()}


def _build(model_type: str, cfg: dict, weights: dict, ops):
    from atlas_cli.backend import MODEL_CLASSES

    module_name, cls_name = MODEL_CLASSES[model_type]
    module = importlib.import_module(module_name)
    args = module.ModelArgs.from_config(cfg)
    return getattr(module, cls_name)(args, weights, ops)


def _greedy(engine, ids, n: int) -> tuple[list[int], list[np.ndarray]]:
    logits, _ = engine.prefill(list(ids))
    tokens, seen = [], []
    for _ in range(n):
        logits = np.asarray(logits)
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = engine.step(tokens[-1])
    return tokens, seen


def check_model(
    ops,
    model_type: str,
    rng: np.random.Generator,
    kv_dtype: str = "bf16",
    prompt_len: int = 11,
    new_tokens: int = 6,
) -> None:
    """Logits of a fresh prompt within tolerance; then greedy decoding: the reference picks the
    tokens, the device is fed the same ones (prefix reuse, then cached decode) and must pick the
    same argmax, on the device, wherever the reference's top two are further apart than the
    two backends' logits differ (a near tie may go either way in another precision)."""
    from atlas_cli.backend.engine import Engine
    from atlas_cli.backend.ops.native.placement import to_device as _to_device

    cfg = tiny_config(model_type)
    weights = tiny_weights(model_type, cfg, rng)
    ref_net = _build(model_type, cfg, {k: v.copy() for k, v in weights.items()}, numpy_ref)
    ops.kv_dtype = kv_dtype
    dev_net = _build(model_type, cfg, {k: _to_device(ops, k, v) for k, v in weights.items()}, ops)
    ref_eng, dev_eng = Engine(ref_net, None, 64), Engine(dev_net, None, 64)
    ids = rng.integers(0, VOCAB, prompt_len)
    want = ref_eng.logits(ids)
    got = dev_eng.logits(ids)
    tol = 1e-4 if kv_dtype == "f32" else 3e-2
    err = rel_err(got, want)
    assert err < tol, f"{model_type} logits ({kv_dtype} KV): relative error {err:.2e}"
    tokens, ref_logits = _greedy(ref_eng, ids, new_tokens)
    logits, _ = dev_eng.prefill(list(ids))
    decisive = 0
    for i, tok in enumerate(tokens):
        host = np.asarray(logits)
        diff = float(np.abs(host - ref_logits[i]).max())
        assert diff <= tol * float(np.abs(ref_logits[i]).max()), f"step {i}: logits off by {diff}"
        top2 = np.sort(ref_logits[i])[-2:]
        if top2[1] - top2[0] > 2 * diff:
            decisive += 1
            assert ops.argmax(logits) == tok, f"{model_type} greedy step {i}: device != {tok}"
        logits = dev_eng.step(tok)
    assert decisive >= new_tokens // 2, "too many near ties to judge greedy decoding"
