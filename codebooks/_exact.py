"""Correctly rounded Lloyd-Max levels: the float64 solution refined by Newton in 50-digit arithmetic.

Notes
-----
The float64 solver (``codebooks.solver``) drives the centroid residual down to the rounding floor
of its own cell integrals. At 7-8 bits the centroid system is ill-conditioned (the smallest
eigenvalue of its Jacobian shrinks like 1/K^2 relative to the cell masses), so that floor leaves
the last bits of the levels to the platform: numpy's SIMD kernels and scipy's special functions
differ by an ulp between CPUs and versions, and the solve amplifies it to up to ~3e3 ulps. Table
files built on two machines then differ although both are "exact".

Here the float64 levels only start Newton's method on the same conditions
``R_i = M_i - c_i P_i = 0`` (``P_i``, ``M_i``: mass and first moment of cell i), with every cell
integral in ``DPS``-digit arithmetic (mpmath). The iteration stops once a step is below
``10^-(DPS - 10)`` of the density's scale, and the levels are rounded to the nearest float64. The
result is the optimum itself, correctly rounded, whatever the start: the same bytes on every
platform (a true optimum within ``10^-40`` of a rounding midpoint would be needed to break that).

Symmetric densities are solved on their upper half in the centred variable ``u = x - centre``
(the first cell starts at the exact centre), as in the float64 solver; the lower half is the
mirror image about the exact centre, rounded on its own (for ``PolarAngle`` the float64 solver's
``2 * float64(centre) - c`` would be a few ulps off; for centre 0 both are ``-c``). Cell integrals over
``[a, b]`` of the upper half:

* ``SphereMarginal(d)``: ``f = C (1 - u^2)^k``, ``k = (d-3)/2``, ``al = (d-1)/2``. The tail mass
  ``S(u) = I_y(al, al)`` with ``y = (1-u)/2 <= 1/2`` is evaluated as
  ``y^al (1-y)^al / (al B(al, al)) 2F1(2 al, 1; al + 1; y)`` (DLMF 8.17.8, a series of positive
  terms: ``mpmath.betainc``'s own form cancels for d >= 65536); ``M = C [(1-a^2)^al - (1-b^2)^al] / (2 al)``.
* ``Gaussian(sigma)``: ``S(u) = erfc(u / (sigma sqrt 2)) / 2``, ``M = sigma^2 (f(a) - f(b))``.
* ``PolarAngle(1)``: uniform on ``[-pi, pi)`` about the centre: ``P = (b - a) / 2 pi``,
  ``M = (b^2 - a^2) / 4 pi``.
* ``PolarAngle(l >= 2)``: ``f = K cos^n(2u)`` on ``[0, pi/4]``, ``n = 2^(l-1) - 1``; ``P`` and ``M``
  by ``mpmath.quad`` (the integrand is entire; cells are short).

The distortion of the stored table is ``2 [var / 2 - sum_i (2 u_i M_i - u_i^2 P_i)]`` over the
upper half (cells between the stored float64 thresholds), and the residual is
``max_i |M_i / P_i - u_i| / std``, both evaluated at the rounded levels in the same arithmetic.
"""

from __future__ import annotations

from mpmath import mp, mpf

from .codebook import ConvergenceError
from .densities import Density, Gaussian, PolarAngle, SphereMarginal

__all__ = ["DPS", "refine_half"]

#: Working precision (decimal digits) of the refinement.
DPS = 50
_MAX_STEPS = 12


class _Half:
    """Cell integrals of the upper half of a symmetric density, in the centred variable."""

    def __init__(self, density: Density):
        self.density = density
        if isinstance(density, SphereMarginal):
            d = density.d
            self.al = mpf(d - 1) / 2
            self.k = mpf(d - 3) / 2
            self.norm = 1 / (self.al * mp.beta(self.al, self.al))  # tail prefactor
            self.c = mp.gamma(mpf(d) / 2) / (mp.sqrt(mp.pi) * mp.gamma(self.al))
            self.hi, self.var = mpf(1), mpf(1) / d
        elif isinstance(density, Gaussian):
            s = mpf(density.sigma)
            self.sigma = s
            self.hi, self.var = mp.inf, s * s
        elif isinstance(density, PolarAngle):
            if density.level == 1:
                self.hi, self.var = mp.pi, mp.pi**2 / 3
            else:
                m = 2 ** (density.level - 1)
                self.n = m - 1
                self.c = 2 * mp.gamma(mpf(m + 1) / 2) / (mp.sqrt(mp.pi) * mp.gamma(mpf(m) / 2))
                self.hi = mp.pi / 4
                self.var = mp.psi(1, 1 + mpf(self.n) / 2) / 8
        else:  # pragma: no cover - lloyd_max only calls this for the densities above
            raise TypeError(f"no exact refinement for {type(density).__name__}")
        self.std = mp.sqrt(self.var)

    @property
    def centre(self):
        dn = self.density
        if isinstance(dn, PolarAngle):
            return mp.pi if dn.level == 1 else mp.pi / 4
        return mpf(0)

    def pdf(self, u):
        dn = self.density
        if isinstance(dn, SphereMarginal):
            return self.c * (1 - u * u) ** self.k
        if isinstance(dn, Gaussian):
            return mp.exp(-u * u / (2 * self.sigma**2)) / (self.sigma * mp.sqrt(2 * mp.pi))
        if dn.level == 1:
            return 1 / (2 * mp.pi)
        return self.c * mp.cos(2 * u) ** self.n

    def _tail(self, u):
        """(mass, first moment) of [u, hi]."""
        dn = self.density
        if isinstance(dn, SphereMarginal):
            if u >= 1:
                return mpf(0), mpf(0)
            y = (1 - u) / 2
            mass = self.norm * (y * (1 - y)) ** self.al * mp.hyp2f1(2 * self.al, 1, self.al + 1, y)
            return mass, self.c * (1 - u * u) ** self.al / (2 * self.al)
        if u == mp.inf:
            return mpf(0), mpf(0)
        return mp.erfc(u / (self.sigma * mp.sqrt(2))) / 2, self.sigma**2 * self.pdf(u)

    def cells(self, edges):
        """Mass and first moment of each cell ``[edges[i], edges[i+1]]`` (lists of mpf)."""
        dn = self.density
        if isinstance(dn, PolarAngle):
            if dn.level == 1:
                w = 1 / (2 * mp.pi)
                return ([w * (b - a) for a, b in zip(edges, edges[1:])],
                        [w * (b * b - a * a) / 2 for a, b in zip(edges, edges[1:])])
            P = [mp.quad(self.pdf, [a, b]) for a, b in zip(edges, edges[1:])]
            M = [mp.quad(lambda u: u * self.pdf(u), [a, b]) for a, b in zip(edges, edges[1:])]
            return P, M
        tails = [self._tail(e) for e in edges]
        return ([s0 - s1 for (s0, _), (s1, _) in zip(tails, tails[1:])],
                [m0 - m1 for (_, m0), (_, m1) in zip(tails, tails[1:])])


def _newton_step(half: _Half, u, P, M, edges):
    """Solve J delta = R (J the symmetric tridiagonal Jacobian of the centroid conditions)."""
    n = len(u)
    R = [M[i] - u[i] * P[i] for i in range(n)]
    off = [-half.pdf(edges[i + 1]) * (u[i + 1] - u[i]) / 4 for i in range(n - 1)]
    diag = list(P)
    for i in range(n - 1):
        diag[i] += off[i]
        diag[i + 1] += off[i]
    # Thomas algorithm (J is positive definite at a log-concave optimum)
    cp, dp = [mpf(0)] * n, [mpf(0)] * n
    for i in range(n):
        den = diag[i] - (off[i - 1] * cp[i - 1] if i else 0)
        if den <= 0:
            raise ConvergenceError("the 50-digit refinement met a Jacobian that is not positive definite")
        cp[i] = off[i] / den if i < n - 1 else mpf(0)
        dp[i] = (R[i] - (off[i - 1] * dp[i - 1] if i else 0)) / den
    delta = [mpf(0)] * n
    for i in reversed(range(n)):
        delta[i] = dp[i] - (cp[i] * delta[i + 1] if i < n - 1 else 0)
    return delta


def refine_half(density: Density, upper) -> tuple[list[float], float, float, int]:
    """Refine the upper-half levels of a symmetric density to its exact optimum; all K levels, rounded.

    Parameters
    ----------
    density : SphereMarginal, Gaussian or PolarAngle
    upper : (K/2,) float64 array
        The float64 solver's upper-half levels (in x, increasing, above the centre).

    Returns
    -------
    levels : list of float
        All K optimal levels (the lower half mirrored about the exact centre), each the nearest
        float64 to the exact optimum.
    residual : float
        ``max_i |M_i / P_i - c_i| / std`` of the rounded levels (cells between float64 midpoints).
    mse : float
        Distortion of the whole mirrored table (rounded levels, float64 midpoints as thresholds).
    steps : int
        Newton steps taken.

    Raises
    ------
    ConvergenceError
        If Newton does not settle within its step budget.
    """
    with mp.workdps(DPS):
        half = _Half(density)
        centre = half.centre
        u = [mpf(float(v)) - centre for v in upper]
        tol = half.std * mpf(10) ** (10 - DPS)
        for step in range(1, _MAX_STEPS + 1):
            edges = [mpf(0)] + [(a + b) / 2 for a, b in zip(u, u[1:])] + [half.hi]
            P, M = half.cells(edges)
            delta = _newton_step(half, u, P, M, edges)
            u = [a + b for a, b in zip(u, delta)]
            if max(abs(v) for v in delta) <= tol:
                break
        else:
            raise ConvergenceError(f"the {DPS}-digit refinement did not settle in {_MAX_STEPS} Newton steps")
        if not all(0 < a < b for a, b in zip(u, u[1:])) or not 0 < u[0] or not u[-1] < half.hi:
            raise ConvergenceError(f"the {DPS}-digit refinement left the support or unordered levels")
        levels = [float(centre + v) for v in u]
        # the stored table: rounded levels, float64 midpoints as thresholds (as Codebook stores them)
        x = [mpf(v) for v in levels]
        edges = [centre] + [mpf(0.5 * (a + b)) for a, b in zip(levels, levels[1:])]
        lower = [float(centre - v) for v in reversed(u)]
        uc = [v - centre for v in x]
        P, M = half.cells([e - centre for e in edges] + [half.hi])
        residual = max(abs(m / p - c) for p, m, c in zip(P, M, uc)) / half.std
        mse = 2 * (half.var / 2 - sum(2 * c * m - c * c * p for p, m, c in zip(P, M, uc)))
        return lower + levels, float(residual), float(mse), step

