"""Exact distortion-rate curves from the codebook engine, and the effect of norm correction.

Normalized MSE throughout (distortion / E[X^2]; ``d * mse`` for SphereMarginal(d)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from codebooks import Density, Empirical, SphereMarginal, cell_integrals, lloyd_max
from codebooks._validate import check_int

from .bounds import shannon_lower_bound

__all__ = ["lloyd_max_curve", "gap_curve", "entropy_coded_point", "entropy_coded_curve",
           "NormCorrection", "norm_correction_effect", "norm_correction_one_bit"]


def _int_bits(bits, lo=1, hi=12) -> np.ndarray:
    b = np.atleast_1d(np.asarray(bits))
    if not np.issubdtype(b.dtype, np.integer) or np.any(b < lo) or np.any(b > hi):
        raise ValueError(f"bits must be integers in {lo}..{hi}, got {bits!r}")
    return b


def lloyd_max_curve(density: Density, bits) -> np.ndarray:
    """Normalized Lloyd-Max distortion ``mse(b) / E[X^2]`` for each b in ``bits``.

    Returns
    -------
    ndarray, shape (len(bits),), float64
    """
    b = _int_bits(bits)
    return np.array([lloyd_max(density, int(v)).mse for v in b]) / density.second_moment


def gap_curve(density: Density, bits) -> np.ndarray:
    """Lloyd-Max distortion over the Shannon lower bound ``4^-b`` (the "gap")."""
    b = _int_bits(bits)
    return lloyd_max_curve(density, b) / shannon_lower_bound(b.astype(float))


def _uniform_cells(density: Density, step: float, offset: float):
    """Uniform cells of width ``step`` with edges at ``centre + (j + offset) step``.

    ``offset = 0.5`` is midtread (a cell centred on the centre), ``0`` midrise. Cells reach 12 std
    (Gaussian tail mass beyond: < 1e-32); the outer cells run to the support ends.
    Returns (edges, P, centroids, within-cell distortions) of the cells with positive mass.
    """
    lo, hi = density.support
    c = density.center if density.center is not None else density.mean
    reach = min(max(c - lo, hi - c), 12.0 * density.scale)
    n = int(math.ceil(reach / step)) + 1
    t = c + (np.arange(-n, n + 1) + offset) * step
    edges = np.concatenate([[lo], t[(t > lo) & (t < hi)], [hi]])
    a, b = edges[:-1], edges[1:]
    with np.errstate(invalid="ignore"):
        mid = np.where(np.isfinite(a) & np.isfinite(b), 0.5 * (a + b), np.where(np.isfinite(a), a, b))
    P, R, D = cell_integrals(density, edges, mid)
    keep = P > 0.0
    P, R, D = P[keep], R[keep], D[keep]
    return edges, keep, P, mid[keep] + R / P, np.maximum(D - R * R / P, 0.0)


def _rate(P: np.ndarray) -> float:
    p = P / P.sum()
    return float(-np.sum(p * np.log2(p)))


def entropy_coded_point(density: Density, step: float, offset: float = 0.5) -> tuple[float, float]:
    """(rate, normalized distortion) of uniform thresholds with ideal entropy coding.

    Parameters
    ----------
    density : Density
        Continuous.
    step : float
        Cell width.
    offset : float
        Edges at ``centre + (j + offset) step``: 0.5 midtread, 0 midrise.

    Notes
    -----
    Rate is the entropy of the cell index (ideal entropy coding); each cell is reconstructed at its
    centroid. Cells are integrated relative to their midpoints (``codebooks.cell_integrals``), so
    the within-cell distortion ``D - R^2/P`` has no cancellation.
    """
    if not (isinstance(step, float | int) and step > 0 and math.isfinite(step)):
        raise ValueError(f"step must be finite and > 0, got {step!r}")
    if isinstance(density, Empirical):
        raise TypeError("the entropy-coded curve needs a continuous density")
    _, _, P, _, D = _uniform_cells(density, float(step), offset)
    return _rate(P), float(np.sum(D)) / density.second_moment


def entropy_coded_curve(density: Density, rates) -> np.ndarray:
    """Normalized distortion of entropy-coded uniform scalar quantization at each rate (bits).

    For each rate the step is found by root-finding on the (continuous, decreasing) entropy of the
    cell index, for midtread and midrise cells; the lower distortion of the two is reported.

    Returns
    -------
    ndarray, shape (len(rates),)
    """
    r = np.atleast_1d(np.asarray(rates, dtype=np.float64))
    if not np.all(np.isfinite(r)) or np.any(r <= 0) or np.any(r > 14):
        raise ValueError(f"rates must be in (0, 14], got {rates!r}")
    if isinstance(density, Empirical):
        raise TypeError("the entropy-coded curve needs a continuous density")
    out = []
    for rate in r:
        best = math.inf
        for offset in (0.5, 0.0):  # midtread and midrise; the better one at this rate
            log_step = _step_for_rate(density, float(rate), offset)
            if log_step is not None:
                best = min(best, entropy_coded_point(density, math.exp(log_step), offset)[1])
        out.append(best)
    return np.array(out)


def _step_for_rate(density: Density, rate: float, offset: float) -> float | None:
    """log(step) at which the cell-index entropy equals ``rate`` (None if unreachable).

    The entropy falls by about one bit per doubling of the step (exactly so at high rate), so the
    search starts from ``4 std 2^-rate`` in a one-octave bracket and widens it as needed.
    """
    def excess(log_step):
        return _rate(_uniform_cells(density, math.exp(log_step), offset)[2]) - rate

    guess = math.log(4.0 * density.scale) - rate * math.log(2.0)
    lo, hi = guess - 0.7, guess + 0.7
    f_lo, f_hi = excess(lo), excess(hi)
    for _ in range(40):
        if f_lo >= 0 >= f_hi:
            return optimize.brentq(excess, lo, hi, xtol=1e-11)
        if f_lo < 0:
            lo, f_lo = lo - 1.4, excess(lo - 1.4)
        if f_hi > 0:
            if hi > math.log(density.scale) + 8:  # larger steps no longer lower the rate
                return None
            hi, f_hi = hi + 1.4, excess(hi + 1.4)
    return None


@dataclass(frozen=True)
class NormCorrection:
    """Monte Carlo comparison of storing ``||x||`` vs ``||x|| / ||x_hat||`` (paired samples).

    Attributes
    ----------
    d, bits, n : int
    plain, corrected : float
        Mean ``||x - x_hat||^2`` for unit x without / with norm correction.
    plain_se, corrected_se : float
        Standard errors of the two means.
    change : float
        ``corrected / plain - 1`` (negative: norm correction helps).
    change_se : float
        Standard error of ``change`` from the paired differences (delta method).
    """

    d: int
    bits: int
    n: int
    plain: float
    corrected: float
    plain_se: float
    corrected_se: float
    change: float
    change_se: float


def norm_correction_effect(d: int, bits: int, n: int = 20000, seed: int = 0,
                           chunk: int = 4096) -> NormCorrection:
    """Distortion of a rotated unit vector with and without norm correction (Monte Carlo).

    Notes
    -----
    After a Haar rotation the rotated unit vector ``y`` is uniform on the sphere, so it is sampled
    directly (normalised Gaussian). Plain: ``x_hat = Q(y)``; corrected: ``x_hat = Q(y) / ||Q(y)||``
    (the stored scale ``||x|| / ||Q(y)||``; :ref:`ref-turboquant`). Both use the same samples.
    """
    d = check_int("d", d, lo=2)
    bits = check_int("bits", bits, 1, 12)
    n = check_int("n", n, lo=100)
    cb = lloyd_max(SphereMarginal(d), bits)
    rng = np.random.default_rng(seed)
    plain = np.empty(n)
    corr = np.empty(n)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        g = rng.standard_normal((m, d))
        y = g / np.linalg.norm(g, axis=1, keepdims=True)
        q = cb.levels[cb.quantize(y)]
        plain[start:start + m] = np.sum((y - q) ** 2, axis=1)
        qn = q / np.linalg.norm(q, axis=1, keepdims=True)
        corr[start:start + m] = np.sum((y - qn) ** 2, axis=1)
    mp, mc = plain.mean(), corr.mean()
    sp, sc = plain.std(ddof=1) / math.sqrt(n), corr.std(ddof=1) / math.sqrt(n)
    # change = mc/mp - 1; delta method on the paired samples
    infl = corr / mp - mc * plain / mp**2
    return NormCorrection(d=d, bits=bits, n=n, plain=float(mp), corrected=float(mc), plain_se=float(sp),
                          corrected_se=float(sc), change=float(mc / mp - 1),
                          change_se=float(infl.std(ddof=1) / math.sqrt(n)))


def norm_correction_one_bit(d: int) -> float:
    """Exact norm-corrected distortion at 1 bit: ``2 - 2 sqrt(d) E|X|``.

    At 1 bit ``Q(y) = c sign(y)``, so ``Q(y) / ||Q(y)|| = sign(y) / sqrt(d)`` and
    ``<y, sign(y)> = sum |y_i|``; ``E|X| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))``.
    """
    d = check_int("d", d, lo=2)
    e_abs = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    return 2.0 - 2.0 * math.sqrt(d) * e_abs
