"""The MLPerf Inference v6.1 Edge Agentic accuracy set for `atlas bench bfcl --mlperf`: which
BFCL v4 cases it holds and how it scores them (mlcommons/endpoints: its `BFCLv4SingleTurn`
dataset and `bfcl_v4` scorer).

The draw: the single-turn categories non_live, live and hallucination; each subset sampled at
its category's rate (62%, 10%, 10%), a subset of at most 25 cases taken whole; the first n
cases of each subset in BFCL's own order (no seed), n = max(1, int(total * rate / 100)). With
bfcl-eval 2026.3.23 that is 995 cases. Each case is sent as the harness sends it: the question
turns flattened (a null content as ""), the functions as OpenAI tools without BFCL's language
hint, `tool_choice` "auto".

The scores: overall is the mean over every case; the category-balanced score is the mean of
three category scores: live weighted by subset size, non_live with its simple_* subsets
averaged into one before the mean with the others, hallucination the plain mean of its
subsets. The gate holds both at 97% of the reference system's (llama.cpp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atlas_cli.bench import bfcl_cases as cases

CATEGORIES = {
    "non_live": (
        "simple_python",
        "simple_java",
        "simple_javascript",
        "multiple",
        "parallel",
        "parallel_multiple",
    ),
    "live": ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"),
    "hallucination": ("irrelevance", "live_irrelevance"),
}
RATES = {"non_live": 62, "live": 10, "hallucination": 10}  # percent of each subset
SUBSET_FLOOR = 25  # a subset this small or smaller is taken whole
SUBSETS = tuple(s for subsets in CATEGORIES.values() for s in subsets)


def sample_count(total: int, rate: int) -> int:
    """How many of a subset's `total` cases the draw takes at `rate` percent."""
    return total if total <= SUBSET_FLOOR else max(1, int(total * rate / 100))


def draw(limit: int | None = None) -> list[cases.Case]:
    """The cases of the MLPerf set, subset by subset in the order above; with `limit`, at most
    the first `limit` of each subset's (a smoke run with every subset in it)."""
    out = []
    for category, subsets in CATEGORIES.items():
        for subset in subsets:
            everything = cases.load(subset)
            n = sample_count(len(everything), RATES[category])
            out += everything[: n if limit is None else min(n, limit)]
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def scores(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{"overall", "category_balanced", "categories": {name: score}, "subsets": {name: score}}
    (fractions) from result rows ({"category": subset, "valid": bool}); categories without a
    row are left out, as the scorer leaves them out."""
    by_subset: dict[str, list[float]] = {}
    for row in rows:
        by_subset.setdefault(row["category"], []).append(1.0 if row["valid"] else 0.0)
    subset_scores = {name: _mean(v) for name, v in by_subset.items()}
    category_scores = {}
    for category, subsets in CATEGORIES.items():
        present = [s for s in subsets if s in subset_scores]
        if not present:
            continue
        if category == "live":  # weighted by the subsets' sizes
            n = sum(len(by_subset[s]) for s in present)
            category_scores[category] = sum(sum(by_subset[s]) for s in present) / n
        elif category == "non_live":  # the simple_* subsets count as one
            simple = [subset_scores[s] for s in present if s.startswith("simple_")]
            rest = [subset_scores[s] for s in present if not s.startswith("simple_")]
            category_scores[category] = _mean(([_mean(simple)] if simple else []) + rest)
        else:
            category_scores[category] = _mean([subset_scores[s] for s in present])
    every = [v for values in by_subset.values() for v in values]
    return {
        "overall": _mean(every) if every else 0.0,
        "category_balanced": _mean(list(category_scores.values())) if category_scores else 0.0,
        "categories": category_scores,
        "subsets": subset_scores,
    }
