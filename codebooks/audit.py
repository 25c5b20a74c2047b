"""Exact distortion of any table and audits of tables copied from elsewhere."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from ._validate import MAX_BITS, finite_array, strictly_increasing
from .codebook import Codebook
from .densities import Density, SphereMarginal
from .solver import lloyd_max

__all__ = ["distortion", "cell_integrals", "audit", "AuditReport"]


def _check_table(levels, thresholds):
    levels = finite_array("levels", levels)
    strictly_increasing("levels", levels)
    if thresholds is None:
        thresholds = 0.5 * (levels[:-1] + levels[1:])
    else:
        thresholds = finite_array("thresholds", thresholds, min_size=0)
        if thresholds.size != levels.size - 1:
            raise ValueError(f"thresholds must have len(levels) - 1 = {levels.size - 1} entries, "
                             f"got {thresholds.size}")
        strictly_increasing("thresholds", thresholds)
    return levels, thresholds


def cell_integrals(density: Density, edges, refs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-cell ``P = int f``, ``R = int (x - ref) f``, ``D = int (x - ref)^2 f`` of a continuous density.

    Parameters
    ----------
    density : Density
        A continuous density (not ``Empirical``).
    edges : array_like, shape (K+1,)
        Non-decreasing cell edges; values beyond the support are clipped to it (+-inf allowed).
    refs : array_like, shape (K,)
        Reference point of each cell (e.g. its level).

    Returns
    -------
    P, R, D : ndarray, shape (K,), float64

    Notes
    -----
    Integrated relative to each reference by Gauss-Legendre in the density's natural variable
    (``codebooks._quad``), so each value has a relative error of a few eps even for cells far
    narrower than the density's scale, where closed-form CDF differences cancel. The centroid of
    a cell is ``ref + R/P`` and its distortion about the centroid is ``D - R^2/P``.
    """
    if not isinstance(density, Density) or density.is_discrete:
        raise TypeError(f"density must be a continuous Density, got {type(density).__name__}")
    e = np.asarray(edges, dtype=np.float64)
    r = finite_array("refs", refs, min_size=1)
    if e.ndim != 1 or e.size != r.size + 1:
        raise ValueError(f"edges must be 1-D with len(refs) + 1 = {r.size + 1} entries, got shape {e.shape}")
    if np.any(np.isnan(e)) or np.any(np.diff(e) < 0):
        raise ValueError("edges must be non-decreasing and not NaN")
    q = density._quad()
    lo, hi = density.support
    t = q.t_of_x(np.clip(e, lo, hi))
    return q.integrals(t[:-1], t[1:], r)


def distortion(density: Density, levels, thresholds=None) -> float:
    """Exact per-coordinate distortion ``E[(X - Q(X))^2]`` of a table under ``density``.

    Parameters
    ----------
    density : Density
    levels : array_like, shape (K,)
        Reconstruction levels, strictly increasing (any K >= 1, any scale).
    thresholds : array_like, shape (K-1,), optional
        Decision thresholds, strictly increasing; default: midpoints (nearest-level cells).
        Cell i is ``(thresholds[i-1], thresholds[i]]``; X in cell i is reconstructed as levels[i].

    Returns
    -------
    float

    Notes
    -----
    No sampling: continuous densities are integrated cell by cell relative to each level
    (``codebooks._quad``, exact to rounding), empirical ones are summed.
    """
    if not isinstance(density, Density):
        raise TypeError(f"density must be a Density, got {type(density).__name__}")
    levels, thresholds = _check_table(levels, thresholds)
    if density.is_discrete:
        idx = np.searchsorted(thresholds, density.values, side="left")
        return float(np.dot(density.probs, (density.values - levels[idx]) ** 2))
    lo, hi = density.support
    _, _, D = cell_integrals(density, np.concatenate([[lo], np.clip(thresholds, lo, hi), [hi]]), levels)
    return float(np.sum(D))


@dataclass(frozen=True)
class AuditReport:
    """How far a table is from the Lloyd-Max optimum of its density.

    Attributes
    ----------
    density : Density
    bits : int
    distortion : float
        Exact per-coordinate distortion of the audited table.
    optimal : Codebook
        The exact Lloyd-Max table for the same density and bits.
    excess_percent : float
        ``100 * (distortion / optimal.mse - 1)``.
    max_level_error : float
        ``max |levels - optimal.levels|`` in units of the density's standard deviation.
    best_scale : float
        Factor ``s`` minimising the distortion of ``center + s (levels - center)``: a mis-scaled
        table (e.g. N(0,1) levels used for unit vectors without 1/sqrt(d)) shows s far from 1.
    rescaled_excess_percent : float
        Excess of the table after applying ``best_scale``.
    """

    density: Density
    bits: int
    distortion: float
    optimal: Codebook
    excess_percent: float
    max_level_error: float
    best_scale: float
    rescaled_excess_percent: float

    @property
    def unit_distortion(self) -> float | None:
        """``d * distortion`` for ``SphereMarginal(d)``, else None."""
        if isinstance(self.density, SphereMarginal):
            return self.density.d * self.distortion
        return None

    def to_dict(self) -> dict:
        """JSON-serialisable summary."""
        return {
            "density": {"kind": self.density.kind, "params": self.density.params()},
            "bits": self.bits,
            "distortion": self.distortion,
            "optimal_mse": self.optimal.mse,
            "excess_percent": self.excess_percent,
            "max_level_error": self.max_level_error,
            "best_scale": self.best_scale,
            "rescaled_excess_percent": self.rescaled_excess_percent,
            "unit_distortion": self.unit_distortion,
        }

    def summary(self) -> str:
        """Human-readable multi-line report."""
        lines = [
            f"density            {self.density!r}",
            f"bits               {self.bits} ({2 ** self.bits} levels)",
            f"distortion         {self.distortion:.12g}",
            f"optimal mse        {self.optimal.mse:.12g}",
            f"excess             {self.excess_percent:.6g} %",
            f"max level error    {self.max_level_error:.3g} std",
            f"best scale         {self.best_scale:.9g} (excess after rescaling "
            f"{self.rescaled_excess_percent:.6g} %)",
        ]
        if self.unit_distortion is not None:
            lines.append(f"unit distortion    {self.unit_distortion:.12g} (d * mse)")
        return "\n".join(lines)


def _best_scale(density: Density, levels: np.ndarray, thresholds: np.ndarray) -> float:
    """argmin_s D(center + s (levels - center)): coarse log grid, then bounded Brent."""
    center = density.center if density.center is not None else density.mean

    def cost(log_s):
        s = math.exp(log_s)
        return distortion(density, center + s * (levels - center), center + s * (thresholds - center))

    grid = np.linspace(math.log(1e-3), math.log(1e3), 121)
    vals = [cost(g) for g in grid]
    i = int(np.argmin(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    res = optimize.minimize_scalar(cost, bounds=(lo, hi), method="bounded",
                                   options={"xatol": 1e-12})
    return math.exp(res.x) if res.fun <= vals[i] else math.exp(grid[i])


def audit(density: Density, levels, thresholds=None) -> AuditReport:
    """Compare a table (e.g. copied from another library) with the exact optimum.

    Parameters
    ----------
    density : Density
        The density the table is meant for, e.g. ``SphereMarginal(128)``.
    levels : array_like, shape (2**b,)
        Strictly increasing levels, b in 1..12.
    thresholds : array_like, shape (2**b - 1,), optional
        The table's own thresholds; default: midpoints.

    Returns
    -------
    AuditReport
    """
    levels, thresholds = _check_table(levels, thresholds)
    k = levels.size
    bits = int(round(math.log2(k))) if k >= 2 else 0
    if k < 2 or 2**bits != k or bits > MAX_BITS:
        raise ValueError(f"levels must have 2**b entries with b in 1..{MAX_BITS}, got {k}")
    opt = lloyd_max(density, bits)
    dist = distortion(density, levels, thresholds)
    s = _best_scale(density, levels, thresholds)
    center = density.center if density.center is not None else density.mean
    rescaled = distortion(density, center + s * (levels - center), center + s * (thresholds - center))
    return AuditReport(
        density=density,
        bits=bits,
        distortion=dist,
        optimal=opt,
        excess_percent=100.0 * (dist / opt.mse - 1.0),
        max_level_error=float(np.max(np.abs(levels - opt.levels))) / density.scale,
        best_scale=s,
        rescaled_excess_percent=100.0 * (rescaled / opt.mse - 1.0),
    )
