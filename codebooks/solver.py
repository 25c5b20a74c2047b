"""Exact Lloyd-Max solver: safeguarded Newton on the centroid conditions.

Notes
-----
For levels ``c_1 < ... < c_K`` with thresholds ``t_i = (c_i + c_{i+1}) / 2`` (``t_0``, ``t_K`` the
support ends) the stationarity conditions of ``D(c) = sum_i int_{t_{i-1}}^{t_i} (x - c_i)^2 f`` are

    F_i(c) = c_i P_i - M_i = 0,       P_i = int_cell f,  M_i = int_cell x f,

i.e. ``F = grad D / 2``. Its Jacobian (half the Hessian of D) is symmetric tridiagonal:

    J_ii     = P_i - f(t_i) (c_{i+1} - c_i) / 4 - f(t_{i-1}) (c_i - c_{i-1}) / 4,
    J_i,i+1  = -f(t_i) (c_{i+1} - c_i) / 4.

Newton's step solves ``J delta = -F`` in O(K). Plain Lloyd (``c <- M/P``) converges linearly with
a rate that tends to 1 as K grows (:ref:`ref-lloyd-max`: ~140k iterations at 8 bits); Newton
converges quadratically from the Panter-Dite compander start (levels at quantiles of f^(1/3)).
Safeguards: the step is halved until the levels stay ordered inside the support and either D does
not increase beyond rounding or the residual halves (near the optimum D changes by less than its
rounding noise); if J is not positive definite or no step is accepted, one Lloyd step is taken (it
never increases D). Symmetric densities are solved on their upper half (K/2 unknowns,
threshold fixed at the centre) and mirrored, which makes the tables exactly symmetric.

Cell integrals come from ``codebooks._quad`` relative to each level, so the residual
``max_i |R_i / P_i| / std`` (``R_i = M_i - c_i P_i``) is computed without cancellation and Newton
can drive it to ~1e-16. For log-concave densities (Gaussian, sphere d >= 3, polar angles) the
stationary point is the unique optimum (Fleischer 1964); d = 2 is solved the same way and the
tests check it against an independent high-precision solve.

Empirical densities are solved by Lloyd's algorithm on the sorted unique values until the
partition no longer changes (an exact fixed point: every level is the mean of its cell).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._quad import tridiagonal_solve
from ._validate import check_bits
from .codebook import Codebook, ConvergenceError
from .densities import Density, QuadSpec
from .empirical import Empirical

__all__ = ["lloyd_max", "DEFAULT_TOL"]

#: Converged means ``max_i |c_i - centroid_i| <= DEFAULT_TOL * std(X)``.
DEFAULT_TOL = 1e-13
_EPS = np.finfo(np.float64).eps
_POLISH_STEPS = 3


def lloyd_max(density: Density, bits: int, *, tol: float = DEFAULT_TOL, max_iter: int = 200,
              exact: bool = False) -> Codebook:
    """Solve the Lloyd-Max (minimum-MSE fixed-rate scalar) codebook of ``density``.

    Parameters
    ----------
    density : Density
        ``SphereMarginal``, ``Gaussian``, ``PolarAngle`` or ``Empirical``.
    bits : int
        1..12; the table has ``2**bits`` levels.
    tol : float
        Convergence tolerance on the centroid residual relative to ``density.scale``.
    max_iter : int
        Iteration cap (Newton steps; for ``Empirical``, Lloyd steps times 1000).
    exact : bool
        Continuous densities only: refine the float64 solution by Newton in 50-digit arithmetic
        and round (``codebooks._exact``), so the levels are the exact optimum correctly rounded to
        float64 and ``mse``/``residual`` are those of the stored table, the same bytes on every
        platform (solver ``"newton-tridiagonal+mp50"``; a fraction of a second per 8-bit
        table). Without it the last ~11 bits of 7-8-bit levels depend on the platform's floating
        point. No effect on ``Empirical`` (its discrete solve is exact already).

    Notes
    -----
    ``Empirical`` densities are solved exactly when ``2**bits (n + 1) <= DP_MAX_CELLS`` (n distinct
    samples): the globally optimal contiguous partition by dynamic programming (``_dp_partition``),
    then one Lloyd pass on the midpoint partition (solver ``"lloyd-discrete-dp"``). Larger problems
    take the lowest-distortion of three Lloyd runs (``"lloyd-discrete-multistart"``), a local
    optimum.

    Returns
    -------
    Codebook

    Raises
    ------
    ConvergenceError
        If the residual does not reach ``tol``; no table is returned.
    ValueError, TypeError
        On invalid arguments.
    """
    if not isinstance(density, Density):
        raise TypeError(f"density must be a Density, got {type(density).__name__}")
    bits = check_bits(bits)
    if not (isinstance(tol, float | int) and not isinstance(tol, bool) and 0 < tol < 1e-3):
        raise ValueError(f"tol must be a number in (0, 1e-3), got {tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    if isinstance(density, Empirical):
        return _solve_empirical(density, bits, float(tol), max_iter * 1000)
    return _solve_continuous(density, bits, float(tol), max_iter, exact)


# ---------------------------------------------------------------------------------------------
# continuous densities


def _evaluate(q: QuadSpec, lo: float, hi: float, c: np.ndarray):
    """Cell integrals about the levels and the density at the interior thresholds."""
    t_mid = 0.5 * (c[:-1] + c[1:])
    edges = q.t_of_x(np.concatenate([[lo], t_mid, [hi]]))
    P, R, D = q.integrals(edges[:-1], edges[1:], c)
    f = q.pdf_x(edges[1:-1])
    return P, R, D, f


def _newton_step(P, R, f, c):
    """Newton direction for F = -R; returns (delta, positive_definite)."""
    gap = np.diff(c)
    diag = P.copy()
    diag[:-1] -= 0.25 * f * gap
    diag[1:] -= 0.25 * f * gap
    off = -0.25 * f * gap
    delta, min_pivot = tridiagonal_solve(diag, off, R)
    return delta, bool(min_pivot > 0.0 and np.all(np.isfinite(delta)))


def _valid(c, lo, hi):
    return bool(np.all(np.isfinite(c)) and np.all(np.diff(c) > 0) and c[0] > lo and c[-1] < hi)


def _solve_half(q: QuadSpec, lo: float, hi: float, c: np.ndarray, scale: float, tol: float, max_iter: int,
                polish_steps: int = _POLISH_STEPS):
    """Safeguarded Newton for K levels on [lo, hi] with both ends fixed.

    ``polish_steps`` more steps are taken once the residual is below ``tol`` (fewer if it stops
    falling). Returns (levels, residual, distortion over [lo, hi], iterations).
    """
    P, R, D, f = _evaluate(q, lo, hi, c)
    best = None
    prev = math.inf
    polish = 0
    for it in range(max_iter + 1):
        if np.any(P <= 0.0):
            raise ConvergenceError("a cell lost all probability mass during the solve")
        res = float(np.max(np.abs(R / P))) / scale
        if best is None or res < best[0]:
            best = (res, c, float(np.sum(D)), it)
        if res <= tol:
            # a few more quadratic steps push the residual down to the rounding floor
            if polish >= polish_steps or res >= prev or res < 4 * _EPS:
                break
            polish += 1
        if it == max_iter:
            break
        prev = res
        dtot = float(np.sum(D))
        delta, pd = _newton_step(P, R, f, c)
        accepted = False
        alpha = 1.0
        while pd and alpha >= 2.0**-30:
            trial = c + alpha * delta
            if _valid(trial, lo, hi):
                tP, tR, tD, tf = _evaluate(q, lo, hi, trial)
                # accept a step that lowers D, or (near the optimum, where D's changes are below
                # its rounding noise) one that halves the residual: Newton's merit for F = 0
                if np.all(tP > 0.0) and (np.sum(tD) <= dtot * (1.0 + 64 * _EPS)
                                         or np.max(np.abs(tR / tP)) / scale < 0.5 * res):
                    c, P, R, D, f = trial, tP, tR, tD, tf
                    accepted = True
                    break
            alpha *= 0.5
        if not accepted:
            # Lloyd step: move every level to its centroid; never increases D
            c = c + R / P
            P, R, D, f = _evaluate(q, lo, hi, c)
    res, c, dist, iters = best
    if res > tol:
        raise ConvergenceError(
            f"Lloyd-Max did not converge: residual {res:.3e} > tol {tol:.1e} after {max_iter} iterations"
        )
    return c, res, dist, iters


def _solve_continuous(density: Density, bits: int, tol: float, max_iter: int, exact: bool) -> Codebook:
    q = density._quad()
    # the exact path stops at tol: the rounding-floor polish is where platforms differ, and the
    # 50-digit refinement replaces it (so the iteration count is platform-free too)
    polish = 0 if exact else _POLISH_STEPS
    lo, hi = density.support
    k = 2**bits
    center = density.center
    if center is None:  # asymmetric density: all K levels at once
        if exact:  # pragma: no cover - every continuous density of the package is symmetric
            raise ValueError(f"exact=True needs a symmetric density, {density!r} is not")
        c0 = density._compander((np.arange(k) + 0.5) / k)
        levels, res, mse, iters = _solve_half(q, lo, hi, c0, density.scale, tol, max_iter, polish)
        thresholds = 0.5 * (levels[:-1] + levels[1:])
    else:  # symmetric: solve the upper half with the centre threshold fixed, then mirror
        c0 = density._compander(0.5 + (np.arange(k // 2) + 0.5) / k)
        c, res, half_mse, iters = _solve_half(q, center, hi, c0, density.scale, tol, max_iter, polish)
        if exact:
            from ._exact import refine_half  # mpmath costs ~0.3 s to import: only on this path

            # iterations stays the float64 count: the refinement's step count depends on how
            # close the platform's float64 start was, and the table must not
            full, res, mse, _ = refine_half(density, c)
            levels = np.asarray(full, dtype=np.float64)
            thresholds = 0.5 * (levels[:-1] + levels[1:])
            thresholds[k // 2 - 1] = center
        else:
            half_t = 0.5 * (c[:-1] + c[1:])
            levels = np.concatenate([2 * center - c[::-1], c])
            thresholds = np.concatenate([2 * center - half_t[::-1], [center], half_t])
            mse = 2.0 * half_mse
    return Codebook(levels=levels, thresholds=thresholds, mse=mse, density=density, bits=bits,
                    solver="newton-tridiagonal+mp50" if exact else "newton-tridiagonal",
                    iterations=iters, residual=res)


# ---------------------------------------------------------------------------------------------
# empirical densities


@njit(cache=True)
def _lloyd_discrete(values, probs, c, max_iter):
    """Lloyd on sorted unique ``values`` until the partition is stable.

    Cells are (t_{i-1}, t_i] with t_i the midpoints of ``c``; each level becomes the weighted mean
    of its cell by direct summation plus one residual pass (prefix sums would lose eps * |mean| and
    can merge levels), clamped into the cell's value range so the levels stay strictly increasing. An empty cell's
    level moves to the value with the largest weighted error, which strictly lowers D, so the loop
    terminates. Returns (levels, iterations, converged).
    """
    n = values.shape[0]
    k = c.shape[0]
    bounds = np.zeros(k + 1, dtype=np.int64)
    prev = np.full(k + 1, -1, dtype=np.int64)
    bounds[k] = n
    for it in range(1, max_iter + 1):
        for i in range(k - 1):
            bounds[i + 1] = np.searchsorted(values, 0.5 * (c[i] + c[i + 1]), side="right")
        same = True
        for i in range(k + 1):
            if bounds[i] != prev[i]:
                same = False
        if same:
            return c, it - 1, True
        prev[:] = bounds
        empty = -1
        for i in range(k):
            lo = bounds[i]
            hi = bounds[i + 1]
            if hi > lo:
                sp = 0.0
                sm = 0.0
                for j in range(lo, hi):
                    sp += probs[j]
                    sm += probs[j] * values[j]
                m = sm / sp
                sr = 0.0  # one refinement pass: the mean of the residuals about m
                for j in range(lo, hi):
                    sr += probs[j] * (values[j] - m)
                c[i] = min(max(m + sr / sp, values[lo]), values[hi - 1])
            else:
                empty = i
        if empty >= 0:
            worst = 0
            worst_err = -1.0
            cell = 0
            for j in range(n):
                while cell < k - 1 and j >= bounds[cell + 1]:
                    cell += 1
                err = probs[j] * (values[j] - c[cell]) ** 2
                if err > worst_err:
                    worst_err = err
                    worst = j
            c[empty] = values[worst]
            c.sort()
            prev[:] = -1
    return c, max_iter, False


@njit(cache=True)
def _cell_sums(values, probs, c):
    """Per-cell P, R = sum p (v - c_i), D = sum p (v - c_i)^2 (cells as in ``_lloyd_discrete``)."""
    k = c.shape[0]
    P = np.zeros(k)
    R = np.zeros(k)
    D = np.zeros(k)
    cell = 0
    for j in range(values.shape[0]):
        while cell < k - 1 and values[j] > 0.5 * (c[cell] + c[cell + 1]):
            cell += 1
        dv = values[j] - c[cell]
        P[cell] += probs[j]
        R[cell] += probs[j] * dv
        D[cell] += probs[j] * dv * dv
    return P, R, D


# Work limit of the exact solver: K (n + 1) int32 split indices (at most 80 MB) and ~K n log2 n
# cell costs. Beyond it the solver falls back to the best of three Lloyd starts.
DP_MAX_CELLS = 20_000_000


@njit(cache=True)
def _sse(s0, s1, s2):
    """Squared error of a cell from its sums of p, p v, p v^2: ``s2 - s1^2 / s0``, clamped at 0. A
    cell whose mass vanished in the prefix sums (weights spanning more than 1e16) costs ``s2``."""
    if s0 > 0.0:
        return max(s2 - s1 * s1 / s0, 0.0)
    return max(s2, 0.0)


@njit(cache=True)
def _dp_partition(values, probs, k):
    """Globally optimal partition of sorted ``values`` (weights ``probs``) into ``k`` contiguous
    non-empty cells for the squared error: start index (k + 1,) int64 of each cell, ``n`` last.

    One dynamic-programming layer per cell count m: ``D_m[j] = min_i D_{m-1}[i] + SSE(i, j)`` over
    the first j values; the minimizing i is non-decreasing in j (SSE satisfies the quadrangle
    inequality), so each layer is solved by divide and conquer in O(n log n) cost evaluations.
    SSE(i, j) comes from prefix sums of p, p v, p v^2 of the values centred on their mean. Ties
    keep the smallest split index (deterministic).
    """
    n = values.shape[0]
    mu = 0.0
    for t in range(n):
        mu += probs[t] * values[t]
    S0 = np.zeros(n + 1)
    S1 = np.zeros(n + 1)
    S2 = np.zeros(n + 1)
    for t in range(n):
        v = values[t] - mu
        S0[t + 1] = S0[t] + probs[t]
        S1[t + 1] = S1[t] + probs[t] * v
        S2[t + 1] = S2[t] + probs[t] * v * v
    prev = np.empty(n + 1)
    cur = np.empty(n + 1)
    arg = np.zeros((k + 1, n + 1), dtype=np.int32)
    for j in range(1, n + 1):
        prev[j] = _sse(S0[j], S1[j], S2[j])
    stack = np.empty((64, 4), dtype=np.int64)
    for m in range(2, k + 1):
        jlo0 = m
        jhi0 = n - (k - m)
        stack[0, 0] = jlo0
        stack[0, 1] = jhi0
        stack[0, 2] = m - 1
        stack[0, 3] = jhi0 - 1
        top = 1
        while top > 0:
            top -= 1
            jlo = stack[top, 0]
            jhi = stack[top, 1]
            olo = stack[top, 2]
            ohi = stack[top, 3]
            mid = (jlo + jhi) // 2
            best = np.inf
            bi = olo
            for i in range(max(olo, m - 1), min(ohi, mid - 1) + 1):
                c = prev[i] + _sse(S0[mid] - S0[i], S1[mid] - S1[i], S2[mid] - S2[i])
                if c < best:
                    best = c
                    bi = i
            cur[mid] = best
            arg[m, mid] = bi
            if mid + 1 <= jhi:
                stack[top, 0] = mid + 1
                stack[top, 1] = jhi
                stack[top, 2] = bi
                stack[top, 3] = ohi
                top += 1
            if jlo <= mid - 1:
                stack[top, 0] = jlo
                stack[top, 1] = mid - 1
                stack[top, 2] = olo
                stack[top, 3] = bi
                top += 1
        for j in range(jlo0, jhi0 + 1):
            prev[j] = cur[j]
    starts = np.empty(k + 1, dtype=np.int64)
    starts[k] = n
    j = n
    for m in range(k, 1, -1):
        j = arg[m, j]
        starts[m - 1] = j
    starts[0] = 0
    return starts


def _snap(values: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """k strictly increasing sample values at (or just above) the sorted ``targets``."""
    idx = np.clip(np.searchsorted(values, targets), 0, values.size - 1)
    for i in range(1, k):
        idx[i] = max(idx[i], idx[i - 1] + 1)
    return values[np.minimum(idx, values.size - k + np.arange(k))].copy()


def _quantile_start(values: np.ndarray, probs: np.ndarray, k: int) -> np.ndarray:
    """Distinct sample values at the probability quantiles (j + 1/2)/K."""
    return _snap(values, np.interp((np.arange(k) + 0.5) / k, np.cumsum(probs), values), k)


def _lloyd_starts(values: np.ndarray, probs: np.ndarray, k: int) -> list:
    """Initial levels of the fallback: probability quantiles; the quantiles of the histogram density
    to the power 1/3 (the high-resolution optimum's level density, Panter-Dite); equal spacing over
    the sample span."""
    quant = _quantile_start(values, probs, k)
    nb = int(min(max(4 * k, 64), max(values.size // 4, 8)))
    edges = np.linspace(values[0], values[-1], nb + 1)
    w = np.cbrt(np.histogram(values, edges, weights=probs)[0])
    cw = np.concatenate([[0.0], np.cumsum(w)]) / w.sum()
    compand = _snap(values, np.interp((np.arange(k) + 0.5) / k, cw, edges), k)
    uniform = _snap(values, np.linspace(values[0], values[-1], k + 2)[1:-1], k)
    return [quant, compand, uniform]


def _solve_empirical(density: Empirical, bits: int, tol: float, max_iter: int) -> Codebook:
    """Exact (dynamic programming) when ``K (n + 1) <= DP_MAX_CELLS``, then one Lloyd pass to settle
    ties on the midpoint partition (and a Lloyd run from quantile starts as a guard: the lower
    distortion is kept); else the lowest-distortion of three Lloyd runs (_lloyd_starts)."""
    values, probs = density.values, density.probs
    k = 2**bits
    if k > values.size:
        raise ValueError(
            f"bits={bits} needs at least 2**bits={k} distinct sample values; "
            f"the Empirical density has {values.size}"
        )
    if k * (values.size + 1) <= DP_MAX_CELLS:
        cuts = _dp_partition(values, probs, k)
        sums0 = np.add.reduceat(probs, cuts[:-1])
        sums1 = np.add.reduceat(probs * values, cuts[:-1])
        dp = np.clip(sums1 / sums0, values[cuts[:-1]], values[cuts[1:] - 1])
        # the quantile start guards against DP costs rounded away (prefix sums over extreme spans):
        # it can only win where the DP was inexact, and then the table says which ran
        inits = [(dp, "lloyd-discrete-dp"), (_quantile_start(values, probs, k), "lloyd-discrete")]
    else:
        inits = [(c0, "lloyd-discrete-multistart") for c0 in _lloyd_starts(values, probs, k)]
    best = None
    for c0, solver in inits:
        c, iters, ok = _lloyd_discrete(values, probs, c0, max_iter)
        if not ok:
            raise ConvergenceError(f"discrete Lloyd did not reach a stable partition in {max_iter} iterations")
        P, R, D = _cell_sums(values, probs, c)
        if best is None or np.sum(D) < best[4]:
            best = (c, iters, (P, R, D), solver, float(np.sum(D)))
    c, iters, (P, R, D), solver, _ = best
    res = float(np.max(np.abs(R / P))) / density.scale
    if res > tol or not np.all(np.diff(c) > 0):
        raise ConvergenceError(f"discrete Lloyd residual {res:.3e} > tol {tol:.1e}")
    return Codebook(levels=c, thresholds=0.5 * (c[:-1] + c[1:]), mse=float(np.sum(D)), density=density,
                    bits=bits, solver=solver, iterations=int(iters), residual=res)
