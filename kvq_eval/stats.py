"""Statistics of the evaluation: intervals for proportions and means, paired tests of two entries.

The statistical unit is an independent piece of text: a perplexity window (or a long decode's
window) or a needle sample, never a block of tokens inside a window (blocks of one window share
its text, and their spread understates the spread between windows: issue 56 measured between-window
spread a median 1.66x what 512-token blocks imply). With few units (4-8 windows) a percentile
bootstrap cannot keep its coverage (4 units give it 35 distinct resampled means); the intervals
here are Student t intervals, exact for normal unit means and checked by a coverage simulation in
``tests/kvq_eval/test_stats.py`` for the skewed unit distributions the evaluation meets. Paired
comparisons report the paired t interval and two p-values: the paired t test and the exact
sign-flip permutation test (distribution-free under a symmetric null), whose smallest possible
value is ``2 / 2**n`` (0.125 with 4 windows, 0.0156 with 7), so that few windows can never look
significant by construction of the test.

Every function is exact or seeded: the same data give the same numbers (byte-identical tables).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["wilson_interval", "t_interval", "sign_flip_p", "paired_test", "mcnemar_exact", "MIN_UNITS",
           "SIGN_FLIP_EXACT_MAX", "SIGN_FLIP_RESAMPLES", "SIGN_FLIP_SEED"]

#: Fewest units a t interval is formed from (one unit has no spread to estimate).
MIN_UNITS = 2
#: Sign-flip tests enumerate all ``2**n`` sign vectors up to this many units (1,048,576 at 20),
#: and draw ``SIGN_FLIP_RESAMPLES`` of them (seed ``SIGN_FLIP_SEED``) beyond.
SIGN_FLIP_EXACT_MAX = 20
SIGN_FLIP_RESAMPLES = 100_000
SIGN_FLIP_SEED = 20261206
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


def _as_sample(name: str, x, min_size: int = 1) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size < min_size:
        raise ValueError(f"{name} must be a 1-D sequence of at least {min_size} number(s), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return a


def t_interval(x, level: float = 0.95) -> tuple[float, float]:
    """Student t interval of the mean of independent units.

    Parameters
    ----------
    x : sequence of float, shape (n,), n >= ``MIN_UNITS``
        One value per unit (a window's mean NLL change per token, a needle sample's log-probability
        change).
    level : float in (0, 1)

    Returns
    -------
    (low, high) : tuple of float
        ``mean -+ t_{n-1, (1+level)/2} s / sqrt(n)`` with ``s`` the sample standard deviation
        (``ddof=1``); ``(mean, mean)`` when every unit is equal.

    Notes
    -----
    Exact coverage when the unit values are normal; a unit is an average over thousands of tokens,
    so close to normal, and the coverage simulation in the tests bounds what skew costs.
    """
    from scipy.stats import t as student_t

    level = _check_level(level)
    a = _as_sample("x", x, MIN_UNITS)
    m = float(a.mean())
    half = float(student_t.ppf(0.5 + level / 2, a.size - 1)) * float(a.std(ddof=1)) / math.sqrt(a.size)
    return m - half, m + half


def sign_flip_p(d, exact_max: int = SIGN_FLIP_EXACT_MAX, resamples: int = SIGN_FLIP_RESAMPLES,
                seed: int = SIGN_FLIP_SEED) -> float:
    """Two-sided sign-flip permutation p-value of ``mean(d) = 0`` for paired differences ``d``.

    Parameters
    ----------
    d : sequence of float, shape (n,)
        Per-unit differences of two entries on the same units.
    exact_max : int
        Enumerate all ``2**n`` sign vectors when ``n <= exact_max``; else draw ``resamples`` of them.
    resamples, seed : int
        The Monte Carlo draw (``n > exact_max``), with the ``+1`` correction so that p > 0.

    Returns
    -------
    float in (0, 1]
        The fraction of sign vectors ``s`` with ``|sum s_i d_i| >= |sum d_i|`` (1.0 when every
        ``d_i`` is 0). Exactly valid when the differences are symmetric about 0 under the null
        (the two entries exchangeable on each unit), whatever their distribution.
    """
    a = _as_sample("d", d)
    for name, v, lo in (("exact_max", exact_max, 0), ("resamples", resamples, 100), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if exact_max > 24:
        raise ValueError(f"exact_max must be <= 24 (2**n sign vectors are enumerated), got {exact_max}")
    obs = abs(float(a.sum()))
    if obs == 0.0 and not np.any(a):
        return 1.0
    tol = obs * 1e-12  # sums that equal the observed one up to rounding count as reaching it
    n = a.size
    if n <= exact_max:
        hits = 0
        for lo in range(0, 2**n, 2**16):  # bounded memory: 65,536 sign vectors at a time
            idx = np.arange(lo, min(lo + 2**16, 2**n), dtype=np.int64)
            signs = 1.0 - 2.0 * ((idx[:, None] >> np.arange(n)) & 1)
            hits += int(np.sum(np.abs(signs @ a) >= obs - tol))
        return hits / 2.0**n
    rng = np.random.default_rng(seed)
    hits = 0
    for lo in range(0, resamples, 10_000):
        m = min(10_000, resamples - lo)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(m, n))
        hits += int(np.sum(np.abs(signs @ a) >= obs - tol))
    return (hits + 1) / (resamples + 1)


def paired_test(a, b, level: float = 0.95) -> dict:
    """Entry ``a`` against entry ``b`` on matched units: mean difference, t interval, two p-values.

    Parameters
    ----------
    a, b : sequence of float, shape (n,), n >= ``MIN_UNITS``
        One value per unit for each entry (the same windows or needle samples, in the same order).
    level : float in (0, 1)

    Returns
    -------
    dict
        ``n``, ``mean_diff`` (mean of ``a - b``), ``ci`` (paired t interval), ``p_t`` (two-sided
        paired t test; 1.0 when every difference is 0, 0.0 when they are equal and non-zero) and
        ``p_signflip`` (``sign_flip_p``), with ``exact`` telling whether it was enumerated.

    Notes
    -----
    Pairing removes how hard each unit is: the spread is that of the per-unit difference.
    """
    from scipy.stats import t as student_t

    level = _check_level(level)
    a, b = _as_sample("a", a, MIN_UNITS), _as_sample("b", b, MIN_UNITS)
    if a.shape != b.shape:
        raise ValueError(f"a and b must pair up (same length), got {a.size} and {b.size}")
    d = a - b
    n = d.size
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        p_t = 1.0 if mean == 0.0 else 0.0
    else:
        p_t = float(2 * student_t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    return {"n": int(n), "mean_diff": mean, "ci": t_interval(d, level), "p_t": p_t,
            "p_signflip": sign_flip_p(d), "exact": n <= SIGN_FLIP_EXACT_MAX}


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
