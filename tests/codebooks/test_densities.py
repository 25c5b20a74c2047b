"""Densities: closed forms vs mpmath vs the quadrature engine vs Monte Carlo; validation."""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from codebooks import Empirical, Gaussian, PolarAngle, SphereMarginal
from codebooks import _quad
from codebooks.densities import _log_gamma_half_ratio
from tests.mpref import mp_pdf

CONTINUOUS = [SphereMarginal(2), SphereMarginal(3), SphereMarginal(4), SphereMarginal(7),
              SphereMarginal(128), SphereMarginal(65536), Gaussian(), Gaussian(2.5),
              PolarAngle(1), PolarAngle(2), PolarAngle(3), PolarAngle(7)]


def _mp_moments(density, a, b):
    f = mp_pdf(density)
    lo, hi = density.support
    a, b = max(a, lo), min(b, hi)
    # split at the mode and a few std either side so mp.quad sees smooth pieces
    c = density.center
    s = density.scale
    pts = sorted({mp.mpf(a), mp.mpf(b)} | {mp.mpf(c + k * s) for k in range(-8, 9) if a < c + k * s < b})
    return [mp.quad(lambda x: x**k * f(x), pts) for k in range(3)]


def _cells(density, n, seed):
    lo, hi = density.support
    s = density.scale
    rng = np.random.default_rng(seed)
    a = np.clip(density.center + rng.normal(0, 2 * s, n), lo, hi)
    b = np.clip(a + np.abs(rng.normal(0, s, n)), lo, hi)
    return a, b


@pytest.mark.parametrize("density", CONTINUOUS, ids=repr)
def test_cell_integrals_match_mpmath(density):
    """The engine (relative accuracy per cell) against 40-digit mpmath quadrature."""
    mp.mp.dps = 40
    a, b = _cells(density, 6, seed=1)
    lo, hi = density.support
    a = np.append(a, [lo, density.center + 3 * density.scale])  # a tail cell and a far cell
    b = np.append(b, [density.center, hi])
    q = density._quad()
    P, R, D = q.integrals(q.t_of_x(a), q.t_of_x(b), np.zeros_like(a))
    for i in range(a.size):
        if not b[i] > a[i]:
            continue
        ref = _mp_moments(density, float(a[i]), float(b[i]))
        # per-cell relative accuracy: a few eps from the rule and the log-weights
        assert P[i] == pytest.approx(float(ref[0]), rel=1e-14, abs=1e-300)
        assert R[i] == pytest.approx(float(ref[1]), rel=1e-14, abs=1e-300)
        assert D[i] == pytest.approx(float(ref[2]), rel=1e-14, abs=1e-300)


@pytest.mark.parametrize("density", CONTINUOUS, ids=repr)
def test_closed_form_moments_match_engine(density):
    """Closed forms (incomplete beta / erf) against the quadrature engine.

    Closed forms are differences of CDF-like terms: their absolute error is ~eps times the
    full moment E|X|^k (not relative to a tiny cell), so the tolerance is absolute in those units.
    """
    a, b = _cells(density, 400, seed=2)
    m0, m1, m2 = density.cell_moments(a, b)
    q = density._quad()
    P, R, D = q.integrals(q.t_of_x(a), q.t_of_x(b), np.zeros_like(a))
    mean_abs = abs(density.mean) + density.scale
    assert np.max(np.abs(m0 - P)) <= 1e-13
    assert np.max(np.abs(m1 - R)) <= 1e-13 * mean_abs
    assert np.max(np.abs(m2 - D)) <= 1e-13 * density.second_moment


@pytest.mark.parametrize("density", CONTINUOUS, ids=repr)
def test_full_support_moments(density):
    """Mass 1, mean and E[X^2] from closed forms (1/d, sigma^2, trigamma) and from quadrature."""
    lo, hi = density.support
    m0, m1, m2 = density.cell_moments(lo, hi)
    assert float(m0) == pytest.approx(1.0, rel=1e-14)
    assert float(m1) == pytest.approx(density.mean, abs=1e-14 * density.scale)
    assert float(m2) == pytest.approx(density.second_moment, rel=1e-13)
    q = density._quad()
    P, R, D = q.integrals(np.array([q.t_lo]), np.array([q.t_hi]), np.array([density.mean]))
    assert P[0] == pytest.approx(1.0, rel=4e-15)
    assert R[0] == pytest.approx(0.0, abs=4e-15 * density.scale)
    assert D[0] == pytest.approx(density.var, rel=4e-15)


def test_polar_variance_is_trigamma_closed_form():
    """Var(psi) = psi_1(1 + n/2) / 8 (from the characteristic function) against mpmath quad."""
    mp.mp.dps = 30
    for level in (2, 3, 5):
        dens = PolarAngle(level)
        f = mp_pdf(dens)
        var = mp.quad(lambda x: (x - mp.pi / 4) ** 2 * f(x), [0, mp.pi / 4, mp.pi / 2])
        assert dens.var == pytest.approx(float(var), rel=1e-14)


def test_special_cases_have_their_closed_forms():
    # d=2 arcsine: F(x) = 1/2 + asin(x)/pi; d=3 uniform on [-1, 1]
    x = np.linspace(-0.999, 0.999, 41)
    assert np.allclose(SphereMarginal(2).cdf(x), 0.5 + np.arcsin(x) / np.pi, rtol=0, atol=1e-15)
    assert np.allclose(SphereMarginal(2).pdf(x), 1 / (np.pi * np.sqrt(1 - x * x)), rtol=1e-14)
    assert np.allclose(SphereMarginal(3).pdf(x), 0.5, rtol=1e-15)
    assert np.allclose(SphereMarginal(3).cdf(x), (1 + x) / 2, rtol=0, atol=1e-15)
    assert SphereMarginal(2).pdf(1.0) == np.inf and SphereMarginal(5).pdf(1.0) == 0.0
    assert SphereMarginal(4).pdf(1.5) == 0.0
    # polar level 2: f = sin(2 psi), F = sin^2 psi
    psi = np.linspace(0, np.pi / 2, 33)
    assert np.allclose(PolarAngle(2).pdf(psi), np.sin(2 * psi), atol=1e-15)
    assert np.allclose(PolarAngle(2).cdf(psi), np.sin(psi) ** 2, atol=1e-15)


@pytest.mark.parametrize("density", CONTINUOUS, ids=repr)
def test_cdf_sf_pdf_consistent(density):
    lo, hi = density.support
    x = np.linspace(max(lo, density.center - 6 * density.scale), min(hi, density.center + 6 * density.scale), 97)
    assert np.allclose(density.cdf(x) + density.sf(x), 1.0, atol=2e-15)
    # derivative of the CDF is the pdf (central differences, interior points only)
    h = 1e-6 * density.scale
    xi = x[1:-1]
    num = (density.cdf(xi + h) - density.cdf(xi - h)) / (2 * h)
    assert np.allclose(num, density.pdf(xi), rtol=1e-6, atol=1e-6 / density.scale)


def test_tails_are_accurate():
    """Upper tails far out (no 1 - 1 cancellation): compare with mpmath."""
    mp.mp.dps = 40
    d = SphereMarginal(1024)
    x = 8 / math.sqrt(1024)
    ref = mp.betainc(mp.mpf(1023) / 2, mp.mpf(1023) / 2, 0, (1 - mp.mpf(x)) / 2, regularized=True)
    assert float(d.sf(x)) == pytest.approx(float(ref), rel=1e-12)
    g = Gaussian()
    assert float(g.sf(12.0)) == pytest.approx(float(mp.ncdf(-12)), rel=1e-13)


@pytest.mark.parametrize("x", [0.5, 1, 1.5, 2.5, 10, 29.999, 30, 31, 100, 1e3, 32767.5, 1e6, 1e8])
def test_log_gamma_half_ratio(x):
    mp.mp.dps = 40
    ref = mp.log(mp.gamma(mp.mpf(x) + mp.mpf(1) / 2) / mp.gamma(mp.mpf(x)))
    # absolute error of a log = relative error of the normaliser; lgamma differences give 2e-11
    assert abs(_log_gamma_half_ratio(x) - float(ref)) <= 4e-16 * max(1.0, abs(float(ref)))


def test_gauss_legendre_rule_is_correctly_rounded():
    mp.mp.dps = 50
    n = _quad.N_NODES
    for i, (x, w) in enumerate(zip(_quad._POS_NODES[::-1], _quad._POS_WEIGHTS[::-1]), start=1):
        z = mp.cos(mp.pi * (i - mp.mpf(1) / 4) / (n + mp.mpf(1) / 2))
        for _ in range(60):
            p = mp.legendre(n, z)
            dp = n * (z * p - mp.legendre(n - 1, z)) / (z * z - 1)
            z -= p / dp
        p = mp.legendre(n, z)
        dp = n * (z * p - mp.legendre(n - 1, z)) / (z * z - 1)
        assert x == float(z) and w == float(2 / ((1 - z * z) * dp * dp))


def _sample(density, n, rng):
    """Draw from the density by its definition, independently of its formulas."""
    if isinstance(density, SphereMarginal):
        g = rng.standard_normal((n, density.d)) if density.d <= 64 else None
        if g is not None:
            return g[:, 0] / np.linalg.norm(g, axis=1)
        # x1 = g1 / sqrt(g1^2 + chi2_{d-1})
        g1 = rng.standard_normal(n)
        return g1 / np.sqrt(g1 * g1 + rng.chisquare(density.d - 1, n))
    if isinstance(density, Gaussian):
        return density.sigma * rng.standard_normal(n)
    m = 2 ** (density.level - 1)
    if density.level == 1:
        g = rng.standard_normal((n, 2))
        return np.mod(np.arctan2(g[:, 1], g[:, 0]), 2 * np.pi)
    g = rng.standard_normal((n, 2 * m))
    return np.arctan(np.linalg.norm(g[:, m:], axis=1) / np.linalg.norm(g[:, :m], axis=1))


@pytest.mark.parametrize("density", [SphereMarginal(2), SphereMarginal(16), SphereMarginal(4096),
                                     Gaussian(0.3), PolarAngle(1), PolarAngle(3)], ids=repr)
def test_cell_masses_match_monte_carlo(density):
    """Cell masses vs sampling from the definition; bound 4.5 binomial standard errors."""
    rng = np.random.default_rng(12345)
    n = 200_000
    x = _sample(density, n, rng)
    lo, hi = density.support
    edges = np.quantile(x, np.linspace(0, 1, 11))
    edges[0], edges[-1] = lo, hi
    m0, _, _ = density.cell_moments(edges[:-1], edges[1:])
    counts = np.histogram(x, bins=edges)[0] / n
    se = np.sqrt(m0 * (1 - m0) / n)
    assert np.all(np.abs(counts - m0) <= 4.5 * se)


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("d", [0, 1, -3])
def test_sphere_rejects_small_d(d):
    with pytest.raises(ValueError, match="d must be >= 2"):
        SphereMarginal(d)


@pytest.mark.parametrize("d", [2.5, 3.0, "3", True, None])
def test_sphere_rejects_non_integer_d(d):
    with pytest.raises(TypeError, match="d must be an integer"):
        SphereMarginal(d)


def test_sphere_accepts_numpy_int():
    assert SphereMarginal(np.int64(128)) == SphereMarginal(128)
    assert type(SphereMarginal(np.int32(5)).d) is int


@pytest.mark.parametrize("sigma", [0.0, -1.0, math.nan, math.inf])
def test_gaussian_rejects_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        Gaussian(sigma)


@pytest.mark.parametrize("level", [0, 17])
def test_polar_rejects_level(level):
    with pytest.raises(ValueError, match="level must be in 1..16"):
        PolarAngle(level)


def test_empirical_validation():
    with pytest.raises(ValueError, match="samples must have at least 1"):
        Empirical([])
    with pytest.raises(ValueError, match="at least 2 distinct values"):
        Empirical([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="samples must be finite"):
        Empirical([1.0, np.nan, 2.0])
    with pytest.raises(ValueError, match="samples must be finite"):
        Empirical([1.0, np.inf])
    with pytest.raises(ValueError, match="samples must be 1-D"):
        Empirical(np.ones((3, 2)))
    with pytest.raises(TypeError, match="samples must be a numeric array"):
        Empirical(["a", "b"])
    with pytest.raises(ValueError, match="weights must be >= 0"):
        Empirical([1.0, 2.0], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="weights must have the shape"):
        Empirical([1.0, 2.0], weights=[1.0])
    with pytest.raises(ValueError, match="at least 2 distinct values with positive weight"):
        Empirical([1.0, 2.0], weights=[1.0, 0.0])


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=2, max_size=60),
       st.integers(0, 2**32 - 1))
def test_empirical_moments_are_sums(samples, seed):
    if len(set(samples)) < 2:
        return
    w = np.random.default_rng(seed).uniform(0.1, 2.0, len(samples))
    if np.ptp(samples) < 1e-150:  # distortions would underflow: refused (SCALE_RANGE)
        with pytest.raises(ValueError, match="samples must span at least"):
            Empirical(samples, weights=w)
        return
    e = Empirical(samples, weights=w)
    x = np.asarray(samples)
    probs = w / w.sum()
    a, b = np.quantile(x, [0.2, 0.7])
    inside = (x > a) & (x <= b)  # half-open cells (a, b]
    m0, m1, m2 = e.cell_moments(a, b)
    assert float(m0) == pytest.approx(probs[inside].sum(), rel=1e-12, abs=1e-15)
    assert float(m1) == pytest.approx(np.dot(probs[inside], x[inside]), rel=1e-9, abs=1e-9)
    assert float(e.cdf(b)) == pytest.approx(probs[x <= b].sum(), rel=1e-12, abs=1e-15)
    assert Empirical(e.values, weights=e.masses) == e
