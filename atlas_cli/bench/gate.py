"""The regression gate: compare a run with a stored baseline.

It fails when a throughput or a BFCL accuracy drops, or a median TTFT/TPOT rises, by more than
the tolerance (10%). Baselines are the result documents `--save-baseline` writes:
{"kind": "throughput", "records"}, {"kind": "agentic", "summary", ...} or {"kind": "bfcl",
"summary", "categories", ...}; a bare list of llama-bench records (`-o json`) works too.
MLPerf's accuracy rule (`mlperf_accuracy`) gates the overall score (and on its own set the
category-balanced one): at least 97% of the reference's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_cli.errors import AtlasError, UsageError

TOLERANCE = 0.10
KINDS = ("throughput", "agentic", "bfcl")
MLPERF_FRACTION = 0.97  # MLPerf Edge Agentic: accuracy >= 97% of the reference score


class BaselineError(AtlasError):
    """A baseline file that is missing, unreadable or of another kind of run."""


@dataclass(frozen=True)
class MetricChange:
    name: str
    baseline: float
    current: float
    higher_is_better: bool
    tolerance: float

    @property
    def change(self) -> float:
        """Relative change, current vs baseline (+0.05 is 5% more)."""
        return (self.current - self.baseline) / self.baseline

    @property
    def regressed(self) -> bool:
        if self.higher_is_better:
            return self.change < -self.tolerance
        return self.change > self.tolerance


@dataclass(frozen=True)
class GateResult:
    changes: list[MetricChange]
    unmatched: list[str]  # metrics found on one side only: reported, never failing

    @property
    def passed(self) -> bool:
        return not any(c.regressed for c in self.changes)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise BaselineError(
            f"{path}: no such baseline file (write one with --save-baseline)"
        ) from None
    except (OSError, ValueError) as exc:
        raise BaselineError(f"{path}: not a readable JSON baseline ({exc})") from None
    if isinstance(doc, list):
        doc = {"kind": "throughput", "records": doc}
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        raise BaselineError(f"{path}: not an atlas bench result (no 'kind')")
    return doc


def save(path: str | Path, result: dict[str, Any]) -> None:
    """Write `result` as JSON through a temp file and a rename: an interrupted write leaves the
    last whole document (a resumable run saves after every case)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def metrics(result: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    """name -> (value, higher_is_better) for the numbers the gate watches."""
    if result["kind"] == "throughput":
        records = result["records"]
        swept = len({r["test"] for r in records}) < len(records)  # a -t sweep repeats tests
        out = {}
        for r in records:
            name = f"{r['test']} t/s"
            if swept:
                name += f" (threads={r.get('n_threads')})"
            out[name] = (float(r["avg_ts"]), True)
        return out
    if result["kind"] == "bfcl":
        out = {"accuracy": (float(result["summary"]["accuracy"]), True)}
        if "mlperf" in result:
            out["category-balanced accuracy"] = (float(result["mlperf"]["category_balanced"]), True)
        for name, tally in result["categories"].items():
            out[f"accuracy {name}"] = (float(tally["accuracy"]), True)
        return out
    s = result["summary"]
    out = {"output tokens/s": (float(s["output_tokens_per_s"]), True)}
    for key, label in (("ttft_s", "median TTFT s"), ("tpot_s", "median TPOT s")):
        if s.get(key):
            out[label] = (float(s[key]["p50"]), False)
    return out


def compare(
    current: dict[str, Any], baseline: dict[str, Any], tolerance: float = TOLERANCE
) -> GateResult:
    if tolerance < 0:
        raise UsageError(f"--tolerance must be >= 0, got {tolerance}")
    if current["kind"] != baseline["kind"]:
        raise BaselineError(
            f"the baseline is a {baseline['kind']} result but this run is {current['kind']}"
        )
    now, base = metrics(current), metrics(baseline)
    changes = [
        MetricChange(name, base[name][0], value, higher, tolerance)
        for name, (value, higher) in now.items()
        if name in base and base[name][0] > 0
    ]
    unmatched = sorted(set(now) ^ set(base))
    return GateResult(changes, unmatched)


def mlperf_accuracy(current: dict[str, Any], baseline: dict[str, Any]) -> GateResult:
    """MLPerf's rule: the overall accuracy, and on runs of its set (--mlperf) the
    category-balanced one, at least 97% of the baseline's; the categories are not gated (a
    short run's categories are too small to hold to 3%)."""
    if current["kind"] != "bfcl" or baseline["kind"] != "bfcl":
        raise BaselineError("the MLPerf accuracy rule compares two bfcl results")
    return compare(
        {**current, "categories": {}}, {**baseline, "categories": {}}, 1 - MLPERF_FRACTION
    )


def report(result: GateResult) -> str:
    width = max([len(c.name) for c in result.changes] + [6])
    lines = [f"{'metric':<{width}}  {'baseline':>12}  {'current':>12}  {'change':>8}"]
    for c in result.changes:
        mark = "REGRESSED" if c.regressed else "ok"
        lines.append(
            f"{c.name:<{width}}  {c.baseline:>12.4g}  {c.current:>12.4g}  {c.change:>+8.1%}  {mark}"
        )
    for name in result.unmatched:
        lines.append(f"{name:<{width}}  (in one run only: not compared)")
    tol = result.changes[0].tolerance if result.changes else TOLERANCE
    failed = sum(c.regressed for c in result.changes)
    if not result.changes:
        lines.append("gate: no metric in common with the baseline")
    elif failed:
        lines.append(f"gate: FAIL ({failed} metric(s) worse by more than {tol:.0%})")
    else:
        lines.append(f"gate: PASS (no metric worse than the baseline by more than {tol:.0%})")
    return "\n".join(lines)
