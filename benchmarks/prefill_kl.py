"""How far a rounding prefill GEMM moves a real model's logits, judged as llama.cpp judges its
quantized paths: mean KL divergence and top-1 agreement outside near ties over the positions of
real text, on the CPU emulator of the kernels (no GPU needed; slow: ~2 s a token for 0.5B).

    python benchmarks/prefill_kl.py MODEL_FILE --kind fast --positions 512
    python benchmarks/prefill_kl.py MODEL_FILE --kind fp4 --nvfp4 --positions 128

`--kind fast` (gemm_fast.cu, bf16 operands) is compared with `cpu-ref`, the float32 reference.
`--nvfp4` first quantizes every projection matrix whose rows are whole 128-column steps to
NVFP4 (modelopt's recipe: global scale amax / 2688, E4M3 per 16, E2M1), as an NVFP4 checkpoint
holds them; the reference is then the emulator's float32-exact GEMM on those same weights, so
`--kind fp4` measures what quantizing x to NVFP4 (W4A4) costs. The text is the given files
(default: this repository's docs and sources: code and prose).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from atlas_cli.backend import load  # noqa: E402
from atlas_cli.backend.ops.native import placement, runtime_emu  # noqa: E402
from atlas_cli.backend.ops.native.device import NativeOps  # noqa: E402
from atlas_cli.backend.requantize import requantize  # noqa: E402
from tests.test_gemm_fast_models import DECIDED, log_softmax  # noqa: E402

TEXT = ["docs/architecture.md", "atlas_cli/backend/ops/native/weights.py", "README.md"]


def quantize_projections() -> None:
    """From here on, models load with their projections in NVFP4 (see the top)."""
    real = placement.to_device

    def to_device(ops, name, w):
        shape = getattr(w, "shape", ())
        if name.endswith("proj.weight") and len(shape) == 2 and shape[1] % 128 == 0:
            w = requantize(w.dequantize() if hasattr(w, "dequantize") else w, "nvfp4")
        return real(ops, name, w)

    placement.to_device = to_device


def emu_logits(path: Path, kind: str, ids: np.ndarray) -> np.ndarray:
    cache = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache.mkdir(exist_ok=True)
    ops = NativeOps(runtime_emu.EmuRuntime(cache), kv_dtype="f32", prefill=kind)
    return np.asarray(load(path, device="emu", ops=ops).engine.logits(ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a GGUF file or a Hugging Face directory")
    p.add_argument("--kind", default="fast", choices=("fast", "fp4"))
    p.add_argument("--nvfp4", action="store_true", help="quantize the projections first")
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--text", nargs="*", type=Path, default=[REPO / t for t in TEXT])
    args = p.parse_args()
    if args.nvfp4:
        quantize_projections()
    text = "\n".join(t.read_text() for t in args.text)
    reference = load(args.model, device="cpu-ref")
    ids = np.array(reference.engine.tokenizer.encode(text)[: args.positions])
    t0 = time.perf_counter()
    if args.nvfp4:  # the same NVFP4 weights, multiplied exactly
        want = emu_logits(args.model, "exact", ids)
    else:
        want = np.asarray(reference.engine.logits(ids))
    got = emu_logits(args.model, args.kind, ids)
    lp, lq = log_softmax(want), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    top2 = np.sort(want, -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= DECIDED
    agree = (want.argmax(-1) == got.argmax(-1))[decided]
    base = "exact GEMM on the NVFP4 weights" if args.nvfp4 else "cpu-ref"
    print(
        f"{args.model.name}: {args.kind} against {base}, {len(kl)} positions "
        f"({time.perf_counter() - t0:.0f} s): mean KL {kl.mean():.2e} nats (max {kl.max():.2e}), "
        f"top-1 {agree.mean():.2%} of {decided.sum()} decided positions"
    )


if __name__ == "__main__":
    main()
