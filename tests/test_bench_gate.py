import json

import pytest

from atlas_cli.bench import gate
from atlas_cli.errors import UsageError


def throughput(**tests):
    return {
        "kind": "throughput",
        "records": [{"test": name, "avg_ts": value} for name, value in tests.items()],
    }


def agentic(tok_s, ttft, tpot):
    return {
        "kind": "agentic",
        "summary": {
            "output_tokens_per_s": tok_s,
            "ttft_s": {"p50": ttft},
            "tpot_s": {"p50": tpot},
        },
    }


def test_throughput_within_tolerance_passes():
    result = gate.compare(throughput(pp512=95.0, tg128=20.5), throughput(pp512=100.0, tg128=20.0))
    assert result.passed
    changes = {c.name: c.change for c in result.changes}
    assert changes == pytest.approx({"pp512 t/s": -0.05, "tg128 t/s": 0.025})


def test_throughput_drop_over_ten_percent_fails():
    result = gate.compare(throughput(pp512=89.0, tg128=20.0), throughput(pp512=100.0, tg128=20.0))
    assert not result.passed
    assert [c.name for c in result.changes if c.regressed] == ["pp512 t/s"]
    text = gate.report(result)
    assert "pp512 t/s" in text and "-11.0%" in text and "REGRESSED" in text
    assert text.splitlines()[-1].startswith("gate: FAIL (1 metric")


def test_exactly_ten_percent_is_allowed():
    assert gate.compare(throughput(pp512=90.0), throughput(pp512=100.0)).passed


def test_agentic_medians_rising_fail_and_speedups_pass():
    base = agentic(10.0, 0.500, 0.100)
    assert gate.compare(agentic(10.0, 0.540, 0.105), base).passed
    slow_ttft = gate.compare(agentic(10.0, 0.560, 0.100), base)
    assert [c.name for c in slow_ttft.changes if c.regressed] == ["median TTFT s"]
    slow_tpot = gate.compare(agentic(10.0, 0.500, 0.111), base)
    assert [c.name for c in slow_tpot.changes if c.regressed] == ["median TPOT s"]
    fewer_tokens = gate.compare(agentic(8.9, 0.3, 0.05), base)
    assert [c.name for c in fewer_tokens.changes if c.regressed] == ["output tokens/s"]
    assert gate.compare(agentic(20.0, 0.1, 0.01), base).passed  # faster is never a failure


def test_custom_tolerance_and_unmatched_metrics():
    result = gate.compare(
        throughput(pp512=80.0, tg64=5.0), throughput(pp512=100.0, tg128=9.0), 0.25
    )
    assert result.passed
    assert result.unmatched == ["tg128 t/s", "tg64 t/s"]
    assert "in one run only" in gate.report(result)
    with pytest.raises(UsageError):
        gate.compare(throughput(a=1.0), throughput(a=1.0), -0.1)


def test_kind_mismatch_and_bad_files(tmp_path):
    with pytest.raises(gate.BaselineError, match="baseline is a agentic result"):
        gate.compare(throughput(pp512=1.0), agentic(1.0, 1.0, 1.0))
    with pytest.raises(gate.BaselineError, match="no such baseline file"):
        gate.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(gate.BaselineError, match="not a readable JSON baseline"):
        gate.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(gate.BaselineError, match="not an atlas bench result"):
        gate.load(tmp_path / "other.json")


def test_save_and_load_round_trip_and_llama_bench_style_list(tmp_path):
    doc = throughput(pp512=100.0)
    gate.save(tmp_path / "sub" / "base.json", doc)
    assert gate.load(tmp_path / "sub" / "base.json") == doc
    (tmp_path / "list.json").write_text(json.dumps(doc["records"]))
    assert gate.load(tmp_path / "list.json") == doc


def test_a_thread_sweep_keeps_its_tests_apart():
    swept = {
        "kind": "throughput",
        "records": [
            {"test": "tg8", "avg_ts": 10.0, "n_threads": 1},
            {"test": "tg8", "avg_ts": 4.0, "n_threads": 2},
        ],
    }
    names = sorted(gate.metrics(swept))
    assert names == ["tg8 t/s (threads=1)", "tg8 t/s (threads=2)"]
    assert list(gate.metrics(throughput(tg8=10.0))) == ["tg8 t/s"]
