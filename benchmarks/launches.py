"""What one decode token and one 512-token prefill chunk ask of the device, for a model of a
real shape on the native launchers: kernel launches, host<->device copies and their bytes,
syncs, and the weight bytes the kernels read.

    python benchmarks/launches.py --shape qwen3.6-27b [--format nvfp4|bf16|q4_k] [--by-kernel]

The model runs on the counting runtime (backend/ops/native/runtime_count.py): nothing is computed
and no weight exists anywhere. Each weight matrix is a `DeviceWeight` of its stored format's row
layout over a fake device buffer, built from the model class's own `weight_shapes`, so peak
memory stays small even for the 27B shape (the real upload path, `prepare_weight`, would first
make the bytes contiguous on the host). Only the small vectors (norms, biases, conv and decay
vectors) are real arrays, uploaded as a load would upload them.

The decode token is measured through `Engine.generate` (what `atlas run` does per token,
sampling and the finite check included), the prefill chunk as one 512-token forward plus the
last row's logits (the engine itself prefills in PREFILL_CHUNK pieces).
"""

from __future__ import annotations

import argparse
import importlib
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_cli.backend import MODEL_CLASSES  # noqa: E402
from atlas_cli.backend import formats as F  # noqa: E402
from atlas_cli.backend.engine import Engine  # noqa: E402
from atlas_cli.backend.ops.native.array import DeviceWeight  # noqa: E402
from atlas_cli.backend.ops.native.device import NativeOps  # noqa: E402
from atlas_cli.backend.ops.native.runtime_count import CountingRuntime, Counts  # noqa: E402
from atlas_cli.backend.sample import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Shape:
    source: str  # where the numbers come from
    config: dict[str, Any]


# The language model's values from each checkpoint's Hugging Face config.json.
SHAPES = {
    "qwen3.6-27b": Shape(
        "Qwen/Qwen3.6-27B config.json, text_config",
        {
            "model_type": "qwen3_5_text",
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 248320,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "mtp_num_hidden_layers": 1,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
        },
    ),
    "qwen3-8b": Shape(
        "Qwen/Qwen3-8B config.json",
        {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
        },
    ),
    "llama3.2-1b": Shape(
        "meta-llama/Llama-3.2-1B config.json",
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}

# --format -> (the projections' format, the embedding table's and lm_head's). NVFP4 ModelOpt
# checkpoints keep the embedding and lm_head in bf16; llama.cpp's Q4_K_M keeps them in Q6_K.
FORMATS = {
    "nvfp4": (F.NVFP4, F.BF16),
    "bf16": (F.BF16, F.BF16),
    "q4_k": (F.Q4_K, F.Q6_K),
}
PREFILL = 512
DECODE_TOKENS = 4  # decode steps averaged over


class PlaceholderTokenizer:
    """What `Engine` asks of a tokenizer, for a model with no vocabulary: no stop tokens (so a
    generation runs its full length) and empty text."""

    stop_ids = frozenset()
    bos_id = 0

    def decode(self, ids) -> str:
        return ""


def shape_weight(rt: CountingRuntime, fmt: F.WeightFormat, rows: int, cols: int):
    """A DeviceWeight of `fmt`'s row layout over fake buffers, marked as weight bytes."""
    assert cols % fmt.block_elems == 0, f"{fmt.name}: {cols} columns are not whole blocks"
    code_bytes, scale_bytes = fmt.device_block_bytes
    if fmt is F.NVFP4:
        scale_bytes = 1  # one E4M3 code per block
    row_bytes = cols // fmt.block_elems * code_bytes
    data = rt.alloc(rows * row_bytes)
    rt.mark_weight(data, row_bytes)
    scales, srow_bytes = rt.alloc(16), cols // fmt.block_elems * scale_bytes
    if srow_bytes:
        scales = rt.alloc(rows * srow_bytes)
        rt.mark_weight(scales, srow_bytes)
    return DeviceWeight(fmt.kernel, rows, cols, data, row_bytes, scales, srow_bytes, 1.0)


def build(shape: str, fmt: str = "nvfp4", seed: int = 0, graph: bool = True):
    """(model, ops, runtime) for `shape` with placeholder weights on a CountingRuntime;
    `graph`: whether the fused decode step replays a captured graph."""
    spec = SHAPES[shape]
    module_name, cls_name = MODEL_CLASSES[spec.config["model_type"]]
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name)
    args = module.ModelArgs.from_config(spec.config)
    rt = CountingRuntime()
    ops = NativeOps(rt, kv_dtype="bf16")
    ops.fuse_graphs = graph
    proj, table = FORMATS[fmt]
    names = {"mtp.fc.weight"} if getattr(args, "mtp_num_hidden_layers", 0) else set()
    required, _ = cls.weight_shapes(args, names)
    if not args.tie_word_embeddings:
        required["lm_head.weight"] = [(args.vocab_size, args.hidden_size)]
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shapes in required.items():
        dims = shapes[0]
        if len(dims) == 2 and name.endswith(".weight") and "conv1d" not in name:
            wide = "embed_tokens" in name or name == "lm_head.weight"
            weights[name] = shape_weight(rt, table if wide else proj, *dims)
        else:
            weights[name] = ops.asarray(rng.standard_normal(dims).astype(np.float32) * 0.1)
    return cls(args, weights, ops), ops, rt


def per(counts: Counts, n: int) -> dict[str, float]:
    return {k: v / n for k, v in counts.summary().items()}


def measure_decode(
    shape: str,
    fmt: str = "nvfp4",
    tokens: int = DECODE_TOKENS,
    sampling=None,
    graph: bool = True,
):
    """Counts per decode token, through Engine.generate, MTP drafting off; with the by-kernel
    launch counts of one token under "by_kernel" (launches outside graphs) and the counts of
    the prompt's prefill and first token under "first"."""
    model, _, rt = build(shape, fmt, graph=graph)
    engine = Engine(model, PlaceholderTokenizer(), 64, draft=0, cache_bytes=0)
    gen = engine.generate(
        [1, 2, 3, 4], max_tokens=1 + tokens, sampling=sampling or SamplingParams(temperature=0)
    )
    with rt.phase("first") as first:
        next(gen)  # the prompt's prefill and the first token
    with rt.phase("decode") as counts:
        for _ in range(tokens):
            next(gen)
    result: dict[str, Any] = per(counts, tokens)
    result["by_kernel"] = {k: v / tokens for k, v in sorted(counts.launches.items())}
    result["first"] = per(first, 1)
    return result


def measure_prefill(shape: str, fmt: str = "nvfp4", chunk: int = PREFILL) -> dict[str, float]:
    """Counts for one `chunk`-token forward from position 0 plus the last row's logits."""
    model, _, rt = build(shape, fmt)
    cache = model.new_cache(chunk)
    cache.reserve(chunk)
    ids = np.arange(chunk, dtype=np.int64) % model.args.vocab_size
    with rt.phase("prefill") as counts:
        hidden = model.forward(ids, cache, 0)
        np.asarray(model.logits(hidden[chunk - 1 :]))
    return per(counts, 1)


def peak_rss_mib() -> float:
    """This program's own peak: VmHWM belongs to the address space exec made, while ru_maxrss
    keeps the high-water mark of the process that forked it (a test runner's gigabytes)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(x for x in f if x.startswith("VmHWM")).split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


ROWS = (
    ("launches", "kernel launches"),
    ("h2d", "host->device copies"),
    ("h2d_bytes", "  bytes"),
    ("d2h", "device->host copies"),
    ("d2h_bytes", "  bytes"),
    ("d2d", "device->device copies"),
    ("d2d_bytes", "  bytes"),
    ("syncs", "synchronize calls"),
    ("graph_launches", "graph launches"),
    ("graph_kernels", "  kernels inside them"),
    ("weight_bytes", "weight bytes read"),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    parser.add_argument("--format", choices=sorted(FORMATS), default="nvfp4")
    parser.add_argument("--by-kernel", action="store_true", help="decode launches per kernel")
    parser.add_argument(
        "--no-graph", action="store_true", help="the fused decode step as direct launches"
    )
    opts = parser.parse_args(argv)
    decode = measure_decode(opts.shape, opts.format, graph=not opts.no_graph)
    prefill = measure_prefill(opts.shape, opts.format)
    print(f"{opts.shape} ({SHAPES[opts.shape].source}), {opts.format} weights")
    print(f"{'':24}{'per decode token':>20}{f'per {PREFILL}-token prefill':>26}")
    for key, label in ROWS:
        print(f"{label:24}{decode[key]:>20,.1f}{prefill[key]:>26,.1f}")
    if opts.by_kernel:
        for name, n in sorted(decode["by_kernel"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:40}{n:>8,.1f}")
    print(f"peak RSS {peak_rss_mib():,.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
