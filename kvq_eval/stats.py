"""Statistics of the evaluation: intervals for proportions and means, paired tests of two methods.

Every function is exact or seeded: the same data and seed give the same numbers (byte-identical
tables). ``tests/kvq_eval/test_stats.py`` checks them against scipy and exact enumeration.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["wilson_interval", "bootstrap_mean_ci", "paired_bootstrap", "mcnemar_exact", "BOOTSTRAP_SEED",
           "BOOTSTRAP_RESAMPLES"]

#: Fixed seed and resample count of every bootstrap in tables (so tables are reproducible).
BOOTSTRAP_SEED = 20251130
BOOTSTRAP_RESAMPLES = 10_000
_Z95 = 1.959963984540054  # Phi^-1(0.975)


def _check_level(level: float) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    return float(level)


def _z(level: float) -> float:
    from scipy.stats import norm

    return _Z95 if level == 0.95 else float(norm.ppf(0.5 + level / 2))


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    Parameters
    ----------
    successes, n : int
        ``0 <= successes <= n``; ``n = 0`` gives the uninformative interval (0, 1).
    level : float in (0, 1)

    Returns
    -------
    (low, high) : tuple of float, within [0, 1]

    Notes
    -----
    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p = successes/n`` and
    ``z = Phi^-1((1+level)/2)``. Unlike the normal (Wald) interval it is not degenerate at p = 0
    or 1, where a saturated method sits.
    """
    level = _check_level(level)
    for name, v in (("successes", successes), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if successes > n:
        raise ValueError(f"successes must be <= n, got {successes} > {n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(level)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at k = 0 (k = n) the bound is exactly 0 (1); the closed form leaves a rounding residue
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def _as_sample(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return a


def _resampled_means(x: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an integer >= 100, got {resamples!r}")
    rng = np.random.default_rng(seed)
    out = np.empty(resamples)
    for i in range(0, resamples, 1000):  # bounded memory for long samples
        m = min(1000, resamples - i)
        out[i:i + m] = x[rng.integers(0, x.size, size=(m, x.size))].mean(axis=1)
    return out


def bootstrap_mean_ci(x, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``x`` (resampling its elements with replacement).

    Parameters
    ----------
    x : sequence of float, shape (n,)
        Independent units (perplexity windows, needle samples). ``n = 1`` gives (x, x).
    level : float in (0, 1)
    resamples : int >= 100
    seed : int

    Returns
    -------
    (low, high) : tuple of float
        The ``(1-level)/2`` and ``(1+level)/2`` quantiles of the resampled means.
    """
    level = _check_level(level)
    a = _as_sample("x", x)
    means = _resampled_means(a, resamples, seed)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_bootstrap(a, b, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> dict:
    """Paired bootstrap of ``mean(a - b)`` over matched units.

    Parameters
    ----------
    a, b : sequence of float, shape (n,)
        One value per unit for each method (the same needle sample, say).

    Returns
    -------
    dict
        ``mean_diff``, ``ci`` (percentile interval of the resampled mean differences) and ``p``, the
        two-sided bootstrap p-value ``min(1, 2 min(P*(D <= 0), P*(D >= 0)))`` of the resampled mean
        difference D (with the ``+1`` correction of Davison & Hinkley so that it is never 0).

    Notes
    -----
    Resampling pairs (not the two samples independently) keeps the pairing: the spread comes
    from how the per-unit difference varies, not from how hard the units are.
    """
    level = _check_level(level)
    a, b = _as_sample("a", a), _as_sample("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must pair up (same length), got {a.size} and {b.size}")
    d = a - b
    means = _resampled_means(d, resamples, seed)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    le, ge = np.sum(means <= 0), np.sum(means >= 0)
    p = min(1.0, 2 * (min(le, ge) + 1) / (resamples + 1))
    if np.all(d == 0):
        p = 1.0
    return {"n": int(d.size), "mean_diff": float(d.mean()), "ci": (float(lo), float(hi)), "p": float(p)}


def mcnemar_exact(a, b) -> dict:
    """McNemar's exact test of two methods' paired 0/1 outcomes.

    Parameters
    ----------
    a, b : sequence of bool or {0, 1}, shape (n,)
        Exact match of each method on the same units.

    Returns
    -------
    dict
        ``n``, ``a_only`` (units only ``a`` got right), ``b_only``, ``both``, ``neither`` and ``p``,
        the two-sided exact p-value.

    Notes
    -----
    Only discordant units carry information. Under the null (both methods equally accurate) the
    ``a_only`` count among ``m = a_only + b_only`` discordant units is Binomial(m, 1/2); the
    two-sided p-value is ``min(1, 2 P(X <= min(a_only, b_only)))`` (1.0 when m = 0), which equals
    scipy's ``binomtest(a_only, m, 0.5)`` for this symmetric null.
    """
    x, y = np.asarray(a), np.asarray(b)
    for name, v in (("a", x), ("b", y)):
        if v.ndim != 1 or v.size == 0 or not np.all((v == 0) | (v == 1)):
            raise ValueError(f"{name} must be a non-empty 1-D sequence of 0/1 outcomes")
    if x.shape != y.shape:
        raise ValueError(f"a and b must pair up (same length), got {x.size} and {y.size}")
    x, y = x.astype(bool), y.astype(bool)
    a_only, b_only = int(np.sum(x & ~y)), int(np.sum(~x & y))
    m = a_only + b_only
    k = min(a_only, b_only)
    p = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2.0 ** m)
    return {"n": int(x.size), "a_only": a_only, "b_only": b_only, "both": int(np.sum(x & y)),
            "neither": int(np.sum(~x & ~y)), "p": float(p)}
