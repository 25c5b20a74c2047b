"""Reverse water-filling for Gaussian vector sources and the equal-volume grouping loss.

Notes
-----
Reverse water-filling (Cover and Thomas, Theorem 10.3.3): independent Gaussian coefficients with
variances ``lambda_i`` coded at a total of B bits reach the minimum total distortion with
``D_i = min(theta, lambda_i)`` and ``b_i = max(0, log2(lambda_i / theta) / 2)``, where ``theta``
makes ``sum_i b_i = B``.

Equal-volume grouping (:ref:`ref-nova-kv`, derived): a fixed-rate g-dimensional quantizer per
group ``G_j`` at b bits per coefficient gives, at high rate, ``D_j = c g (prod_{i in G_j}
lambda_i)^(1/g) 4^-b``; the variable-rate optimum (every coefficient above the water level) is
``c n (prod_i lambda_i)^(1/n) 4^-b``. Their ratio is the arithmetic over the geometric mean of the
groups' geometric means, so the excess ``AM / GM - 1`` is >= 0 and zero iff every group has the
same product of variances (AM-GM). NOVA-KV's grouping heuristics are scored by this number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from codebooks._validate import finite_array

__all__ = ["WaterFilling", "reverse_water_filling", "grouping_gap", "group_log_volumes"]


@dataclass(frozen=True)
class WaterFilling:
    """Optimal bit allocation for independent Gaussian coefficients.

    Attributes
    ----------
    theta : float
        Water level.
    bits : ndarray, shape (n,)
        Real-valued bits per coefficient (sum = the budget).
    distortion : ndarray, shape (n,)
        ``min(theta, lambda_i)``.
    total_distortion : float
    total_bits : float
    """

    theta: float
    bits: np.ndarray
    distortion: np.ndarray
    total_distortion: float
    total_bits: float


def _variances(variances) -> np.ndarray:
    lam = finite_array("variances", variances, min_size=1)
    if np.any(lam <= 0):
        raise ValueError("variances must be > 0")
    return lam


def reverse_water_filling(variances, total_bits: float) -> WaterFilling:
    """Minimum-distortion allocation of ``total_bits`` over coefficients with ``variances``.

    Parameters
    ----------
    variances : array_like, shape (n,)
        Positive finite variances ``lambda_i``.
    total_bits : float
        Budget B >= 0 (bits for the whole vector).

    Returns
    -------
    WaterFilling
    """
    lam = _variances(variances)
    if isinstance(total_bits, bool) or not isinstance(total_bits, int | float) or not math.isfinite(total_bits) \
            or total_bits < 0:
        raise ValueError(f"total_bits must be finite and >= 0, got {total_bits!r}")
    B = float(total_bits)
    if B == 0.0:
        return WaterFilling(float(lam.max()), np.zeros_like(lam), lam.copy(), float(lam.sum()), 0.0)
    # sum_i max(0, log2(lam_i / theta)) / 2 = B is piecewise linear in log2(theta): solve exactly.
    # With the k largest variances active: log2(theta) = (sum_{top k} log2 lam - 2B) / k.
    loglam = np.sort(np.log2(lam))[::-1]
    csum = np.cumsum(loglam)
    for k in range(1, lam.size + 1):
        log_theta = (csum[k - 1] - 2 * B) / k
        nxt = loglam[k] if k < lam.size else -np.inf
        if log_theta >= nxt:  # the (k+1)-th variance lies below the water: k active coefficients
            break
    theta = 2.0**log_theta
    bits = np.maximum(0.0, 0.5 * (np.log2(lam) - log_theta))
    dist = np.minimum(theta, lam)
    return WaterFilling(float(theta), bits, dist, float(dist.sum()), float(bits.sum()))


def _groups(n: int, groups) -> list[np.ndarray]:
    if isinstance(groups, np.ndarray) and groups.ndim == 1 and groups.size == n and \
            np.issubdtype(groups.dtype, np.integer):
        labels = groups
        out = [np.flatnonzero(labels == g) for g in np.unique(labels)]
    else:
        out = [np.asarray(g) for g in groups]
    if not out:
        raise ValueError("groups must not be empty")
    for g in out:
        if g.ndim != 1 or not np.issubdtype(g.dtype, np.integer):
            raise TypeError("each group must be a 1-D integer index array")
    flat = np.concatenate(out)
    if flat.size != n or not np.array_equal(np.sort(flat), np.arange(n)):
        raise ValueError(f"groups must partition the coefficients 0..{n - 1} (each index exactly once)")
    sizes = {g.size for g in out}
    if len(sizes) != 1:
        raise ValueError(f"groups must all have the same size, got sizes {sorted(sizes)}")
    return out


def group_log_volumes(variances, groups) -> np.ndarray:
    """``(1/g) sum_{i in G_j} log lambda_i`` per group: the log of each group's geometric mean."""
    lam = _variances(variances)
    return np.array([np.mean(np.log(lam[g])) for g in _groups(lam.size, groups)])


def grouping_gap(variances, groups) -> float:
    """High-rate excess of equal-bits fixed-size groups over the variable-rate optimum.

    Parameters
    ----------
    variances : array_like, shape (n,)
        Coefficient variances (all assumed above the water level: the high-rate regime).
    groups : sequence of int arrays, or int label array of shape (n,)
        A partition of ``range(n)`` into groups of equal size.

    Returns
    -------
    float
        ``mean_j GM_j / exp(mean_j log GM_j) - 1`` (>= 0; 0 iff all group volumes are equal).
    """
    v = group_log_volumes(variances, groups)
    shift = v.max()  # AM/GM of exp(v), evaluated stably
    am = np.mean(np.exp(v - shift))
    gm = math.exp(np.mean(v) - shift)
    return float(max(am / gm - 1.0, 0.0))
