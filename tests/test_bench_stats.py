import numpy as np
import pytest

from atlas_cli.bench import stats


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
def test_percentiles_match_numpy(n):
    rng = np.random.default_rng(n)
    values = rng.lognormal(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_percentile_of_unsorted_ties_and_ints():
    values = [5, 1, 3, 3, 9, 1]
    for q in (10, 50, 75):
        assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_mean_std_is_the_sample_std():
    values = [10.0, 12.0, 11.5, 9.0]
    mean, std = stats.mean_std(values)
    assert mean == pytest.approx(np.mean(values))
    assert std == pytest.approx(np.std(values, ddof=1))
    assert stats.mean_std([3.0]) == (3.0, 0.0)


def test_summarize_skips_none_and_reports_every_key():
    values = [0.5, None, 0.1, 0.9, 0.3]
    s = stats.summarize(values)
    xs = [v for v in values if v is not None]
    assert s["min"] == 0.1 and s["max"] == 0.9 and s["count"] == 4
    assert s["mean"] == pytest.approx(np.mean(xs))
    for key, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("p99.9", 99.9)):
        assert s[key] == pytest.approx(np.percentile(xs, q))
    assert stats.summarize([None, None]) is None
    assert stats.median([None]) is None


def test_errors():
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    with pytest.raises(ValueError):
        stats.mean_std([])
