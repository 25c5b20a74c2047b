"""The default set of theory curves (what ``kvq-theory curves`` writes)."""

from __future__ import annotations

import numpy as np

from codebooks import Density, Gaussian, SphereMarginal, audit, lloyd_max

from .bounds import (bias_factor, entropy_coded_limit, inner_product_lower_bound, panter_dite,
                     qjl_prod_distortion, shannon_lower_bound, turboquant_mse_bound,
                     turboquant_prod_bound, turboquant_prod_refined)
from .curves import entropy_coded_curve, lloyd_max_curve, norm_correction_effect
from .results import Series

__all__ = ["default_series", "audit_series", "capped_lloyd"]


def capped_lloyd(density: Density, bits: int, iterations: int = 300) -> np.ndarray:
    """Levels from plain Lloyd stopped after ``iterations`` steps, as public implementations do.

    Starts from levels evenly spaced over +-3 std (clipped into the support) and moves each level to
    its cell's centroid (closed-form cell moments) ``iterations`` times. :ref:`ref-lloyd-max`:
    public code stops after 100-300 iterations and ends 2%-800% above the optimum at 5-8 bits.
    """
    k = 2**bits
    lo, hi = density.support
    c0 = density.center if density.center is not None else density.mean
    s = density.scale
    c = np.linspace(max(lo, c0 - 3 * s), min(hi, c0 + 3 * s), k + 2)[1:-1]
    for _ in range(iterations):
        t = np.concatenate([[lo], 0.5 * (c[:-1] + c[1:]), [hi]])
        m0, m1, _ = density.cell_moments(t[:-1], t[1:])
        c = np.where(m0 > 0, m1 / np.where(m0 > 0, m0, 1.0), c)
    return c


def audit_series(name: str, density: Density, levels, description: str) -> Series:
    """One measured point: the exact normalized distortion of an external table."""
    rep = audit(density, levels)
    return Series(name=name, description=description, x=[rep.bits], y=[rep.distortion / density.second_moment],
                  params={"density": {"kind": density.kind, **density.params()},
                          "excess_percent": rep.excess_percent, "best_scale": rep.best_scale},
                  kind="measured", quantity="mse")


def default_series(dim: int, bits, mc_samples: int = 20000, seed: int = 0) -> list[Series]:
    """Bounds, exact curves and audit points for unit vectors in R^dim.

    Parameters
    ----------
    dim : int
        Dimension of the rotated unit vectors (SphereMarginal(dim)).
    bits : sequence of int in 1..12
    mc_samples : int
        Monte Carlo vectors per bit width for the norm-correction curve.
    seed : int

    Returns
    -------
    list of Series
    """
    b = np.asarray(sorted(set(int(v) for v in bits)))
    x = b.astype(float).tolist()
    sphere = SphereMarginal(dim)
    tag = f"sphere_d{dim}"
    p = {"dim": dim}
    out = [
        Series("shannon_lower_bound", "Shannon lower bound 4^-b for unit vectors (TurboQuant Thm 3)",
               x, shannon_lower_bound(b).tolist(), {}, "lower_bound", "mse"),
        Series("turboquant_mse_bound", "TurboQuant_mse upper bound (sqrt(3) pi/2) 4^-b (Thm 1)",
               x, turboquant_mse_bound(b).tolist(), {}, "upper_bound", "mse"),
        Series(f"lloyd_max_{tag}", f"exact Lloyd-Max d*mse of SphereMarginal({dim})",
               x, lloyd_max_curve(sphere, b).tolist(), p, "exact", "mse"),
        Series("lloyd_max_gaussian", "exact Lloyd-Max mse of N(0,1) (the d -> infinity limit)",
               x, lloyd_max_curve(Gaussian(), b).tolist(), {}, "exact", "mse"),
        Series(f"panter_dite_{tag}", "Panter-Dite high-rate approximation (1/12)(int f^(1/3))^3 4^-b * d",
               x, panter_dite(sphere, b).tolist(), p, "approximation", "mse"),
        Series(f"entropy_coded_{tag}", "uniform thresholds + ideal entropy coding (rate = index entropy)",
               x, entropy_coded_curve(sphere, b.astype(float)).tolist(), p, "exact", "mse"),
        Series("entropy_coded_limit", "high-rate entropy-coded limit (pi e/6) 4^-b",
               x, entropy_coded_limit(b).tolist(), {}, "approximation", "mse"),
    ]
    nc = [norm_correction_effect(dim, int(v), n=mc_samples, seed=seed + int(v)) for v in b]
    out.append(Series(f"norm_corrected_{tag}",
                      "storing ||x||/||x_hat|| (norm correction): E||x - Q(y)/||Q(y)||||^2, Monte Carlo",
                      x, [r.corrected for r in nc], {**p, "samples": mc_samples, "seed": seed},
                      "monte_carlo", "mse", y_err=[r.corrected_se for r in nc]))
    # inner products, in units of ||y||^2 / d
    ip = b.astype(float)
    out += [
        Series("inner_product_lower_bound", "inner-product lower bound (||y||^2/d) 4^-b",
               x, (dim * inner_product_lower_bound(ip, dim)).tolist(), p, "lower_bound", "inner_product"),
        Series("turboquant_prod_bound", "TurboQuant_prod bound (sqrt(3) pi^2 ||y||^2/d) 4^-b (Thm 2)",
               x, (dim * turboquant_prod_bound(ip, dim)).tolist(), p, "upper_bound", "inner_product"),
        Series(f"turboquant_prod_refined_d{dim}", "refined bound (pi/(2d)) ||y||^2 D_mse(b-1), exact D_mse",
               x, (dim * np.asarray(turboquant_prod_refined(b, dim))).tolist(), p, "upper_bound",
               "inner_product"),
        Series(f"qjl_prod_exact_d{dim}", "(b-1)-bit MSE + QJL with a Gaussian d x d sketch: exact",
               x, (dim * np.asarray(qjl_prod_distortion(b, dim))).tolist(), p, "exact", "inner_product"),
        Series(f"bias_factor_{tag}", "E[<y, x_hat>]/<y, x> of the MSE quantizer (2/pi at 1 bit, Gaussian)",
               x, [bias_factor(lloyd_max(sphere, int(v))) for v in b], p, "exact", "bias"),
    ]
    peer = [int(v) for v in b if 5 <= v <= 8]
    if peer:
        reps = [audit(sphere, capped_lloyd(sphere, v)) for v in peer]
        out.append(Series(f"peer_lloyd300_{tag}",
                          "tables made the way public code does (Lloyd capped at 300 iterations), audited",
                          [float(r.bits) for r in reps], [r.distortion / sphere.second_moment for r in reps],
                          {**p, "iterations": 300, "excess_percent": [r.excess_percent for r in reps]},
                          "measured", "mse"))
    return out

