"""Bounds and constants against exact Lloyd-Max tables, mpmath and Monte Carlo."""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codebooks import Gaussian, PolarAngle, SphereMarginal, lloyd_max
from tests.mpref import mp_breakpoints, mp_pdf
from theory import (ECSQ_CONSTANT, TQ_CONSTANT, bias_factor, cube_root_integral, entropy_coded_curve,
                    entropy_coded_limit, gap_curve, inner_product_lower_bound, lloyd_max_curve, panter_dite,
                    qjl_prod_distortion, qjl_variance, qjl_variance_bound, shannon_lower_bound,
                    sphere_unit_distortion, turboquant_mse_bound, turboquant_prod_bound,
                    turboquant_prod_refined)

dims = st.integers(2, 16).flatmap(lambda e: st.integers(max(3, 2 ** (e - 1)), 2**e))


@given(dims, st.integers(1, 12))
@settings(max_examples=30)
def test_shannon_le_lloyd_max_le_turboquant(d, bits):
    """For d >= 3 (d = 2 is the exception; see tests/codebooks/test_solver.py)."""
    D = lloyd_max_curve(SphereMarginal(d), [bits])[0]
    assert shannon_lower_bound(bits) * (1 - 1e-12) <= D <= turboquant_mse_bound(bits)


@pytest.mark.parametrize("density", [Gaussian(), SphereMarginal(64), SphereMarginal(1024), PolarAngle(3)],
                         ids=repr)
def test_panter_dite_over_exact_tends_to_one(density):
    b = np.arange(1, 13)
    ratio = panter_dite(density, b) / lloyd_max_curve(density, b)
    assert np.all(ratio > 1) and np.all(np.diff(ratio) < 0)
    assert ratio[-1] - 1 < 1e-3
    # the high-rate error is O(4^-b) relative here: each bit divides the excess by about 2
    assert np.all(ratio[6:-1] - 1 < 2.2 * (ratio[7:] - 1))


def test_gaps_at_one_bit_and_high_rate():
    g = gap_curve(Gaussian(), np.arange(1, 13))
    assert g[0] == pytest.approx(4 * (1 - 2 / math.pi), rel=1e-13)  # 1.4535
    assert g[0] == pytest.approx(1.45, abs=0.01)
    assert np.all(np.diff(g) > 0) and TQ_CONSTANT - g[-1] < 2e-3
    s = gap_curve(SphereMarginal(128), [1])[0]
    assert s == pytest.approx(1.4436, abs=1e-4)


def test_gaussian_panter_dite_is_the_turboquant_constant():
    assert panter_dite(Gaussian(2.0), 3.0) == pytest.approx(turboquant_mse_bound(3.0), rel=1e-14)


@pytest.mark.parametrize("density", [SphereMarginal(2), SphereMarginal(3), SphereMarginal(9),
                                     SphereMarginal(4096), Gaussian(0.7), PolarAngle(1), PolarAngle(2),
                                     PolarAngle(6)], ids=repr)
def test_cube_root_integral_matches_mpmath(density):
    mp.mp.dps = 30
    f = mp_pdf(density)
    ref = mp.quad(lambda x: f(x) ** (mp.mpf(1) / 3), mp_breakpoints(density, span=40))
    assert cube_root_integral(density) == pytest.approx(float(ref), rel=1e-13)


@pytest.mark.parametrize("density", [Gaussian(), SphereMarginal(3), SphereMarginal(5), SphereMarginal(16),
                                     SphereMarginal(128), SphereMarginal(1024)], ids=repr)
def test_entropy_coded_is_below_fixed_rate(density):
    b = np.arange(1, 13)
    ec = entropy_coded_curve(density, b.astype(float))
    lm = lloyd_max_curve(density, b)
    assert np.all(ec <= lm * (1 + 1e-9))  # equality at 1 bit (midrise) and for the uniform d = 3


@pytest.mark.parametrize("d, worse", [(2, (2, 3, 4)), (4, (2,))])
def test_entropy_coded_loses_at_low_rate_for_edge_heavy_densities(d, worse):
    """Uniform thresholds are not optimal cells: for the arcsine (d=2) and semicircle (d=4)
    densities, whose mass sits towards +-1, Lloyd-Max beats them at a few low rates."""
    b = np.arange(1, 13)
    ratio = entropy_coded_curve(SphereMarginal(d), b.astype(float)) / lloyd_max_curve(SphereMarginal(d), b)
    assert [int(v) for v in b[ratio > 1 + 1e-9]] == list(worse)


def test_entropy_coded_high_rate_limit():
    b = np.arange(8, 13).astype(float)
    ec = entropy_coded_curve(Gaussian(), b)
    assert np.allclose(ec / entropy_coded_limit(b), 1.0, atol=2e-4)
    assert ECSQ_CONSTANT == pytest.approx(1.4233, abs=1e-4)
    assert np.all(ec > shannon_lower_bound(b))


def test_prod_bounds_order():
    d = 128
    b = np.arange(1, 9)
    exact = qjl_prod_distortion(b, d)
    refined = turboquant_prod_refined(b, d)
    assert np.all(inner_product_lower_bound(b.astype(float), d) < exact)
    assert np.all(exact < refined) and np.all(refined <= turboquant_prod_bound(b.astype(float), d))
    # docs/references/quantization.md: ~1.57/d, 0.56/d, 0.18/d at b = 1..3 (the paper rounds D_mse(2) to 0.117)
    assert np.allclose(d * refined[:3], [1.5708, 0.5669, 0.1822], atol=5e-4)
    assert sphere_unit_distortion(d, 0) == 1.0


def test_bias_factor_closed_forms():
    assert bias_factor(lloyd_max(Gaussian(), 1)) == pytest.approx(2 / math.pi, rel=1e-14)
    for bits in (2, 5, 9):
        cb = lloyd_max(SphereMarginal(96), bits)
        assert bias_factor(cb) == pytest.approx(1 - cb.unit_distortion, rel=1e-12)


def test_qjl_variance_formula():
    assert qjl_variance(8, 1.0, 2.0, 0.0) == pytest.approx(math.pi / 2 * 4 / 8)
    assert qjl_variance(8, 1.0, 2.0, 1.5) < qjl_variance_bound(8, 1.0, 2.0)
    with pytest.raises(ValueError, match="inner must satisfy"):
        qjl_variance(8, 1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="m must be >= 1"):
        qjl_variance(0, 1.0, 1.0, 0.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="bits must be finite and >= 0"):
        shannon_lower_bound(-1)
    with pytest.raises(ValueError, match="bits must be finite and >= 0"):
        turboquant_mse_bound(float("nan"))
    with pytest.raises(ValueError, match="d must be >= 2"):
        inner_product_lower_bound(3, 1)
    with pytest.raises(ValueError, match="bits must be >= 1"):
        turboquant_prod_refined(0, 64)
    with pytest.raises(ValueError, match="bits must be integers in 0..12"):
        sphere_unit_distortion(64, 2.5)
    with pytest.raises(ValueError, match="y_norm must be finite and > 0"):
        turboquant_prod_bound(3, 64, y_norm=0.0)
    with pytest.raises(TypeError, match="no closed form"):
        from codebooks import Empirical

        cube_root_integral(Empirical([0.0, 1.0]))


# ---------------------------------------------------------------------------------------------
# Monte Carlo (fixed seeds; n chosen so the standard error is below 1% of the value; 4.5 SE)


def _haar(d, rng):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def _unit(n, d, rng):
    g = rng.standard_normal((n, d))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


@pytest.mark.parametrize("d, bits", [(16, 1), (64, 2), (64, 4), (128, 3)])
def test_rotated_unit_vector_mse_matches_d_times_mse(d, bits):
    rng = np.random.default_rng(100 + d + bits)
    cb = lloyd_max(SphereMarginal(d), bits)
    pi = _haar(d, rng)
    x = _unit(40_000, d, rng)
    z = x @ pi.T
    xhat = cb.levels[cb.quantize(z)] @ pi
    err = np.sum((x - xhat) ** 2, axis=1)
    se = err.std(ddof=1) / math.sqrt(err.size)
    assert se < 0.01 * cb.unit_distortion
    assert abs(err.mean() - cb.unit_distortion) <= 4.5 * se


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_turboquant_prod_matches_exact_formula(bits):
    """(b-1)-bit MSE + QJL on the residual with a fresh Gaussian S per sample."""
    d, n = 16, 40_000
    rng = np.random.default_rng(7 + bits)
    pi = _haar(d, rng)
    y = _unit(1, d, rng)[0]
    x = _unit(n, d, rng)
    if bits > 1:
        cb = lloyd_max(SphereMarginal(d), bits - 1)
        xm = cb.levels[cb.quantize(x @ pi.T)] @ pi
    else:
        xm = np.zeros_like(x)
    r = x - xm
    S = rng.standard_normal((n, d, d))
    signs = np.sign(np.einsum("nij,nj->ni", S, r))
    xhat = xm + (math.sqrt(math.pi / 2) / d) * np.linalg.norm(r, axis=1, keepdims=True) * \
        np.einsum("nij,ni->nj", S, signs)
    err2 = (x @ y - xhat @ y) ** 2
    exact = qjl_prod_distortion(bits, d)
    se = err2.std(ddof=1) / math.sqrt(n)
    assert se < 0.01 * exact
    assert abs(err2.mean() - exact) <= 4.5 * se
    # and it is unbiased: regression of <y, x_hat> on <y, x> has slope 1
    u, v = x @ y, xhat @ y
    slope = np.dot(u, v) / np.dot(u, u)
    resid = v - slope * u
    slope_se = math.sqrt(np.dot(resid, resid) / (n - 1) / np.dot(u, u))
    assert abs(slope - 1) <= 4.5 * slope_se


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_bias_factor_matches_monte_carlo(bits):
    d, n = 64, 40_000
    rng = np.random.default_rng(11 + bits)
    cb = lloyd_max(SphereMarginal(d), bits)
    pi = _haar(d, rng)
    y = _unit(1, d, rng)[0]
    x = _unit(n, d, rng)
    xhat = cb.levels[cb.quantize(x @ pi.T)] @ pi
    u, v = x @ y, xhat @ y
    slope = np.dot(u, v) / np.dot(u, u)
    resid = v - slope * u
    slope_se = math.sqrt(np.dot(resid, resid) / (n - 1) / np.dot(u, u))
    assert slope_se < 0.01 * slope
    assert abs(slope - bias_factor(cb)) <= 4.5 * slope_se


def test_qjl_variance_matches_monte_carlo():
    d, m, n = 32, 64, 40_000
    rng = np.random.default_rng(5)
    q = rng.standard_normal(d)
    k = rng.standard_normal(d)
    S = rng.standard_normal((n, m, d))
    est = math.sqrt(math.pi / 2) / m * np.linalg.norm(k) * np.einsum("nmd,d,nm->n", S, q,
                                                                     np.sign(S @ k))
    var = qjl_variance(m, np.linalg.norm(q), np.linalg.norm(k), float(q @ k))
    c = est - est.mean()
    se_var = math.sqrt(np.var(c * c, ddof=1) / n)  # standard error of the sample variance
    assert se_var < 0.01 * var
    assert abs(np.var(est, ddof=1) - var) <= 4.5 * se_var
    se_mean = math.sqrt(var / n)
    assert abs(est.mean() - q @ k) <= 4.5 * se_mean  # unbiased
