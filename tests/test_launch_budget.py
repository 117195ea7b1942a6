"""The decode step's launch budget (issue: one host sync per token, fewer, fatter launches),
counted on the counting runtime for models of real shapes with placeholder weights
(benchmarks/launches.py), and the counting itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.ops.native.device import NativeOps
from atlas_cli.backend.ops.native.runtime_count import CountingRuntime

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import launches  # noqa: E402

# One 27B-shape decode token, at most (the budget; or a single graph launch).
BUDGET = {"launches": 400, "h2d": 0, "d2h": 1, "d2h_bytes": 64, "syncs": 0}


@pytest.fixture(scope="module")
def decode_27b():
    return launches.measure_decode("qwen3.6-27b", "nvfp4")


@pytest.fixture(scope="module")
def decode_27b_direct():
    """The fused decode step as direct launches, no graph."""
    return launches.measure_decode("qwen3.6-27b", "nvfp4", graph=False)


def within_budget(c) -> bool:
    return all(c[k] <= v for k, v in BUDGET.items())


def test_27b_decode_token_meets_the_launch_budget(decode_27b):
    """Replayed as a graph: one graph launch, the lm_head and the sampler outside it."""
    assert within_budget(decode_27b), {k: decode_27b[k] for k in BUDGET}
    assert decode_27b["graph_launches"] == 1 and decode_27b["launches"] == 2


def test_27b_decode_token_meets_it_without_a_graph_too(decode_27b_direct):
    assert within_budget(decode_27b_direct), {k: decode_27b_direct[k] for k in BUDGET}


def test_27b_decode_token_counts_as_measured(decode_27b_direct, decode_27b):
    """The fused step's numbers, pinned, so the counter and the tool are held to something:
    a change in the decode step shows up here (update the numbers with the change)."""
    c = decode_27b_direct
    assert c["launches"] == 339  # 1 + 48 GDN x 5 + 16 attention x 6 + lm_head + sampler
    by = c["by_kernel"]
    assert by["dgemv_nvfp4"] == 256  # 64 layers x (input projections, output, gate/up, down)
    assert by["gdn_decode"] == 48 and by["qk_rope_kv_bf16"] == 16 and by["attn_bf16_hd256"] == 16
    assert by["sample_chain"] == 1  # sampling on the device ...
    assert c["d2h"] == 1 and c["d2h_bytes"] == 8  # ... and only the token and its flag back
    assert c["h2d"] == 0 and c["syncs"] == 0 and c["graph_launches"] == 0
    assert c["d2d"] == 1 and c["d2d_bytes"] == 4  # the sampled id into the next step's input
    # the graph runs the same kernels and reads the same weights: every matrix once a token
    assert decode_27b["graph_kernels"] + decode_27b["launches"] == c["launches"]
    assert decode_27b["weight_bytes"] == c["weight_bytes"] > 15.9e9


def test_the_first_token_reads_back_only_the_token(decode_27b):
    """Building the fused step (on the first token) reads nothing back from the device: the
    weights it derives (Qwen3.5's 1 + w norms) are formed at load."""
    first = decode_27b["first"]
    assert first["d2h"] == 1 and first["d2h_bytes"] == 8, first


def test_host_sampling_reads_the_logits_back_twice():
    """What the device sampler saves: with a grammar-free setting sample.cu does not take
    (top-k off), the CPU Sampler's path reads the whole logits row twice per token."""
    from atlas_cli.backend.sample import SamplingParams

    c = launches.measure_decode("llama3.2-1b", "bf16", 2, SamplingParams(top_k=0, seed=1))
    assert c["d2h"] == 2 and c["d2h_bytes"] == 2 * 128256 * 4  # check_finite, then Sampler
    assert "sample_chain" not in c["by_kernel"]


def test_weight_bytes_read_are_every_matrix_once_per_token():
    """llama3.2-1b, bf16, tied embeddings: the projections and the tied table (as lm_head)
    once each, plus one embedding row."""
    c = launches.SHAPES["llama3.2-1b"].config
    h, ff, nl, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ff
    want = 2 * (nl * per_layer + v * h + h)
    got = launches.measure_decode("llama3.2-1b", "bf16", tokens=2, graph=False)
    assert got["weight_bytes"] == want
    # the fused step: per layer the q/k/v, o, gate/up and down GEMVs, then the lm_head
    assert got["launches"] == 99 and got["by_kernel"]["dgemv_bf16"] == 16 * 4 + 1


@pytest.mark.parametrize("shape", ["qwen3-8b", "llama3.2-1b"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "direct"])
def test_attention_only_models_meet_the_budget_too(shape, graph):
    """Llama and Qwen3 run the fused device step built from their declaration, as the 27B
    does: one graph launch (or one launch per fused kernel), the token the only copy back,
    nothing uploaded, also on the first token."""
    c = launches.measure_decode(shape, "bf16", graph=graph)
    assert within_budget(c), {k: c[k] for k in BUDGET}
    n_layers = launches.SHAPES[shape].config["num_hidden_layers"]
    # the embedding; per layer the q/k/v GEMV, q/k norms + RoPE + KV store, attention, the
    # o GEMV, the gate/up GEMV, the down GEMV; the lm_head; the sampler
    assert c["launches"] == (2 if graph else 1 + 6 * n_layers + 2)
    assert c["first"]["d2h"] == 1 and c["first"]["d2h_bytes"] == 8


def test_counting_runtime_counts_copies_launches_and_syncs():
    rt = CountingRuntime()
    ops = NativeOps(rt)
    with rt.phase("x") as counts:
        a = ops.asarray(np.ones(10, np.float32))  # one upload of 40 bytes
        b = a.copy()  # one device copy
        out = (a + b).numpy()  # one launch, one readback (zeros: nothing was computed)
        rt.synchronize()
        with rt.capture() as graph:
            ops.fill(b, 1.0)  # captured: not a launch of its own
        graph.replay()
    assert (counts.h2d, counts.h2d_bytes, counts.d2d, counts.d2d_bytes) == (1, 40, 1, 40)
    assert counts.launches == {"binary": 1} and (counts.d2h, counts.d2h_bytes) == (1, 40)
    assert counts.syncs == 1 and counts.graph_launches == 1 and counts.graph_kernels == 1
    assert not out.any()
    assert rt.alloc(1).ptr != rt.alloc(1).ptr


def test_the_script_prints_the_counts_without_materialising_the_27b_weights():
    """From the command line; the 27B model's ~16 GB of NVFP4 weights (2.5 GB of bf16
    embedding table alone) never exist on the host."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "launches.py"), "--shape", "qwen3.6-27b"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "kernel launches" in out and "weight bytes read" in out
    rss = float(out.rsplit("peak RSS", 1)[1].split()[0].replace(",", ""))
    assert rss < 1024, out
