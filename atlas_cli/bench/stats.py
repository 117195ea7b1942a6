"""Summary statistics for benchmark samples, in plain Python (no numpy import on the CLI path).

`percentile` matches numpy's default ("linear", Hyndman & Fan type 7); `mean_std` uses the
sample standard deviation (n - 1), as llama-bench does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# The order metrics are reported in; MLPerf also reports p99.9.
SUMMARY_KEYS = ("min", "mean", "p50", "p90", "p95", "p99", "p99.9", "max")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single sample)."""
    if not values:
        raise ValueError("mean of no values")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var)


def summarize(values: Sequence[float | None]) -> dict[str, float] | None:
    """min/mean/p50/p90/p95/p99/p99.9/max of the values that are not None (None if none are)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    out = {"min": min(xs), "mean": math.fsum(xs) / len(xs)}
    for q in (50, 90, 95, 99, 99.9):
        out[f"p{q:g}"] = percentile(xs, q)
    out["max"] = max(xs)
    out["count"] = len(xs)
    return out


def median(values: Sequence[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return percentile(xs, 50) if xs else None
