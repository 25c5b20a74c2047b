"""One-dimensional densities that codebooks are solved for.

Each density is a small frozen dataclass with validated parameters (scipy.stats style):
``pdf``, ``cdf``, ``sf``, ``mean``, ``second_moment``, ``var`` and exact ``cell_moments(a, b)``
returning the integrals of ``x**k f(x)`` over ``[a, b]`` for k = 0, 1, 2.

Notes
-----
Closed forms (:ref:`ref-sphere-density`):

* ``SphereMarginal(d)``: one coordinate of a uniform point on S^{d-1},
  ``f_d(x) = C_d (1 - x^2)^{(d-3)/2}`` with ``C_d = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2))``;
  ``(X+1)/2 ~ Beta((d-1)/2, (d-1)/2)``, so cell masses are regularized incomplete beta
  differences (upper tails for x > 0). ``int x f = C_d [(1-a^2)^p - (1-b^2)^p] / (2p)`` with
  ``p = (d-1)/2`` is evaluated as ``A^p * -expm1(p log(B/A))`` (no cancellation). For the second
  moment, ``x^2 f`` on [0, u] integrates to ``I_{u^2}(3/2, (d-1)/2) / (2d)`` (X^2 is
  Beta(1/2, (d-1)/2); its size-biased law is Beta(3/2, (d-1)/2)), one positive term per side of 0
  (the identity ``x^2 (1-x^2)^k = (1-x^2)^k - (1-x^2)^{k+1}`` of :ref:`ref-sphere-density` would cancel near 0).
* ``Gaussian(sigma)``: ``P = Phi(b) - Phi(a)`` (tail-aware), ``int x phi = phi(a) - phi(b)``
  (as ``phi(a) * -expm1(-(b^2-a^2)/2)``); ``int x^2 phi`` via the chi-square(3) law of the
  size-biased X^2 (regularized incomplete gamma, each side of 0 separately, tail-aware).
* ``PolarAngle(level)``: PolarQuant's angle at recursion level l (:ref:`ref-polarquant`).
  Level 1 is uniform on [0, 2 pi). For l >= 2, with ``m = 2^(l-1)``,
  ``f(psi) = Gamma(m) / (2^(m-2) Gamma(m/2)^2) sin^(m-1)(2 psi)`` on [0, pi/2]; ``sin^2 psi``
  is Beta(m/2, m/2), which gives the mass in closed form and ``Var = psi_1(1 + (m-1)/2) / 8``
  (trigamma; from the characteristic function of a cos^n density). The first and second
  moments over a cell have no cancellation-free closed form for large m; they are integrated
  by Gauss-Legendre in ``theta = 2 psi - pi/2`` where the integrand ``theta^k cos^n theta`` is
  entire (``codebooks._quad``), exact to rounding.

The discrete ``Empirical`` density (data-driven codebooks) lives in ``codebooks.empirical``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
from scipy import special

from . import _quad
from ._validate import check_int, check_positive

__all__ = ["Density", "SphereMarginal", "Gaussian", "PolarAngle", "density_from_params"]

#: Level 16 covers blocks of d = 2^16 coordinates. Beyond it the angle's spread (~2^(-l/2)) is so
#: small next to pi/4 that float64 angles cannot resolve levels to 1e-13 of a standard deviation.
MAX_POLAR_LEVEL = 16
#: Scales (Gaussian sigma, Empirical spread and magnitude) for which the variance and a 12-bit
#: distortion (about 1.6e-7 sigma^2) are normal float64 numbers: outside it mse would underflow to
#: 0 or a denormal, or sigma^2 would overflow, so such densities are refused.
SCALE_RANGE = (1e-150, 1e150)


@dataclass(frozen=True)
class QuadSpec:
    """How a continuous density maps onto the Gauss-Legendre engine of ``codebooks._quad``."""

    kind: int
    n: float
    logc: float
    a0: float
    a1: float
    t_lo: float
    t_hi: float
    hmax: float

    def t_of_x(self, x) -> np.ndarray:
        """Natural variable t for x, clipped to the support."""
        u = (np.asarray(x, dtype=np.float64) - self.a0) / self.a1
        if self.kind == _quad.COS_SIN:
            return np.arcsin(np.clip(u, -1.0, 1.0))
        return np.clip(u, self.t_lo, self.t_hi)

    def pdf_x(self, t) -> np.ndarray:
        """Density in x at the points with natural variable t (strictly inside the support)."""
        t = np.asarray(t, dtype=np.float64)
        if self.kind == _quad.GAUSS:
            logw = -0.5 * t * t
            jac = np.full_like(t, self.a1)
        elif self.kind in (_quad.COS_SIN, _quad.COS_LIN):
            c = np.cos(t)
            with np.errstate(divide="ignore"):
                logcos = np.where(np.abs(t) < np.pi / 4, 0.5 * np.log1p(-np.sin(t) ** 2), np.log(c))
                logw = self.n * logcos if self.n != 0.0 else np.zeros_like(t)
            jac = self.a1 * (c if self.kind == _quad.COS_SIN else np.ones_like(t))
        else:
            logw = np.zeros_like(t)
            jac = np.full_like(t, self.a1)
        with np.errstate(divide="ignore"):
            return np.exp(self.logc + logw) / jac

    def integrals(self, t_lo, t_hi, ref):
        """P, R, D per cell: integrals of (1, x-ref, (x-ref)^2) f over [t_lo, t_hi] (t units)."""
        return _quad.cell_integrals(
            self.kind, self.n, self.logc, self.a0, self.a1,
            np.ascontiguousarray(t_lo, dtype=np.float64),
            np.ascontiguousarray(t_hi, dtype=np.float64),
            np.ascontiguousarray(ref, dtype=np.float64),
            self.hmax, _quad.NODES, _quad.WEIGHTS,
        )


class Density(ABC):
    """Base class of the 1-D densities (see module docstring for the math)."""

    kind: ClassVar[str]
    #: True for ``Empirical``: solved by exact discrete Lloyd instead of Newton.
    is_discrete: ClassVar[bool] = False

    # --- description -------------------------------------------------------------------
    @property
    @abstractmethod
    def support(self) -> tuple[float, float]:
        """(lo, hi) of the support."""

    @property
    def center(self) -> float | None:
        """Centre of symmetry, or None for an asymmetric density."""
        return None

    @property
    @abstractmethod
    def mean(self) -> float:
        """E[X]."""

    @property
    @abstractmethod
    def var(self) -> float:
        """Var[X]."""

    @property
    def second_moment(self) -> float:
        """E[X^2]."""
        return self.var + self.mean**2

    @property
    def scale(self) -> float:
        """Standard deviation, the unit for relative tolerances."""
        return math.sqrt(self.var)

    @abstractmethod
    def params(self) -> dict:
        """JSON-serialisable parameters (what the table manifest records)."""

    @property
    @abstractmethod
    def label(self) -> str:
        """Short identifier used in table names, e.g. ``sphere_d128``."""

    # --- distribution functions ---------------------------------------------------------
    @abstractmethod
    def cdf(self, x) -> np.ndarray:
        """P(X <= x)."""

    @abstractmethod
    def sf(self, x) -> np.ndarray:
        """P(X > x), accurate in the upper tail."""

    def _mass(self, a, b) -> np.ndarray:
        """P(a < X <= b) from tail-aware CDF differences (no 1 - 1 cancellation in tails)."""
        lo, hi = self.support
        a = np.clip(np.asarray(a, dtype=np.float64), lo, hi)
        b = np.clip(np.asarray(b, dtype=np.float64), lo, hi)
        c = self.center if self.center is not None else self.mean
        upper = self.sf(a) - self.sf(b)
        lower = self.cdf(b) - self.cdf(a)
        mid = 1.0 - self.cdf(a) - self.sf(b)
        out = np.where(a >= c, upper, np.where(b <= c, lower, mid))
        return np.where(b > a, np.maximum(out, 0.0), 0.0)

    @staticmethod
    def _even_integral(a, b, lower, upper, switch):
        """int_a^b g for an even g >= 0 with G(u) = int_0^u g (``lower``), Gc(u) = int_u^inf g
        (``upper``): each side of 0 is one tail-aware difference, so no term cancels the other.
        """
        def piece(u, v):
            with np.errstate(invalid="ignore"):
                return np.where(u >= switch, upper(u) - upper(v), lower(v) - lower(u))

        up = piece(np.maximum(a, 0.0), np.maximum(b, 0.0))
        down = piece(-np.minimum(b, 0.0), -np.minimum(a, 0.0))
        return np.maximum(up, 0.0) + np.maximum(down, 0.0)

    @abstractmethod
    def cell_moments(self, a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact ``(int f, int x f, int x^2 f)`` over ``[a, b]`` (arrays broadcast).

        Parameters
        ----------
        a, b : array_like of float
            Cell ends; values outside the support are clipped to it.

        Returns
        -------
        m0, m1, m2 : ndarray of float64
        """

    # --- solver hooks -------------------------------------------------------------------
    def _quad(self) -> QuadSpec:  # pragma: no cover - overridden by continuous densities
        raise TypeError(f"{type(self).__name__} has no quadrature form")

    @abstractmethod
    def _compander(self, p) -> np.ndarray:
        """Quantiles of the normalised f^(1/3) (Panter-Dite point density): initial levels."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def _log_gamma_half_ratio(x: float) -> float:
    """log(Gamma(x + 1/2) / Gamma(x)) for x > 0, accurate to ~eps * |log x|.

    ``lgamma(x + 1/2) - lgamma(x)`` loses eps * lgamma(x) (2e-11 relative at x = 32768);
    for x >= 30 the Stirling series of the difference is used instead,
    ``log x / 2 + (x log1p(1/(2x)) - 1/2) + S(x + 1/2) - S(x)`` with
    ``S(z) = 1/(12z) - 1/(360z^3) + 1/(1260z^5) - 1/(1680z^7)`` (truncation < 1e-17).
    """
    if x < 30.0:
        return math.log(math.gamma(x + 0.5) / math.gamma(x))

    def series(z):
        z2 = z * z
        return (1 / 12 - (1 / 360 - (1 / 1260 - 1 / (1680 * z2)) / z2) / z2) / z

    return 0.5 * math.log(x) + (x * math.log1p(0.5 / x) - 0.5) + (series(x + 0.5) - series(x))


def _log1m_sq(x):
    """log(1 - x^2) to relative accuracy: log1p(-x^2) near 0, log((1-x)(1+x)) near +-1."""
    with np.errstate(divide="ignore"):
        return np.where(x * x < 0.5, np.log1p(-x * x), np.log((1.0 - x) * (1.0 + x)))


def _pow_diff(a, b, p):
    """(1-a^2)^p - (1-b^2)^p for |a|, |b| <= 1 and p > 0, with relative accuracy.

    Written as ``A^p * -expm1(p log(B/A))`` with ``log(B/A) = log1p((a-b)(a+b)/A)``; ``A^p`` is
    ``exp(p log1p(-a^2))`` because ``pow(1 - a^2, p)`` would lose p * eps / a^2 for large p.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    swap = np.abs(b) < np.abs(a)  # make A = 1 - a^2 the larger base
    lo_x = np.where(swap, b, a)
    hi_x = np.where(swap, a, b)
    A = (1.0 - lo_x) * (1.0 + lo_x)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_log = np.log1p((lo_x - hi_x) * (lo_x + hi_x) / A)
        val = np.exp(p * _log1m_sq(lo_x)) * -np.expm1(p * ratio_log)
    return np.where(A > 0.0, np.where(swap, -val, val), 0.0)


@dataclass(frozen=True, repr=False)
class SphereMarginal(Density):
    """One coordinate of a uniform point on the unit sphere S^{d-1} in R^d.

    Parameters
    ----------
    d : int
        Dimension, ``d >= 2``. d=2 is the arcsine density, d=3 the uniform on [-1, 1].
    """

    d: int
    kind: ClassVar[str] = "sphere"

    def __post_init__(self):
        object.__setattr__(self, "d", check_int("d", self.d, lo=2))

    @property
    def support(self):
        return (-1.0, 1.0)

    @property
    def center(self):
        return 0.0

    @property
    def mean(self):
        return 0.0

    @property
    def var(self):
        return 1.0 / self.d

    def params(self):
        return {"d": self.d}

    @property
    def label(self):
        return f"sphere_d{self.d}"

    @property
    def _logc(self) -> float:
        # C_d = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2))
        return _log_gamma_half_ratio((self.d - 1) / 2) - 0.5 * math.log(math.pi)

    def pdf(self, x):
        x = np.asarray(x, dtype=np.float64)
        k = (self.d - 3) / 2
        inside = np.abs(x) < 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            val = np.exp(self._logc + k * np.log1p(-x * x))
        edge = np.abs(x) == 1.0
        edge_val = np.inf if self.d == 2 else (math.exp(self._logc) if self.d == 3 else 0.0)
        return np.where(inside, val, np.where(edge, edge_val, 0.0))

    def _cdf_beta(self, x, a):
        x = np.clip(np.asarray(x, dtype=np.float64), -1.0, 1.0)
        lower = special.betainc(a, a, 0.5 * (1.0 + x))
        upper = special.betainc(a, a, 0.5 * (1.0 - x))
        return np.where(x <= 0.0, lower, 1.0 - upper)

    def _sf_beta(self, x, a):
        x = np.clip(np.asarray(x, dtype=np.float64), -1.0, 1.0)
        lower = special.betainc(a, a, 0.5 * (1.0 + x))
        upper = special.betainc(a, a, 0.5 * (1.0 - x))
        return np.where(x >= 0.0, upper, 1.0 - lower)

    def cdf(self, x):
        return self._cdf_beta(x, (self.d - 1) / 2)

    def sf(self, x):
        return self._sf_beta(x, (self.d - 1) / 2)

    def cell_moments(self, a, b):
        a = np.clip(np.asarray(a, dtype=np.float64), -1.0, 1.0)
        b = np.clip(np.asarray(b, dtype=np.float64), -1.0, 1.0)
        a, b = np.broadcast_arrays(a, b)
        m0 = self._mass(a, b)
        p = (self.d - 1) / 2
        m1 = math.exp(self._logc) / (2 * p) * _pow_diff(a, b, p)
        m1 = np.where(b > a, m1, 0.0)
        # x^2 f(x) dx on [0, u] is (1/(2d)) I_{u^2}(3/2, (d-1)/2): the size-biased law of X^2
        q2 = (self.d - 1) / 2
        c2 = 0.5 / self.d
        m2 = self._even_integral(
            a, b,
            lambda u: c2 * special.betainc(1.5, q2, u * u),
            lambda u: c2 * special.betainc(q2, 1.5, (1.0 - u) * (1.0 + u)),
            # upper tails only beyond 3 std: scipy's betainc(q2, 3/2, .) loses ~1e-12 relative for
            # large q2, which is harmless only where the tail itself is small
            3.0 * math.sqrt(3.0 / (self.d + 2)),
        )
        return m0, m1, np.where(b > a, m2, 0.0)

    def _quad(self):
        return QuadSpec(_quad.COS_SIN, float(self.d - 2), self._logc, 0.0, 1.0,
                        -math.pi / 2, math.pi / 2, 0.5)

    def _compander(self, p):
        # f^(1/3) ~ (1-x^2)^{(d-3)/6}: (1+x)/2 ~ Beta(a', a') with a' = (d+3)/6
        p = np.asarray(p, dtype=np.float64)
        a = (self.d + 3) / 6
        lo = 2.0 * special.betaincinv(a, a, p) - 1.0
        hi = 1.0 - 2.0 * special.betaincinv(a, a, 1.0 - p)
        return np.where(p <= 0.5, lo, hi)


def _std_normal_pdf(z):
    """phi(z), with phi(+-inf) = 0."""
    finite = np.isfinite(z)
    zf = np.where(finite, z, 0.0)
    return np.where(finite, np.exp(-0.5 * zf * zf), 0.0) / math.sqrt(2 * math.pi)


@dataclass(frozen=True, repr=False)
class Gaussian(Density):
    """Normal density N(0, sigma^2).

    Parameters
    ----------
    sigma : float
        Standard deviation, finite and > 0.
    """

    sigma: float = 1.0
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self):
        sigma = check_positive("sigma", self.sigma)
        if not SCALE_RANGE[0] <= sigma <= SCALE_RANGE[1]:
            raise ValueError(f"sigma must be in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}] (beyond it sigma^2 or the "
                             f"distortion leave the normal float64 range), got {sigma!r}; rescale the data")
        object.__setattr__(self, "sigma", sigma)

    @property
    def support(self):
        return (-math.inf, math.inf)

    @property
    def center(self):
        return 0.0

    @property
    def mean(self):
        return 0.0

    @property
    def var(self):
        return self.sigma**2

    def params(self):
        return {"sigma": self.sigma}

    @property
    def label(self):
        if self.sigma == 1.0:
            return "gaussian"
        # identifier-safe (C header names): 0.5 -> 0p5, 1e-05 -> 1em05
        return "gaussian_s" + repr(self.sigma).replace(".", "p").replace("-", "m").replace("+", "")

    def pdf(self, x):
        z = np.asarray(x, dtype=np.float64) / self.sigma
        return np.exp(-0.5 * z * z) / (self.sigma * math.sqrt(2 * math.pi))

    def cdf(self, x):
        return special.ndtr(np.asarray(x, dtype=np.float64) / self.sigma)

    def sf(self, x):
        return special.ndtr(-np.asarray(x, dtype=np.float64) / self.sigma)

    def cell_moments(self, a, b):
        s = self.sigma
        za = np.asarray(a, dtype=np.float64) / s
        zb = np.asarray(b, dtype=np.float64) / s
        za, zb = np.broadcast_arrays(za, zb)
        m0 = self._mass(za * s, zb * s)
        pa, pb = _std_normal_pdf(za), _std_normal_pdf(zb)
        with np.errstate(invalid="ignore", over="ignore"):
            # phi(a) - phi(b) = phi(a) * -expm1(-(b^2 - a^2)/2) when |b| > |a| (and mirrored)
            d2 = (zb - za) * (zb + za)
            first = np.where(np.abs(zb) >= np.abs(za),
                             pa * -np.expm1(-0.5 * np.where(np.isfinite(d2), d2, np.inf)),
                             -pb * -np.expm1(0.5 * np.where(np.isfinite(d2), d2, -np.inf)))
        m1 = s * np.where(zb > za, first, 0.0)
        # z^2 phi(z) dz on [0, u] is gammainc(3/2, u^2/2) / 2 (chi-square with 3 degrees of freedom)
        m2 = self._even_integral(
            za, zb,
            lambda u: 0.5 * special.gammainc(1.5, 0.5 * u * u),
            lambda u: 0.5 * special.gammaincc(1.5, 0.5 * u * u),
            math.sqrt(3.0),
        )
        return m0, m1, s * s * np.where(zb > za, m2, 0.0)

    def _quad(self):
        return QuadSpec(_quad.GAUSS, 0.0, -0.5 * math.log(2 * math.pi), 0.0, self.sigma,
                        -math.inf, math.inf, 1.0)

    def _compander(self, p):
        # f^(1/3) is N(0, 3 sigma^2)
        return math.sqrt(3.0) * self.sigma * special.ndtri(np.asarray(p, dtype=np.float64))


@dataclass(frozen=True, repr=False)
class PolarAngle(Density):
    """PolarQuant's angle density at recursion level ``level`` (:ref:`ref-polarquant`).

    Parameters
    ----------
    level : int
        1..16. Level 1 angles ``atan2(x_2j, x_2j-1)`` are uniform on [0, 2 pi); level l >= 2
        angles ``atan(|right half| / |left half|)`` over 2^(l-1) coordinates per half lie in
        [0, pi/2] with density proportional to ``sin^(2^(l-1) - 1)(2 psi)``.
    """

    level: int
    kind: ClassVar[str] = "polar"

    def __post_init__(self):
        object.__setattr__(self, "level", check_int("level", self.level, 1, MAX_POLAR_LEVEL))

    @property
    def _m(self) -> int:
        return 2 ** (self.level - 1)

    @property
    def _n(self) -> float:
        return float(self._m - 1)

    @property
    def support(self):
        return (0.0, 2 * math.pi) if self.level == 1 else (0.0, math.pi / 2)

    @property
    def center(self):
        return math.pi if self.level == 1 else math.pi / 4

    @property
    def mean(self):
        return self.center

    @property
    def var(self):
        if self.level == 1:
            return math.pi**2 / 3
        return float(special.polygamma(1, 1.0 + self._n / 2)) / 8.0

    def params(self):
        return {"level": self.level}

    @property
    def label(self):
        return f"polar_l{self.level}"

    @property
    def _logk(self) -> float:
        # K_m = Gamma(m) / (2^(m-2) Gamma(m/2)^2) = 2 Gamma((m+1)/2) / (sqrt(pi) Gamma(m/2))
        # (Legendre duplication), evaluated without the cancellation of large lgamma values
        return math.log(2.0) - 0.5 * math.log(math.pi) + _log_gamma_half_ratio(self._m / 2)

    def pdf(self, x):
        x = np.asarray(x, dtype=np.float64)
        lo, hi = self.support
        inside = (x >= lo) & (x <= hi)
        if self.level == 1:
            return np.where(inside, 1.0 / (2 * math.pi), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.sin(2 * np.clip(x, lo, hi))
            val = np.exp(self._logk + self._n * np.log(s))
        return np.where(inside, np.nan_to_num(val, nan=0.0, posinf=0.0), 0.0)

    def cdf(self, x):
        lo, hi = self.support
        x = np.clip(np.asarray(x, dtype=np.float64), lo, hi)
        if self.level == 1:
            return x / (2 * math.pi)
        a = self._m / 2
        lower = special.betainc(a, a, np.sin(x) ** 2)
        upper = special.betainc(a, a, np.cos(x) ** 2)
        return np.where(x <= math.pi / 4, lower, 1.0 - upper)

    def sf(self, x):
        lo, hi = self.support
        x = np.clip(np.asarray(x, dtype=np.float64), lo, hi)
        if self.level == 1:
            return (2 * math.pi - x) / (2 * math.pi)
        a = self._m / 2
        lower = special.betainc(a, a, np.sin(x) ** 2)
        upper = special.betainc(a, a, np.cos(x) ** 2)
        return np.where(x >= math.pi / 4, upper, 1.0 - lower)

    def cell_moments(self, a, b):
        lo, hi = self.support
        a = np.clip(np.asarray(a, dtype=np.float64), lo, hi)
        b = np.clip(np.asarray(b, dtype=np.float64), lo, hi)
        a, b = np.broadcast_arrays(a, b)
        if self.level == 1:
            w = np.where(b > a, 1.0 / (2 * math.pi), 0.0)
            return w * (b - a), w * (b * b - a * a) / 2, w * (b**3 - a**3) / 3
        m0 = self._mass(a, b)
        q = self._quad()
        shape = a.shape
        _, m1, m2 = q.integrals(q.t_of_x(a.ravel()), q.t_of_x(b.ravel()), np.zeros(a.size))
        return m0, m1.reshape(shape), m2.reshape(shape)

    def _quad(self):
        if self.level == 1:
            return QuadSpec(_quad.UNIFORM, 0.0, -math.log(2 * math.pi), 0.0, 1.0,
                            0.0, 2 * math.pi, math.inf)
        # theta = 2 psi - pi/2: f_theta = (K_m / 2) cos^(m-1) theta, psi = pi/4 + theta/2
        return QuadSpec(_quad.COS_LIN, self._n, self._logk - math.log(2.0), math.pi / 4, 0.5,
                        -math.pi / 2, math.pi / 2, 0.5)

    def _compander(self, p):
        p = np.asarray(p, dtype=np.float64)
        if self.level == 1:
            return 2 * math.pi * p
        # f^(1/3) ~ sin^(n/3)(2 psi): sin^2 psi ~ Beta(a', a') with a' = (n/3 + 1)/2
        a = (self._n / 3 + 1) / 2
        lo = np.arcsin(np.sqrt(special.betaincinv(a, a, p)))
        hi = math.pi / 2 - np.arcsin(np.sqrt(special.betaincinv(a, a, 1.0 - p)))
        return np.where(p <= 0.5, lo, hi)


_KINDS = {cls.kind: cls for cls in (SphereMarginal, Gaussian, PolarAngle)}


def density_from_params(kind: str, params: dict) -> Density:
    """Rebuild a continuous density from the ``(kind, params)`` a manifest records."""
    if kind not in _KINDS:
        raise ValueError(f"unknown density kind {kind!r}; expected one of {sorted(_KINDS)}")
    cls = _KINDS[kind]
    want = {f.name for f in fields(cls) if f.init}
    if not isinstance(params, dict) or set(params) != want:
        raise ValueError(f"{kind} params must be exactly {sorted(want)}, got {params!r:.100}")
    density = cls(**params)
    if density.params() != params:
        raise ValueError(f"{kind} params {params!r:.100} do not round-trip ({density.params()!r:.100})")
    return density
