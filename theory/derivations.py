"""Symbolic derivations (sympy) behind the closed forms used by ``codebooks`` and ``theory``.

Each function returns the symbolic result; the tests differentiate, simplify or evaluate it
against an independent computation.
"""

from __future__ import annotations

import sympy as sp

__all__ = ["sphere_density", "sphere_first_moment_antiderivative", "sphere_second_moment_identity",
           "sphere_cube_root_integral", "gaussian_limit", "gaussian_panter_dite_constant",
           "one_bit_gaussian_optimum", "polar_angle_density"]

x, z = sp.symbols("x z", real=True)
d = sp.symbols("d", positive=True)
k = sp.symbols("k", positive=True)


def sphere_density(dim=d):
    """``f_d(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2)`` on [-1, 1]."""
    return sp.gamma(dim / 2) / (sp.sqrt(sp.pi) * sp.gamma((dim - 1) / 2)) * (1 - x**2) ** ((dim - 3) / 2)


def sphere_first_moment_antiderivative(exponent=k):
    """``F(x) = -(1 - x^2)^(k+1) / (2 (k+1))``, an antiderivative of ``x (1 - x^2)^k``.

    Returns
    -------
    (F, integrand) : tuple of sympy expressions in ``x``
    """
    F = -((1 - x**2) ** (exponent + 1)) / (2 * (exponent + 1))
    return F, x * (1 - x**2) ** exponent


def sphere_second_moment_identity(exponent=k):
    """``x^2 (1-x^2)^k - [(1-x^2)^k - (1-x^2)^(k+1)]``, which is identically 0.

    With it the second cell moment of the sphere marginal is two incomplete-beta terms
    (:ref:`ref-sphere-density`); its one-sided form is the Beta(3/2, (d-1)/2) law of X^2.
    """
    return x**2 * (1 - x**2) ** exponent - ((1 - x**2) ** exponent - (1 - x**2) ** (exponent + 1))


def sphere_cube_root_integral(dim=d):
    """``int_{-1}^{1} f_d^(1/3) dx = C_d^(1/3) B(1/2, (d-3)/6 + 1)`` (Panter-Dite's integral).

    Uses ``int_{-1}^{1} (1-x^2)^a dx = B(1/2, a+1) = Gamma(1/2) Gamma(a+1) / Gamma(a+3/2)``.
    """
    c = sp.gamma(dim / 2) / (sp.sqrt(sp.pi) * sp.gamma((dim - 1) / 2))
    a = (dim - 3) / 6
    return c ** sp.Rational(1, 3) * sp.gamma(sp.Rational(1, 2)) * sp.gamma(a + 1) / sp.gamma(a + sp.Rational(3, 2))


def gaussian_limit():
    """``lim_{d->oo} f_d(z / sqrt(d)) / sqrt(d)``: the standard normal density in z."""
    g = sphere_density(d).subs(x, z / sp.sqrt(d)) / sp.sqrt(d)
    return sp.simplify(sp.limit(g, d, sp.oo))


def gaussian_panter_dite_constant():
    """``(1/12) (int phi^(1/3))^3 = sqrt(3) pi / 2`` (TurboQuant's constant)."""
    phi = sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi)
    return sp.simplify(sp.integrate(phi ** sp.Rational(1, 3), (x, -sp.oo, sp.oo)) ** 3 / 12)


def one_bit_gaussian_optimum():
    """The 1-bit Lloyd-Max quantizer of N(0,1): level ``sqrt(2/pi)``, mse ``1 - 2/pi``.

    The threshold is 0 by symmetry; the level is the centroid ``2 int_0^oo x phi``, and the mse is
    ``E[X^2] - level^2`` (centroid condition).

    Returns
    -------
    (level, mse) : tuple of sympy expressions
    """
    phi = sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi)
    level = sp.simplify(2 * sp.integrate(x * phi, (x, 0, sp.oo)))
    return level, sp.simplify(1 - level**2)


def polar_angle_density(level: int):
    """PolarQuant's level-l angle density from the Beta(m/2, m/2) law of sin^2 psi, m = 2^(l-1).

    ``u = sin^2 psi`` has density ``u^(m/2-1) (1-u)^(m/2-1) / B(m/2, m/2)`` and ``du = sin(2 psi)
    dpsi``; the result should equal :ref:`ref-polarquant`'s
    ``Gamma(m) / (2^(m-2) Gamma(m/2)^2) sin^(m-1)(2 psi)``.

    Returns
    -------
    (derived, reference) : tuple of sympy expressions in ``psi``
    """
    psi = sp.symbols("psi", positive=True)
    m = sp.Integer(2) ** (level - 1)
    u = sp.sin(psi) ** 2
    beta = sp.gamma(m / 2) ** 2 / sp.gamma(m)
    derived = u ** (m / 2 - 1) * (1 - u) ** (m / 2 - 1) / beta * sp.diff(u, psi)
    reference = sp.gamma(m) / (2 ** (m - 2) * sp.gamma(m / 2) ** 2) * sp.sin(2 * psi) ** (m - 1)
    return derived, reference
