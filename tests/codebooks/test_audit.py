"""distortion() against Monte Carlo and closed forms; audit() on optimal, early-stopped and
mis-scaled tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codebooks import Empirical, Gaussian, PolarAngle, SphereMarginal, audit, distortion, lloyd_max


def _rotated_unit_coordinates(d, n, rng):
    g = rng.standard_normal((n, d))
    return (g / np.linalg.norm(g, axis=1, keepdims=True)).ravel()


@given(st.sampled_from([2, 3, 5, 16, 64, 128]), st.integers(1, 6), st.floats(0.5, 2.0))
@settings(max_examples=12)
def test_distortion_matches_monte_carlo(d, bits, scale):
    """Any table (here: an optimal one rescaled, so not optimal) against sampling the definition.

    The estimate is a mean of squared errors; it must lie within 4.5 standard errors.
    """
    levels = scale * lloyd_max(SphereMarginal(d), bits).levels
    rng = np.random.default_rng(d * 100 + bits)
    x = _rotated_unit_coordinates(d, 400_000 // d + 2000, rng)
    idx = np.searchsorted(0.5 * (levels[:-1] + levels[1:]), x, side="left")
    err2 = (x - levels[idx]) ** 2
    exact = distortion(SphereMarginal(d), levels)
    se = err2.std() / math.sqrt(err2.size)
    assert abs(err2.mean() - exact) <= 4.5 * se


def test_distortion_closed_forms():
    # one level at 0 for N(0, s^2): s^2; at c: s^2 + c^2
    assert distortion(Gaussian(2.0), [0.0]) == pytest.approx(4.0, rel=1e-15)
    assert distortion(Gaussian(2.0), [1.5]) == pytest.approx(4.0 + 2.25, rel=1e-15)
    # uniform (d = 3) with K equal cells: 4^-b / 3
    k = 16
    levels = -1 + (2 * np.arange(k) + 1) / k
    assert distortion(SphereMarginal(3), levels) == pytest.approx(1 / (3 * k * k), rel=1e-14)
    # 1-bit sign quantizer +-c for N(0,1): 1 - 2c sqrt(2/pi) + c^2
    c = 0.3
    assert distortion(Gaussian(), [-c, c]) == pytest.approx(1 - 2 * c * math.sqrt(2 / math.pi) + c * c,
                                                          rel=1e-15)
    # explicit thresholds that are not midpoints: cells (-inf, 1], (1, inf) with levels -1, 2
    phi, Phi = math.exp(-0.5) / math.sqrt(2 * math.pi), 0.5 * math.erfc(-1 / math.sqrt(2))
    # E[(X+1)^2; X<=1] + E[(X-2)^2; X>1] from the truncated moments
    m0a, m1a, m2a = Phi, -phi, Phi - phi
    m0b, m1b, m2b = 1 - Phi, phi, 1 - Phi + phi
    expected = (m2a + 2 * m1a + m0a) + (m2b - 4 * m1b + 4 * m0b)
    assert distortion(Gaussian(), [-1.0, 2.0], [1.0]) == pytest.approx(expected, rel=1e-14)


def test_distortion_empirical_uses_lower_tie_rule():
    e = Empirical([0.0, 1.0, 2.0])
    # threshold exactly at 1: the sample 1.0 belongs to the lower cell (level 0)
    assert distortion(e, [0.0, 2.0], [1.0]) == pytest.approx(1 / 3)
    assert distortion(e, [0.0, 1.0, 2.0]) == 0.0


def test_levels_outside_the_support_are_fine():
    # uniform on [-1, 1] (d = 3), levels -2, 0.5, 3: cells (-1, -0.75], (-0.75, 1], and an empty one
    expected = (((-0.75 + 2) ** 3 - (-1 + 2) ** 3) + ((1 - 0.5) ** 3 - (-0.75 - 0.5) ** 3)) / 6
    assert distortion(SphereMarginal(3), [-2.0, 0.5, 3.0]) == pytest.approx(expected, rel=1e-14)


def test_mis_scaled_table_distortion_is_exact():
    """N(0,1) levels on unit-vector coordinates at d=128: all but ~1e-8 of the mass falls in the two
    inner cells (+-c, c = 0.245), so D = c^2 - 2c E|X| + 1/d with E|X| = G(d/2)/(sqrt(pi) G((d+1)/2))."""
    d = 128
    levels = lloyd_max(Gaussian(), 3).levels
    c = levels[4]
    e_abs = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    assert distortion(SphereMarginal(d), levels) == pytest.approx(c * c - 2 * c * e_abs + 1 / d, rel=1e-7)


def test_audit_of_the_optimum_is_clean():
    cb = lloyd_max(SphereMarginal(128), 4)
    rep = audit(SphereMarginal(128), cb.levels)
    assert abs(rep.excess_percent) < 1e-10
    assert rep.max_level_error < 1e-12
    assert rep.best_scale == pytest.approx(1.0, abs=1e-6)
    assert rep.unit_distortion == pytest.approx(0.009315, rel=1e-3)
    assert "excess" in rep.summary() and rep.to_dict()["bits"] == 4


def test_audit_detects_a_mis_scaled_table():
    """N(0,1) levels shipped for unit vectors without the 1/sqrt(d) factor."""
    d = 128
    rep = audit(SphereMarginal(d), lloyd_max(Gaussian(), 3).levels)
    assert rep.excess_percent > 1000
    # the best rescaling is close to 1/sqrt(d) (the sphere marginal is N(0, 1/d) up to O(1/d))
    assert rep.best_scale == pytest.approx(1 / math.sqrt(d), rel=0.01)
    assert 0 <= rep.rescaled_excess_percent < 0.5


def _plain_lloyd(density, bits, iterations):
    """A capped Lloyd iteration from uniform levels, using the closed-form cell moments."""
    k = 2**bits
    lo, hi = density.support
    s = density.scale
    c = np.linspace(max(lo, -3 * s), min(hi, 3 * s), k + 2)[1:-1]
    for _ in range(iterations):
        t = np.concatenate([[lo], 0.5 * (c[:-1] + c[1:]), [hi]])
        m0, m1, _ = density.cell_moments(t[:-1], t[1:])
        c = m1 / m0
    return c


@pytest.mark.parametrize("bits", [6, 7])
def test_audit_quantifies_early_stopped_lloyd(bits):
    """300 Lloyd iterations leave a visible excess at 6-7 bits (docs/references/quantization.md)."""
    dens = SphereMarginal(128)
    rep = audit(dens, _plain_lloyd(dens, bits, 300))
    assert rep.excess_percent > 1.0
    more = audit(dens, _plain_lloyd(dens, bits, 1200))
    assert 0 < more.excess_percent < rep.excess_percent


def test_audit_validation():
    with pytest.raises(ValueError, match="levels must have 2\\*\\*b entries"):
        audit(Gaussian(), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="levels must have 2\\*\\*b entries"):
        audit(Gaussian(), [0.0])
    with pytest.raises(ValueError, match="levels must be strictly increasing"):
        audit(Gaussian(), [1.0, 0.0])
    with pytest.raises(ValueError, match="levels must be finite"):
        distortion(Gaussian(), [0.0, np.nan])
    with pytest.raises(ValueError, match="levels must be strictly increasing"):
        distortion(Gaussian(), [0.0, 0.0])
    with pytest.raises(ValueError, match="thresholds must have len\\(levels\\) - 1 = 1"):
        distortion(Gaussian(), [0.0, 1.0], [0.1, 0.2])
    with pytest.raises(ValueError, match="thresholds must be strictly increasing"):
        distortion(Gaussian(), [0.0, 1.0, 2.0], [0.5, 0.5])
    with pytest.raises(ValueError, match="levels must be 1-D"):
        distortion(Gaussian(), [[0.0, 1.0]])
    with pytest.raises(TypeError, match="density must be a Density"):
        distortion(None, [0.0, 1.0])


def test_polar_audit_scales_about_the_centre():
    cb = lloyd_max(PolarAngle(3), 2)
    c = PolarAngle(3).center
    rep = audit(PolarAngle(3), c + 1.3 * (cb.levels - c))
    assert rep.excess_percent > 1
    assert rep.best_scale == pytest.approx(1 / 1.3, rel=1e-6)
    assert abs(rep.rescaled_excess_percent) < 1e-8


def _mp_best_scale(levels, thresholds, start):
    """argmin of D(s) for N(0, 1), from the closed-form cell moments in 40-digit mpmath (independent
    of codebooks): the root of dD/ds next to ``start``."""
    import mpmath as mp

    mp.mp.dps = 40
    a = [mp.mpf(float(v)) for v in levels]
    t = [mp.mpf(float(v)) for v in thresholds]

    def D(s):
        edges = [-mp.inf] + [s * v for v in t] + [mp.inf]
        total = mp.mpf(0)
        for i, ai in enumerate(a):
            lo, hi = edges[i], edges[i + 1]
            phi = (lambda z: mp.npdf(z) if z not in (mp.inf, -mp.inf) else mp.mpf(0))
            m0 = mp.ncdf(hi) - mp.ncdf(lo)
            m1 = phi(lo) - phi(hi)
            m2 = m0 + (lo * phi(lo) if lo != -mp.inf else 0) - (hi * phi(hi) if hi != mp.inf else 0)
            total += m2 - 2 * s * ai * m1 + s * s * ai * ai * m0
        return total

    return float(mp.findroot(lambda s: mp.diff(D, s), mp.mpf(start), tol=mp.mpf(10) ** -30))


@pytest.mark.parametrize("factor", [1.0, 1e-140, 1e-50, 1e50, 1e140])
@pytest.mark.parametrize("midpoints", [True, False])
def test_best_scale_is_exact_far_from_the_optimum(factor, midpoints):
    """Issue 53: best_scale lost precision far from the optimum (1.4e-6 relative for a table 1e+-140
    off its scale; a Gaussian table 1e50 off even hung in the tail quadrature). Now within 1e-13 of
    the 40-digit minimiser, with midpoint thresholds and with the table's own (shifted) ones."""
    lv = lloyd_max(Gaussian(), 3).levels * 0.7
    th = 0.5 * (lv[:-1] + lv[1:]) + (0 if midpoints else 0.01 * np.sign(lv[1:] + lv[:-1] + 1e-9))
    rep = audit(Gaussian(), lv * factor, None if midpoints else th * factor)
    want = _mp_best_scale(lv, th, 1 / 0.7) / factor
    assert rep.best_scale == pytest.approx(want, rel=1e-13)
