"""`atlas bench bfcl --mlperf`: MLPerf Edge Agentic's BFCL set (which cases, as its harness
sends them) and its scores (overall and category-balanced), against a scripted atlas serve.

Needs bfcl-eval (`pip install --no-deps bfcl-eval==2026.3.23`; .ci/run installs it)."""

from __future__ import annotations

import json

import pytest

from atlas_cli.bench import bfcl, bfcl_mlperf, gate
from atlas_cli.bench import bfcl_cases as cases
from tests.test_bench_bfcl import TRIANGLE_CALL, bench, fc, scripted_server  # noqa: F401

pytest.importorskip("bfcl_eval")

# What the harness's draw takes of each subset of bfcl-eval 2026.3.23 (its dataset: 995)
DRAWN = {
    "simple_python": 248,  # 62% of 400
    "simple_java": 62,
    "simple_javascript": 31,
    "multiple": 124,
    "parallel": 124,
    "parallel_multiple": 124,
    "live_simple": 25,  # 10% of 258
    "live_multiple": 105,
    "live_parallel": 16,  # 16 <= 25: whole
    "live_parallel_multiple": 24,
    "irrelevance": 24,
    "live_irrelevance": 88,
}


def test_the_draw_is_the_harness_set():
    drawn = bfcl_mlperf.draw()
    assert len(drawn) == sum(DRAWN.values()) == 995
    counts = {}
    for c in drawn:
        counts[c.category] = counts.get(c.category, 0) + 1
    assert counts == DRAWN
    # the first cases of each subset, in BFCL's order
    assert [c.id for c in drawn[:2]] == ["simple_python_0", "simple_python_1"]
    assert drawn[-1].id == cases.load("live_irrelevance", 88)[-1].id
    assert [c.category for c in bfcl_mlperf.draw(limit=1)] == list(DRAWN)


def row(subset: str, valid: bool) -> dict:
    return {"category": subset, "valid": valid}


def test_scores_aggregate_as_the_harness_scorer():
    rows = (
        [row("simple_python", True)] * 3
        + [row("simple_python", False)]  # simple_python 0.75
        + [row("simple_java", False)] * 2  # simple_java 0.0: the simple_* mean is 0.375
        + [row("multiple", True)] * 2  # multiple 1.0
        + [row("live_simple", True)] * 3
        + [row("live_multiple", False)]  # live: 3 of 4 pooled (not the 0.5 subset mean)
        + [row("irrelevance", True)]
        + [row("live_irrelevance", False)] * 3  # hallucination: mean of 1.0 and 0.0
    )
    s = bfcl_mlperf.scores(rows)
    assert s["categories"] == pytest.approx(
        {"non_live": (0.375 + 1.0) / 2, "live": 0.75, "hallucination": 0.5}
    )
    assert s["category_balanced"] == pytest.approx((0.6875 + 0.75 + 0.5) / 3)
    assert s["overall"] == pytest.approx(9 / 16)
    assert s["subsets"]["simple_java"] == 0.0
    empty = bfcl_mlperf.scores([])
    assert empty["overall"] == 0.0 and empty["categories"] == {}


def test_java_and_javascript_answers_are_checked_as_those_languages():
    java = cases.load("simple_java", 1)[0]
    name = "GeometryPresentation_createPresentation"  # "." sent as "_", as FC models see it
    right = fc((name, {"controller": "mapController", "parent": "mapArea"}))
    assert cases.score(java, right, "fc").valid
    assert not cases.score(java, fc((name, {"controller": "x", "parent": "mapArea"})), "fc").valid


def test_the_command_runs_the_set_on_a_scripted_server(scripted_server):  # noqa: F811
    url, engine, tokenizer = scripted_server
    engine.script, engine.prompts = TRIANGLE_CALL, []
    result = bench("scripted", "--url", url, "--mlperf", "--limit", "1", "-o", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [r["category"] for r in doc["cases"]] == list(DRAWN)
    assert list(doc["categories"]) == list(DRAWN)
    m = doc["mlperf"]
    # one call answers everything: right for simple_python_0 alone, wrong for both irrelevances
    assert m["subsets"]["simple_python"] == 1.0 and m["categories"]["hallucination"] == 0.0
    assert m["overall"] == pytest.approx(1 / 12)
    shown = tokenizer.decode(engine.prompts[0])
    assert "calculate_triangle_area" in shown and cases.PYTHON_HINT.strip() not in shown
    result = bench("scripted", "--url", url, "--mlperf", "--limit", "1")
    assert "MLPerf Edge Agentic set: overall 8.33%, category-balanced" in result.stdout


def test_mlperf_flags_that_contradict_the_harness_are_one_line():
    for bad in (
        bfcl.Settings("m", mlperf=True, tool_choice="required"),
        bfcl.Settings("m", mlperf=True, mode="prompt"),
        bfcl.Settings("m", mlperf=True, categories=("simple_python",)),
    ):
        with pytest.raises(bfcl.UsageError, match="--mlperf"):
            bfcl.check_settings(bad)


def test_the_mlperf_rule_holds_the_category_balanced_score_too():
    def doc(overall: float, balanced: float) -> dict:
        tally = {"correct": 0, "total": 995, "accuracy": overall, "protocol_errors": 0}
        scores = {"overall": overall, "category_balanced": balanced}
        return {"kind": "bfcl", "summary": tally, "categories": {}, "mlperf": scores}

    assert gate.mlperf_accuracy(doc(0.5, 0.6), doc(0.5, 0.6)).passed
    assert not gate.mlperf_accuracy(doc(0.5, 0.58), doc(0.5, 0.6)).passed  # 96.7% of 0.6
    assert not gate.mlperf_accuracy(doc(0.48, 0.6), doc(0.5, 0.6)).passed


def test_the_side_by_side_script_applies_the_rule_to_llama_cpp():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bfcl_vs_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bfcl_vs_llamacpp", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ref = {"mlperf": {"overall": 0.5, "category_balanced": 0.6}}
    lines = script.mlperf_lines(
        {
            "atlas": {"mlperf": {"overall": 0.49, "category_balanced": 0.6}},
            "other": {"mlperf": {"overall": 0.6, "category_balanced": 0.58}},  # 96.7%
            "llama.cpp": ref,
        }
    ).splitlines()
    assert lines[0].endswith("= 0.980 / 1.000 of llama.cpp's: PASS")
    assert lines[1].endswith(": FAIL") and lines[2].startswith("llama.cpp: overall 50.00%")
