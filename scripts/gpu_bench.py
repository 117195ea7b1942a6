"""A short GPU benchmark of the native backend: GEMV bandwidth per weight format, and prefill /
decode throughput of a synthetic ~1B Llama (random weights, so no download) in each format.

    python scripts/gpu_bench.py --device cuda --out results.json

Prints a table; numbers are wall-clock with the stream synchronized. Run by scripts/device-check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_cli.backend.ops import native  # noqa: E402
from tests.gpu import checks  # noqa: E402

BENCH_CONFIG = dict(  # Llama-3.2-1B-like geometry
    model_type="llama",
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def gemv_bandwidth(ops, fmt: str, rows: int = 8192, cols: int = 8192, reps: int = 20) -> dict:
    rng = np.random.default_rng(0)
    w, _ = checks.random_weight(fmt, rows, cols, rng, reference=False)
    dw = ops.prepare_weight(w)
    x = ops.asarray(rng.standard_normal((1, cols)).astype(np.float32))
    ops.linear(x, dw)
    ops.rt.synchronize()
    start, end = ops.rt.event(), ops.rt.event()
    start.record()
    for _ in range(reps):
        ops.linear(x, dw)
    end.record()
    ms = ops.rt.elapsed_ms(start, end) / reps
    nbytes = dw.rows * dw.row_bytes + dw.rows * dw.srow_bytes
    return {
        "op": f"gemv {fmt} {rows}x{cols}",
        "ms": round(ms, 4),
        "GB/s": round(nbytes / ms / 1e6, 1),
    }


def model_throughput(ops, fmt: str, prompt: int = 512, decode: int = 64) -> dict:
    from atlas_cli.backend.engine import Engine
    from atlas_cli.backend.models.llama import LlamaModel, ModelArgs

    rng = np.random.default_rng(1)
    cfg = BENCH_CONFIG
    args = ModelArgs.from_config(cfg)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {
        "self_attn.q_proj": (nh * hd, h),
        "self_attn.k_proj": (nkv * hd, h),
        "self_attn.v_proj": (nkv * hd, h),
        "self_attn.o_proj": (h, nh * hd),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    w = {
        "model.embed_tokens.weight": ops.prepare_weight(
            checks.random_weight(fmt, cfg["vocab_size"], h, rng, False)[0]
        ),
        "model.norm.weight": ops.asarray(np.ones(h, np.float32)),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ops.asarray(np.ones(h, np.float32))
        w[p + "post_attention_layernorm.weight"] = ops.asarray(np.ones(h, np.float32))
        for name, (r, c) in shapes.items():
            w[p + name + ".weight"] = ops.prepare_weight(
                checks.random_weight(fmt, r, c, rng, False)[0]
            )
    engine = Engine(LlamaModel(args, w, ops), None, prompt + decode + 8)
    ids = list(rng.integers(0, cfg["vocab_size"], prompt))
    engine.prefill(ids[:16])  # warm-up: compile and first-touch
    ops.rt.synchronize()
    engine.reset()
    t0 = time.perf_counter()
    logits, _ = engine.prefill(ids)
    tok = ops.argmax(logits)
    t1 = time.perf_counter()
    for _ in range(decode):
        tok = ops.argmax(engine.step(tok))
    ops.rt.synchronize()
    t2 = time.perf_counter()
    return {
        "op": f"llama-1B {fmt}",
        "prefill tok/s": round(prompt / (t1 - t0), 1),
        "decode tok/s": round(decode / (t2 - t1), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--formats", default="bf16,q4_0,q4_1,q8_0,q4_k,q5_k,q6_k,nvfp4")
    ap.add_argument("--model-formats", default="bf16,q4_k,nvfp4")
    a = ap.parse_args()
    ops = native.open_device(a.device)
    t0 = time.perf_counter()
    info = ops.warmup()
    rows = [
        {
            "op": "compile all kernels",
            "s": round(time.perf_counter() - t0, 2),
            "cache hits": info["cache_hits"],
            "target": info["target"],
        }
    ]
    for fmt in a.formats.split(","):
        rows.append(gemv_bandwidth(ops, fmt))
        print(rows[-1], flush=True)
    for fmt in a.model_formats.split(","):
        rows.append(model_throughput(ops, fmt))
        print(rows[-1], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print()
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
