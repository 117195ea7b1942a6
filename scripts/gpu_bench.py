"""The GPU benchmark of the native backend, each number beside the limit it is measured against.

    python scripts/gpu_bench.py --device cuda --out bench.jsonl            # every section
    python scripts/gpu_bench.py --device cuda --only gemv,gemm --out b.jsonl

Sections (each appends its rows to --out as JSON lines, so one that fails or runs out of time
keeps what the others measured; scripts/device-check runs each in its own process):

- `peak`: the device's copy bandwidth (a device-to-device copy, bytes read + written per
  second) and, where PyTorch is there, its bf16 tensor peak (an 8192^3 matrix product): the
  two limits every other row is a fraction of.
- `gemv`: one token (T = 1) and MTP-verify batches (T = 2, 4, 8) through a 16384 x 16384 matrix in
  every weight format; the launches are captured in a graph and replayed, so launch cost does
  not hide the kernel. GB/s counts the weight's bytes (codes + scales); then a `gemv model`
  row per format: benchmarks/gemv_model.py's predicted fraction at T = 1 for the device (H100,
  H200, GB10) and the code compiled for it.
- `gemm`: a 2,048-token prompt chunk through the 27B shape's MLP matrix (17408 x 5120), the
  fast (bf16 operands) and the exact (bf16x3) kernel: TFLOP/s.
- `attention`: prefill (causal, T = S = 2K and 16K) and decode (T = 1 against 2K and 16K
  cached positions) at the 27B shape's attention geometry (24 query heads, 4 KV heads, head dim 256,
  bf16 KV).
- `gdn`: the chunked Gated DeltaNet prefill at the 27B shape (16 key / 48 value heads of 128).
- `qwen27b`: decode tok/s and prefill tok/s at 2K and 16K tokens of the Qwen3.6-27B shape with
  random weights in NVFP4 and Q4_K. Only 4 and 8 of its 64 layers are built (one and two
  3 GDN : 1 attention groups, the real vocabulary and untied head); the 64-layer figure is
  t(4) + 15 (t(8) - t(4)). The roofline is the weight bytes one token reads over the copy
  bandwidth.
- `llama1b`: prefill / decode of a Llama-3.2-1B-like model in three formats.

Numbers are device time (events) or wall time with the stream synchronized.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_cli.backend.ops.native import device as native  # noqa: E402
from atlas_cli.backend.ops.native.placement import to_device  # noqa: E402
from tests.gpu import checks  # noqa: E402

FORMATS = "bf16,q4_0,q4_1,q5_0,q5_1,q8_0,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs,nvfp4"

QWEN27B = dict(  # Qwen3.6-27B's text config (docs/formats.md, "Qwen3.5")
    model_type="qwen3_5",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    partial_rotary_factor=0.25,
    rope_theta=1e7,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)
LLAMA1B = dict(
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


# the sizes above; --tiny swaps in toy ones that check the script on --device emu in seconds
FULL = dict(gemv=16384, tokens=2048, contexts=(2048, 16384), qwen=QWEN27B, llama=LLAMA1B)
TINY = dict(
    gemv=512,
    tokens=64,
    contexts=(64, 128),
    qwen=QWEN27B
    | dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    | dict(num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4)
    | dict(linear_key_head_dim=32, linear_value_head_dim=32),
    llama=LLAMA1B
    | dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    | dict(num_attention_heads=4, num_key_value_heads=2),
)


class Bench:
    def __init__(self, ops, out: Path | None, sizes: dict):
        self.ops, self.out, self.size = ops, out, sizes
        self.peaks = {}
        if out and out.exists():  # the peak section's rows, for the fractions
            for line in out.read_text().splitlines():
                row = json.loads(line)
                self.peaks.update({k: row[k] for k in ("copy GB/s", "bf16 TFLOP/s") if k in row})

    def emit(self, row: dict) -> None:
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def of_copy(self, gbs: float) -> float | None:
        bw = self.peaks.get("copy GB/s")
        return round(gbs / bw, 3) if bw else None

    def of_tensor(self, tflops: float) -> float | None:
        peak = self.peaks.get("bf16 TFLOP/s")
        return round(tflops / peak, 3) if peak else None

    def bandwidth(self, op: str, ms: float, nbytes: float) -> None:
        gbs = nbytes / ms / 1e6
        self.emit(
            {"op": op, "ms": round(ms, 4), "GB/s": round(gbs, 1), "of copy": self.of_copy(gbs)}
        )

    def compute(self, op: str, ms: float, flops: float) -> None:
        tf = flops / ms / 1e9
        row = {"op": op, "ms": round(ms, 3), "TFLOP/s": round(tf, 1)}
        self.emit(row | {"of bf16 peak": self.of_tensor(tf)})

    def device_ms(self, fn, *args, reps: int, graph: bool = True) -> float:
        """Device time of one `fn(*args)`, averaged over `reps` calls captured in one graph (or
        launched back to back), after a warm-up."""
        rt = self.ops.rt
        keep = [fn(*args) for _ in range(reps)]  # compiles; leaves the pool a free block per output
        del keep
        rt.synchronize()
        start, end = rt.event(), rt.event()
        if graph:
            with rt.capture() as g:
                outs = [fn(*args) for _ in range(reps)]
            g.replay()
            rt.synchronize()
            start.record()
            g.replay()
        else:
            start.record()
            outs = [fn(*args) for _ in range(reps)]
        end.record()
        rt.synchronize()
        del outs
        return rt.elapsed_ms(start, end) / reps


def weight_bytes(dw) -> int:
    return dw.rows * dw.row_bytes + dw.rows * dw.srow_bytes


# -- sections -----------------------------------------------------------------------------------


def peak(b: Bench, _formats) -> None:
    if b.ops.rt.name != "cuda":
        return  # the limits are read through cupy and PyTorch, on CUDA
    import cupy as cp

    src = cp.ones(1 << 31 if b.size is FULL else 1 << 20, cp.uint8)
    dst = cp.empty_like(src)
    for _ in range(2):
        dst[...] = src
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        dst[...] = src
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / 10
    row = {
        "op": f"copy {src.nbytes >> 20} MiB d2d",
        "ms": round(ms, 3),
        "copy GB/s": round(2 * src.nbytes / ms / 1e6),
    }
    b.peaks.update(row)
    b.emit(row)
    del src, dst
    try:
        import torch
    except ImportError:
        return
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        a @ a
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1) / 10
    row = {
        "op": "torch bf16 8192^3",
        "ms": round(ms, 3),
        "bf16 TFLOP/s": round(2 * 8192**3 / ms / 1e9),
    }
    b.peaks.update(row)
    b.emit(row)


def gemv_predictions(b: Bench) -> dict[str, float]:
    """benchmarks/gemv_model.py's fraction of copy bandwidth for each format at T = 1, for this
    device (an H100, H200 or GB10) and the code compiled for its target; {} where the model
    does not know the device or the SASS tools are missing."""
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gemv_model

    name = getattr(b.ops.rt, "device_name", "")
    device = next((d for key, d in gemv_model.DEVICES.items() if key in name), None)
    if device is None:
        return {}
    try:
        kernels = gemv_model.compiled_kernels(b.ops.rt.target)
    except (Exception, pytest.skip.Exception) as exc:
        print(f"  (no GEMV model predictions: {exc})")
        return {}
    eta, _ = gemv_model.calibrate()
    return {k.fmt: round(gemv_model.fraction(k, device, eta, b.size["gemv"]), 3) for k in kernels}


def gemv(b: Bench, formats) -> None:
    ops, rng, n = b.ops, np.random.default_rng(0), b.size["gemv"]
    for fmt in formats:
        dw = ops.prepare_weight(checks.random_weight(fmt, n, n, rng, reference=False)[0])
        for t in (1, 2, 4, 8):  # 2..8: gemv_t8, an MTP verify
            x = ops.asarray(rng.standard_normal((t, n)).astype(np.float32))
            ms = b.device_ms(ops.linear, x, dw, reps=20)
            b.bandwidth(f"gemv {fmt} T={t} {n}x{n}", ms, weight_bytes(dw))
        del dw
    # last, so a section cut off by its time limit keeps the measurements
    for fmt, fraction in gemv_predictions(b).items():
        if fmt in formats:
            b.emit({"op": f"gemv model {fmt} T=1 {n}x{n}", "predicted of copy": fraction})


def gemv_blocks(b: Bench, formats) -> None:
    """gemv.cu compiled for 1, 3 and 4 resident blocks per SM (GEMV_MIN_BLOCKS: fewer registers,
    more warps in flight), T = 1, each format."""
    ops, rng, n = b.ops, np.random.default_rng(0), b.size["gemv"]
    x = ops.asarray(rng.standard_normal((1, n)).astype(np.float32))
    for fmt in formats:
        dw = ops.prepare_weight(checks.random_weight(fmt, n, n, rng, reference=False)[0])
        for blocks in (1, 3, 4):
            fn = ops.rt.compile("gemv.cu", {"GEMV_MIN_BLOCKS": blocks}).function(f"gemv_{fmt}")

            def run(fn=fn, dw=dw):
                out = ops.empty((1, dw.rows))
                ops.rt.launch(fn, (-(-dw.rows // 8),), (256,), ops._linear_args(x, dw, None, out))
                return out

            ms = b.device_ms(run, reps=20)
            b.bandwidth(f"gemv {fmt} T=1 {n}x{n} GEMV_MIN_BLOCKS={blocks}", ms, weight_bytes(dw))
        del dw


def gemm(b: Bench, formats) -> None:
    ops, rng = b.ops, np.random.default_rng(1)
    cfg, t = b.size["qwen"], b.size["tokens"]
    rows, cols = cfg["intermediate_size"], cfg["hidden_size"]
    x = ops.asarray(rng.standard_normal((t, cols)).astype(np.float32))
    for fmt in formats:
        dw = ops.prepare_weight(checks.random_weight(fmt, rows, cols, rng, reference=False)[0])
        for kind in ("fast", "exact"):  # gemm_fast.cu (bf16 operands) and gemm.cu (bf16x3)
            ms = b.device_ms(ops.gemm, x, dw, None, None, None, kind, reps=5)
            b.compute(f"gemm {kind} {fmt} T={t} {rows}x{cols}", ms, 2 * t * rows * cols)
        del dw


def attention(b: Bench, _formats) -> None:
    from atlas_cli.backend.ops.native.attention import KVCache

    ops, rng = b.ops, np.random.default_rng(2)
    cfg = b.size["qwen"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    for s in b.size["contexts"]:
        cache = KVCache(ops, 1, nkv, hd, s + 1, "bf16", 1.0, 1.0)
        cache.reserve(s + 1)
        k = ops.asarray(rng.standard_normal((s, nkv, hd)).astype(np.float32))
        kv, vv = cache.update(0, 0, k, k)
        q = ops.asarray(rng.standard_normal((s, nh, hd)).astype(np.float32))
        ms = b.device_ms(ops.attention, q, kv, vv, 0, reps=3, graph=False)
        # QK^T and PV: 2 * 2 * T * S * hd per head, half of it under the causal mask
        b.compute(f"attention prefill bf16 T=S={s}", ms, 2 * nh * hd * s * s)
        q1 = ops.asarray(rng.standard_normal((1, nh, hd)).astype(np.float32))
        ms = b.device_ms(ops.attention, q1, kv, vv, s - 1, reps=20)
        b.bandwidth(f"attention decode bf16 S={s}", ms, 2 * nkv * s * hd * 2)  # K and V, bf16
        del cache, k, q, kv, vv


def gdn(b: Bench, _formats) -> None:
    ops, rng = b.ops, np.random.default_rng(3)
    cfg = b.size["qwen"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    for t in b.size["contexts"]:
        q = checks._l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
        k = checks._l2(rng.standard_normal((t, nk, dk)).astype(np.float32))
        v = rng.standard_normal((t, nv, dv)).astype(np.float32)
        g = -rng.uniform(0.01, 1.0, (t, nv)).astype(np.float32)
        beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
        args = [ops.asarray(a) for a in (q, k, v, g, beta, np.zeros((nv, dk, dv), np.float32))]
        ms = b.device_ms(ops.gated_delta_rule_chunked, *args, reps=3, graph=False)
        b.emit(
            {"op": f"gdn chunked prefill T={t}", "ms": round(ms, 3), "tok/s": round(t / ms * 1e3)}
        )


def _model_class(cfg: dict, layers: int):
    """The model class for `cfg` and its arguments with `layers` layers."""
    from atlas_cli.backend import MODEL_CLASSES

    module_name, cls_name = MODEL_CLASSES[cfg["model_type"]]
    module = __import__(module_name, fromlist=[cls_name])
    return getattr(module, cls_name), module.ModelArgs.from_config(
        {**cfg, "num_hidden_layers": layers}
    )


def _random_model(b: Bench, cfg: dict, fmt: str, layers: int, rng) -> tuple[dict, int]:
    """Device weights of `layers` layers of `cfg` in `fmt` (norms and vectors float32), and the
    bytes one decoded token reads from the matrices (the embedding row aside)."""
    cls, args = _model_class(cfg, layers)
    shapes, optional = cls.weight_shapes(args, set())
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = optional["lm_head.weight"]
    w, read = {}, 0
    for name, accepted in shapes.items():
        shape = accepted[0]
        if len(shape) == 2 and name.endswith(".weight") and "conv1d" not in name:
            q = checks.random_weight(fmt, *shape, rng, reference=False)[0]
            w[name] = to_device(b.ops, name, q)
            read += 0 if "embed" in name else weight_bytes(w[name])
        else:
            w[name] = to_device(b.ops, name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    return w, read


def _throughput(b, cfg, w, layers, prompts, decode: int = 32) -> dict:
    """Seconds per decoded token and per prompt of each length, for `layers` layers of `w`."""
    from atlas_cli.backend.engine import Engine

    cls, args = _model_class(cfg, layers)
    model = cls(args, dict(w), b.ops)
    rng = np.random.default_rng(4)
    engine = Engine(model, None, max(prompts) + decode + 8)
    engine.prefill(list(rng.integers(0, cfg["vocab_size"], 16)))  # compile, first touch
    b.ops.rt.synchronize()
    out = {}
    for n in sorted(prompts, reverse=True):  # decode below follows the shortest prompt
        engine.reset()
        ids = list(rng.integers(0, cfg["vocab_size"], n))
        t0 = time.perf_counter()
        logits, _ = engine.prefill(ids)
        tok = b.ops.argmax(logits)
        out[n] = time.perf_counter() - t0
    for _ in range(4):  # warm the fused step's graph
        tok = b.ops.argmax(engine.step(tok))
    t0 = time.perf_counter()
    for _ in range(decode):
        tok = b.ops.argmax(engine.step(tok))
    b.ops.rt.synchronize()
    out["decode"] = (time.perf_counter() - t0) / decode
    return out


def qwen27b(b: Bench, formats) -> None:
    cfg, prompts = b.size["qwen"], b.size["contexts"]
    for fmt in [f for f in formats if f in ("nvfp4", "q4_k")] or ["nvfp4"]:
        rng = np.random.default_rng(5)
        w8, read8 = _random_model(b, cfg, fmt, 8, rng)
        t8 = _throughput(b, cfg, w8, 8, prompts)
        t4 = _throughput(b, cfg, w8, 4, prompts)
        # bytes per token of 64 layers: the 8-layer model's, plus 14 more groups of 4 layers
        head = weight_bytes(w8["lm_head.weight"])
        read64 = head + (read8 - head) * 8
        full = {k: t4[k] + 15 * (t8[k] - t4[k]) for k in t8}
        tok_s = 1 / full["decode"]
        bw = b.peaks.get("copy GB/s")
        row = {
            "op": f"qwen3.6-27b shape {fmt} (64 layers from 4 and 8)",
            "decode tok/s": round(tok_s, 2),
            "weights GB/token": round(read64 / 1e9, 2),
            "roofline tok/s": round(bw * 1e9 / read64, 2) if bw else None,
            "of roofline": round(tok_s * read64 / (bw * 1e9), 3) if bw else None,
        }
        row |= {f"pp{n} tok/s": round(n / full[n], 1) for n in prompts}
        row |= {
            "8 layers decode ms": round(t8["decode"] * 1e3, 2),
            "4 layers decode ms": round(t4["decode"] * 1e3, 2),
        }
        b.emit(row)
        del w8


def llama1b(b: Bench, formats) -> None:
    cfg = b.size["llama"]
    for fmt in [f for f in formats if f in ("bf16", "q4_k", "nvfp4")]:
        w, _ = _random_model(b, cfg, fmt, cfg["num_hidden_layers"], np.random.default_rng(6))
        t = _throughput(b, cfg, w, cfg["num_hidden_layers"], (512,), decode=64)
        b.emit(
            {
                "op": f"llama-1B {fmt}",
                "prefill tok/s": round(512 / t[512], 1),
                "decode tok/s": round(1 / t["decode"], 1),
            }
        )


SECTIONS = {
    f.__name__: f for f in (peak, gemv, gemv_blocks, gemm, attention, gdn, qwen27b, llama1b)
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines, appended")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections: " + ",".join(SECTIONS))
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--tiny", action="store_true", help="toy sizes (a check of the script)")
    a = ap.parse_args()
    ops = native.open_device(a.device)
    ops.poison = False  # timings, not checks: no NaN fills in captured graphs
    b = Bench(ops, a.out, TINY if a.tiny else FULL)
    t0 = time.perf_counter()
    info = ops.warmup()
    row = {"op": "compile all kernels", "s": round(time.perf_counter() - t0, 2)}
    row |= {"cache hits": info["cache_hits"], "target": info["target"]}
    if info["compiled"]:  # the first process compiles; the others load the cache
        b.emit(row)
    formats = a.formats.split(",")
    for name in a.only.split(","):
        t0 = time.perf_counter()
        SECTIONS[name](b, formats)
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
