"""The sympy derivations: each result is checked by differentiation, simplification or numbers."""

from __future__ import annotations

import math

import mpmath as mp
import pytest
import sympy as sp

from codebooks import SphereMarginal
from theory import cube_root_integral
from theory import derivations as dv


def test_first_moment_antiderivative_differentiates_back():
    F, integrand = dv.sphere_first_moment_antiderivative()
    assert sp.simplify(sp.diff(F, dv.x) - integrand) == 0


def test_second_moment_identity_vanishes():
    assert sp.simplify(dv.sphere_second_moment_identity()) == 0


@pytest.mark.parametrize("d", [2, 3, 5, 12, 128])
def test_cube_root_integral_matches_quadrature_and_codebooks(d):
    expr = dv.sphere_cube_root_integral(sp.Integer(d))
    value = float(sp.N(expr, 30))
    mp.mp.dps = 30
    c = mp.gamma(mp.mpf(d) / 2) / (mp.sqrt(mp.pi) * mp.gamma(mp.mpf(d - 1) / 2))
    ref = mp.quad(lambda x: (c * (1 - x * x) ** (mp.mpf(d - 3) / 2)) ** (mp.mpf(1) / 3), [-1, 0, 1])
    assert value == pytest.approx(float(ref), rel=1e-20)
    assert cube_root_integral(SphereMarginal(d)) == pytest.approx(value, rel=1e-13)


def test_d3_cube_root_integral_is_elementary():
    assert sp.simplify(dv.sphere_cube_root_integral(sp.Integer(3)) - 2 * sp.Rational(1, 2) ** sp.Rational(1, 3)) == 0


def test_gaussian_limit_is_standard_normal():
    assert sp.simplify(dv.gaussian_limit() - sp.exp(-dv.z**2 / 2) / sp.sqrt(2 * sp.pi)) == 0


def test_gaussian_panter_dite_constant():
    assert sp.simplify(dv.gaussian_panter_dite_constant() - sp.sqrt(3) * sp.pi / 2) == 0


def test_one_bit_optimum():
    level, mse = dv.one_bit_gaussian_optimum()
    assert sp.simplify(level - sp.sqrt(2 / sp.pi)) == 0
    assert sp.simplify(mse - (1 - 2 / sp.pi)) == 0
    assert float(mse) == pytest.approx(0.36338022763241866, rel=1e-15)


@pytest.mark.parametrize("level", [2, 3, 4])
def test_polar_angle_density_from_beta_law(level):
    derived, reference = dv.polar_angle_density(level)
    psi = next(iter(derived.free_symbols))
    assert sp.simplify(sp.expand_trig(derived - reference)) == 0 or all(
        abs(float((derived - reference).subs(psi, v))) < 1e-14 for v in (0.1, 0.5, 0.9, 1.3))
    # and it integrates to one
    assert float(sp.integrate(reference, (psi, 0, sp.pi / 2))) == pytest.approx(1.0, rel=1e-14)
    assert math.isclose(float(reference.subs(psi, sp.pi / 4)), float(
        sp.gamma(2 ** (level - 1)) / (2 ** (2 ** (level - 1) - 2) * sp.gamma(2 ** (level - 2)) ** 2)), rel_tol=1e-14)
