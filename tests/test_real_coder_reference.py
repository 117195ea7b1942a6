"""Both real coders (Qwen2.5-Coder-0.5B and -1.5B-Instruct GGUF, pulled from the package
index) against two engines nobody here wrote, on 2,048 positions of real prose and code:
transformers in float32 loading the same GGUF file (its own loader dequantizes it) and
llama.cpp's own logits (llama-cpp-python). scripts/make_coder_reference.py wrote what they
said to tests/fixtures/coder/: the ids, and per position each engine's top 32 logits and the
log-sum-exp of its whole row.

Judged as llama.cpp judges its quantised paths: the mean KL divergence from the reference, and
the top-1 agreement where the reference's top two logits are 0.05 or more apart. A KL over
"each of the top 32 tokens, and all the rest as one" is at most the whole row's KL (the
log-sum inequality); the rest holds 11-13% of the mass on this text (printed as `tail`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.real_models import CODERS, pulled
from tests.topk_kl import judged, log_sum_exp

pytestmark = pytest.mark.slow  # 1.6 GB of pulls, then 2,048 positions of each model

FIXTURES = Path(__file__).parent / "fixtures" / "coder"
REF_POSITIONS = 256  # the float32 backend's share: it is the slow one


def coder_logits(path: Path, device: str, ids: list[int]) -> np.ndarray:
    from atlas_cli.session import open_model

    engine = open_model(str(path), device=device, draft=0, ctx_size=len(ids)).engine
    return engine.logits(ids)


@pytest.fixture(scope="module", params=CODERS)
def coder(request):
    reference = np.load(FIXTURES / f"{request.param}.npz")
    return request.param, pulled(request.param), reference


def test_the_float32_backend_is_transformers(coder):
    """cpu-ref on the first 256 positions: transformers' top 32 logits within 1e-4 of the
    largest, and the same log-sum-exp of every row."""
    name, path, reference = coder
    ids = reference["ids"][:REF_POSITIONS].tolist()
    logits = coder_logits(path, "cpu-ref", ids).astype(np.float64)
    top_ids = reference["hf_top_ids"][:REF_POSITIONS]
    want = reference["hf_top_logits"][:REF_POSITIONS].astype(np.float64)
    got = np.take_along_axis(logits, top_ids, -1)
    rel = np.abs(got - want).max() / np.abs(want).max()
    lse_err = np.abs(log_sum_exp(logits) - reference["hf_lse"][:REF_POSITIONS]).max()
    print(f"\n{name} cpu-ref vs transformers: max rel {rel:.2e}, log-sum-exp {lse_err:.2e}")
    assert rel <= 1e-4 and lse_err <= 1e-3 * np.abs(want).max()


def test_the_fast_path_against_transformers_and_llama_cpp(coder):
    """The fast CPU path with its defaults (int8 activations, f16 KV cache) on all 2,048
    positions: KL <= 1e-3 nats and top-1 >= 99% from the float32 reference, and no further
    from it than llama.cpp's own logits of the same file are (on the 1.5B those are 2.0e-3
    from it, so "within 1e-3 of llama.cpp" cannot hold for a path that is near the reference;
    that distance is printed)."""
    name, path, reference = coder
    ids = reference["ids"].tolist()
    logits = coder_logits(path, "cpu", ids)
    atlas = judged(reference, "hf", logits)
    to_llama = judged(reference, "llama", logits)
    print(
        f"\n{name} ({len(ids)} positions): atlas cpu vs transformers KL {atlas['kl']:.2e} "
        f"top-1 {atlas['top1']:.2%} (tail {atlas['tail']:.1e}); "
        f"vs llama.cpp KL {to_llama['kl']:.2e} top-1 {to_llama['top1']:.2%}"
    )
    llama_kl, llama_top1 = reference["llama_vs_hf_kl"], reference["llama_vs_hf_top1"]
    print(f"llama.cpp vs transformers: KL {llama_kl:.2e} top-1 {llama_top1:.2%}")
    assert len(ids) >= 2000
    assert atlas["kl"] <= 1e-3 and atlas["top1"] >= 0.99, atlas
    assert atlas["kl"] <= llama_kl and atlas["top1"] >= llama_top1, (atlas, llama_kl)
