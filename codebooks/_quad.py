"""Cell integrals at full relative precision: composite Gauss-Legendre in a natural variable.

Every continuous density of this package is written as ``x = a0 + a1 * g(t)`` with a weight
``w(t) = exp(logc + L(t))`` on an interval of ``t``:

=========  ===================  ================  ==========================
kind       L(t)                 g(t)              t range
=========  ===================  ================  ==========================
GAUSS      -t^2/2               t                 (-inf, inf)
COS_SIN    n log cos t          sin t             [-pi/2, pi/2]   (sphere)
COS_LIN    n log cos t          t                 [-pi/2, pi/2]   (polar angle)
UNIFORM    0                    t                 [lo, hi]
=========  ===================  ================  ==========================

In these variables every integrand is an entire function (the arcsine singularity of the
d=2 sphere marginal at x=+-1 disappears in t = arcsin x), so Gauss-Legendre converges
geometrically on panels that are small compared with the local scale of ``L``. For a cell
and a reference point ``c`` (the level), the kernels return

    P = int w,    R = int (x - c) w,    D = int (x - c)^2 w,

which is what the solver needs: the centroid residual is R/P and the cell distortion is D.
Working relative to ``c`` avoids the cancellation of closed-form CDF differences on narrow cells
(their error is ~eps * tail mass / P, 1e-13 relative at 12 bits); here the error is ~eps * P.

Panel rule (full panel width h at distance |t| from the mode t=0, 20 nodes):
h <= min(hmax, 1/sqrt(|L''|), 2/|L'|). The weight then changes by a factor <= e^3 across a panel
and the Gauss-Legendre error is below 1e-20 relative (verified against mpmath in the tests).
Pieces are marched outward from the mode and truncated once L has fallen 50 nats below its
value at the piece's inner end (contribution < 1e-21 relative).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

GAUSS, COS_SIN, COS_LIN, UNIFORM = 0, 1, 2, 3
N_NODES = 20
# 20-point Gauss-Legendre rule, correctly rounded from a 50-digit mpmath computation (the test
# suite recomputes it). numpy's leggauss weights are off by up to 7e-14 relative, which biased
# every integral by ~4e-15.
_POS_NODES = (
    0.07652652113349734, 0.22778585114164507, 0.37370608871541955, 0.5108670019508271,
    0.636053680726515, 0.7463319064601508, 0.8391169718222188, 0.912234428251326,
    0.9639719272779138, 0.9931285991850949,
)
_POS_WEIGHTS = (
    0.15275338713072584, 0.14917298647260374, 0.14209610931838204, 0.13168863844917664,
    0.11819453196151841, 0.10193011981724044, 0.08327674157670475, 0.06267204833410907,
    0.04060142980038694, 0.017614007139152118,
)
NODES = np.concatenate([-np.array(_POS_NODES[::-1]), np.array(_POS_NODES)])
WEIGHTS = np.concatenate([np.array(_POS_WEIGHTS[::-1]), np.array(_POS_WEIGHTS)])
TRUNCATE_NATS = 50.0


@njit(cache=True)
def _log_weight(kind, n, t):
    """L(t): the log of the un-normalized weight in the natural variable."""
    if kind == GAUSS:
        return -0.5 * t * t
    if kind == COS_SIN or kind == COS_LIN:
        if n == 0.0:
            return 0.0
        if abs(t) < 0.7853981633974483:
            # log cos t = log1p(-sin^2 t) / 2: cos t ~ 1 - t^2/2 would lose log10(2/t^2) digits,
            # and n log cos t multiplies that error by n (d up to 65536 and beyond)
            s = math.sin(t)
            return 0.5 * n * math.log1p(-s * s)
        c = math.cos(t)
        if c <= 0.0:
            return -np.inf
        return n * math.log(c)
    return 0.0


@njit(cache=True)
def _x_of_t(kind, a0, a1, t):
    if kind == COS_SIN:
        return a0 + a1 * math.sin(t)
    return a0 + a1 * t


@njit(cache=True)
def _panel_width(kind, n, t, hmax):
    """Largest safe panel width at |t| (see module docstring)."""
    at = abs(t)
    if kind == GAUSS:
        slope, curv = at, 1.0
    elif kind == COS_SIN or kind == COS_LIN:
        c = math.cos(at)
        if n == 0.0 or c <= 0.0:
            slope, curv = 0.0, 0.0
        else:
            slope = n * math.sin(at) / c
            curv = n / (c * c)
    else:
        slope, curv = 0.0, 0.0
    h = hmax
    if curv > 0.0:
        h = min(h, 1.0 / math.sqrt(curv))
    if slope > 0.0:
        h = min(h, 2.0 / slope)
    return h


#: log of the smallest positive float64 (subnormal): exp of anything below is exactly 0
UNDERFLOW_NATS = -745.2


@njit(cache=True)
def _piece(kind, n, logc, a0, a1, start, stop, ref, hmax, nodes, weights):
    """Integrate (1, x-ref, (x-ref)^2) * w over [start, stop] marching from ``start``.

    ``start`` is the end nearer the mode (t=0) for peaked kinds, so the weight is
    non-increasing along the march and the tail can be truncated.
    """
    p = 0.0
    r = 0.0
    d = 0.0
    direction = 1.0 if stop >= start else -1.0
    length = abs(stop - start)
    if length == 0.0:
        return p, r, d
    l0 = _log_weight(kind, n, start)
    pos = 0.0  # distance marched from start
    peaked = kind != UNIFORM
    if peaked and logc + l0 < UNDERFLOW_NATS:
        # every weight of the piece underflows to 0 (it only falls along the march): nothing to add.
        # Without this, a cell far in a Gaussian tail (levels scaled by 1e50) marched ~1e50 panels.
        return p, r, d
    while pos < length:
        here = start + direction * pos
        h = _panel_width(kind, n, here, hmax)
        end = pos + h
        if end >= length or length - end < 0.5 * h or not end > pos:
            # finish the piece; a remainder under h/2 joins this panel (width <= 1.5 h), which also
            # guarantees progress where h shrinks geometrically towards a zero of cos t
            end = length
        lo = start + direction * pos
        hi = start + direction * end
        half = 0.5 * (hi - lo)
        mid = 0.5 * (hi + lo)
        for j in range(nodes.shape[0]):
            t = mid + half * nodes[j]
            lw = _log_weight(kind, n, t)
            if lw == -np.inf:
                continue
            w = weights[j] * abs(half) * math.exp(logc + lw)
            dx = _x_of_t(kind, a0, a1, t) - ref
            p += w
            r += w * dx
            d += w * dx * dx
        pos = end
        if peaked and pos < length:
            if _log_weight(kind, n, start + direction * pos) < l0 - TRUNCATE_NATS:
                break
    return p, r, d


@njit(cache=True)
def cell_integrals(kind, n, logc, a0, a1, t_lo, t_hi, ref, hmax, nodes, weights):
    """P, R, D for cells [t_lo[i], t_hi[i]] about references ref[i] (x units).

    Parameters
    ----------
    kind : int
        One of GAUSS, COS_SIN, COS_LIN, UNIFORM.
    n, logc, a0, a1 : float
        Exponent of cos, log normalizer of w, and the affine map x = a0 + a1 g(t).
    t_lo, t_hi : ndarray, shape (K,), float64
        Cell ends in t (t_lo <= t_hi, may be +-inf for GAUSS).
    ref : ndarray, shape (K,), float64
        Reference point per cell, in x units.
    hmax : float
        Largest panel width.
    nodes, weights : ndarray, shape (N_NODES,)
        Gauss-Legendre rule on [-1, 1].

    Returns
    -------
    P, R, D : ndarray, shape (K,), float64
    """
    k = t_lo.shape[0]
    P = np.zeros(k)
    R = np.zeros(k)
    D = np.zeros(k)
    for i in range(k):
        lo = t_lo[i]
        hi = t_hi[i]
        if not hi > lo:
            continue
        c = ref[i]
        if kind == UNIFORM:
            p, r, d = _piece(kind, n, logc, a0, a1, lo, hi, c, hmax, nodes, weights)
            P[i] = p
            R[i] = r
            D[i] = d
            continue
        # split at the mode t=0 and march outward on each side
        if lo < 0.0 < hi:
            p1, r1, d1 = _piece(kind, n, logc, a0, a1, 0.0, lo, c, hmax, nodes, weights)
            p2, r2, d2 = _piece(kind, n, logc, a0, a1, 0.0, hi, c, hmax, nodes, weights)
            P[i] = p1 + p2
            R[i] = r1 + r2
            D[i] = d1 + d2
        elif lo >= 0.0:
            P[i], R[i], D[i] = _piece(kind, n, logc, a0, a1, lo, hi, c, hmax, nodes, weights)
        else:
            P[i], R[i], D[i] = _piece(kind, n, logc, a0, a1, hi, lo, c, hmax, nodes, weights)
    return P, R, D


@njit(cache=True)
def tridiagonal_solve(diag, off, rhs):
    """Solve a symmetric tridiagonal system by LDL^T (Thomas).

    Parameters
    ----------
    diag : ndarray, shape (K,)
    off : ndarray, shape (K-1,)
        Sub/super-diagonal.
    rhs : ndarray, shape (K,)

    Returns
    -------
    x : ndarray, shape (K,)
    min_pivot : float
        Smallest pivot of the factorization, relative to its diagonal entry; > 0 means the
        matrix is positive definite (Newton's step is then a descent direction).
    """
    k = diag.shape[0]
    dd = np.empty(k)
    y = np.empty(k)
    min_pivot = np.inf
    dd[0] = diag[0]
    y[0] = rhs[0]
    min_pivot = min(min_pivot, dd[0] / abs(diag[0]) if diag[0] != 0.0 else -np.inf)
    for i in range(1, k):
        if dd[i - 1] == 0.0:
            return np.full(k, np.nan), -np.inf
        m = off[i - 1] / dd[i - 1]
        dd[i] = diag[i] - m * off[i - 1]
        y[i] = rhs[i] - m * y[i - 1]
        piv = dd[i] / abs(diag[i]) if diag[i] != 0.0 else -np.inf
        min_pivot = min(min_pivot, piv)
    x = np.empty(k)
    if dd[k - 1] == 0.0:
        return np.full(k, np.nan), -np.inf
    x[k - 1] = y[k - 1] / dd[k - 1]
    for i in range(k - 2, -1, -1):
        x[i] = (y[i] - off[i] * x[i + 1]) / dd[i]
    return x, min_pivot
