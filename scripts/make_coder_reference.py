"""Reference logits of a real GGUF file from two engines nobody here wrote, for
tests/test_real_coder_reference.py: transformers (float32, its own GGUF loader dequantizes the
file) and llama.cpp (llama-cpp-python, `logits_all`). Run with an environment that has torch,
transformers, gguf and llama-cpp-python (CI does not: the test only reads what this writes):

    PY scripts/make_coder_reference.py --gguf FILE --out tests/fixtures/coder/NAME.npz

The text is real prose and code: the first half of --positions tokens of this project's
docs/architecture.md, then as many of atlas_cli/backend/layers.py, tokenized by transformers'
tokenizer from the same file; the ids are stored, so later edits of those files change nothing.

Every row keeps the top --top-k logits of each engine (ids and float32 values) and the log of
the sum of the exponentials of the whole row (float64): what a KL divergence over "each of the
top k, and the rest" needs (tests/topk_kl.py). A whole row is 151,936 floats; 2,048 of them
would be 1.2 GB. `llama_vs_hf_*`: llama.cpp's own KL and top-1 from transformers, measured so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.topk_kl import judged, log_sum_exp  # noqa: E402

TEXT_FILES = ("docs/architecture.md", "atlas_cli/backend/layers.py")


def top_rows(logits: np.ndarray, k: int) -> dict[str, np.ndarray]:
    logits = logits.astype(np.float64)
    ids = np.argpartition(-logits, k, axis=-1)[:, :k]  # a whole-row sort takes minutes
    ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(logits, ids, -1), -1), -1)
    return {
        "top_ids": ids.astype(np.int32),
        "top_logits": np.take_along_axis(logits, ids, -1).astype(np.float32),
        "lse": log_sum_exp(logits),
    }


def transformers_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].numpy()


def llama_cpp_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_ctx=len(ids),
        n_batch=512,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=32)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    half = args.positions // len(TEXT_FILES)
    ids = []
    for name in TEXT_FILES:
        part = tokenizer((ROOT / name).read_text())["input_ids"][:half]
        if len(part) < half:
            raise SystemExit(f"{name} has only {len(part)} tokens")
        ids += part

    arrays: dict[str, np.ndarray] = {"ids": np.asarray(ids, np.int32)}
    for engine, run in (("hf", transformers_logits), ("llama", llama_cpp_logits)):
        t0 = time.time()
        logits = run(args.gguf, ids)
        print(f"{engine}: {logits.shape} in {time.time() - t0:.0f} s", file=sys.stderr)
        arrays |= {f"{engine}_{k}": v for k, v in top_rows(logits, args.top_k).items()}
        if engine == "llama":  # llama.cpp's own distance from transformers, for comparison
            for k, v in judged(arrays, "hf", logits).items():
                arrays[f"llama_vs_hf_{k}"] = np.float64(v)
        del logits
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
