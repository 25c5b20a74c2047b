"""kvq_eval.stats against scipy and exact enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binomtest

from kvq_eval.stats import bootstrap_mean_ci, mcnemar_exact, paired_bootstrap, wilson_interval


@given(n=st.integers(1, 400), frac=st.floats(0, 1), level=st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_wilson_matches_scipy(n, frac, level):
    k = int(round(frac * n))
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    lo, hi = wilson_interval(k, n, level)
    # scipy evaluates the same closed form: agreement to float64 rounding
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_edges_and_errors():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(30, 30)
    assert hi == 1.0 and lo == pytest.approx(30 / (30 + 1.959963984540054**2), rel=1e-12)
    with pytest.raises(ValueError, match="successes must be <= n"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="level must be"):
        wilson_interval(1, 2, level=1.0)
    with pytest.raises(ValueError, match="n must be a non-negative integer"):
        wilson_interval(1, 2.5)


@given(a=st.lists(st.booleans(), min_size=1, max_size=60), seed=st.integers(0, 2**16))
def test_mcnemar_matches_scipy_binomtest(a, seed):
    b = list(np.random.default_rng(seed).random(len(a)) < 0.5)
    r = mcnemar_exact(a, b)
    m = r["a_only"] + r["b_only"]
    expected = 1.0 if m == 0 else binomtest(r["a_only"], m, 0.5).pvalue
    assert r["p"] == pytest.approx(expected, rel=1e-12)
    assert r["a_only"] + r["b_only"] + r["both"] + r["neither"] == len(a)


def test_mcnemar_crafted():
    # 10 discordant pairs all won by a: p = 2 / 2**10
    a = [1] * 10 + [1] * 5 + [0] * 5
    b = [0] * 10 + [1] * 5 + [0] * 5
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["both"], r["neither"]) == (10, 0, 5, 5)
    assert r["p"] == 2 / 1024
    assert mcnemar_exact([1, 0], [1, 0])["p"] == 1.0
    with pytest.raises(ValueError, match="pair up"):
        mcnemar_exact([1, 0], [1])
    with pytest.raises(ValueError, match="0/1 outcomes"):
        mcnemar_exact([0.5], [1])


def _exact_bootstrap_cdf(x):
    """P*(mean <= t) at every support point, by enumerating all n**n ordered resamples."""
    means = np.array([np.mean(c) for c in itertools.product(x, repeat=len(x))])
    return {t: float(np.mean(means <= t + 1e-12)) for t in np.unique(means)}


def test_bootstrap_distribution_matches_enumeration():
    """The resampled means follow the exact bootstrap distribution (n = 4: 256 resamples).

    Tolerance: 5 binomial standard errors sqrt(F(1-F)/R) of an empirical CDF with R resamples.
    """
    from kvq_eval.stats import _resampled_means

    x = np.array([0.0, 1.0, 3.0, 7.0])
    r = 20_000
    means = _resampled_means(x, r, seed=3)
    for t, f in _exact_bootstrap_cdf(x).items():
        se = math.sqrt(max(f * (1 - f), 1e-4) / r)
        assert abs(np.mean(means <= t + 1e-12) - f) <= 5 * se
    lo, hi = bootstrap_mean_ci(x, level=0.9, resamples=r, seed=3)
    assert lo == pytest.approx(np.quantile(means, 0.05)) and hi == pytest.approx(np.quantile(means, 0.95))


def test_paired_bootstrap_p_matches_enumeration():
    """d = (-1, 2, 3): exactly 4 of the 27 ordered resamples have mean <= 0, none... (P(D>=0) = 26/27)."""
    a, b = np.array([0.0, 2.0, 3.0]), np.array([1.0, 0.0, 0.0])
    r = 20_000
    res = paired_bootstrap(a, b, resamples=r, seed=5)
    p_exact = 2 * 4 / 27
    assert res["mean_diff"] == pytest.approx(4 / 3)
    assert abs(res["p"] - p_exact) <= 5 * 2 * math.sqrt((4 / 27) * (23 / 27) / r) + 2 / r
    same = paired_bootstrap([1.0, 2.0], [1.0, 2.0], resamples=200)
    assert same["p"] == 1.0 and same["ci"] == (0.0, 0.0)
    # all 20 differences positive: no resample reaches 0, p is the +1-corrected minimum
    assert paired_bootstrap(np.ones(20), np.zeros(20), resamples=999)["p"] == 2 / 1000


def test_bootstrap_deterministic_and_errors():
    x = np.random.default_rng(0).standard_normal(50)
    assert bootstrap_mean_ci(x) == bootstrap_mean_ci(x)
    assert bootstrap_mean_ci([2.5]) == (2.5, 2.5)
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_mean_ci([1.0, 2.0], resamples=10)
    with pytest.raises(ValueError, match="pair up"):
        paired_bootstrap([1.0, 2.0], [1.0])
