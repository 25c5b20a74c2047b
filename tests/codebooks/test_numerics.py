"""Scale-invariant numerics and the exact best scale (issue 16, findings 5, 6, 7 and the sigma list).

Finding 5: ``distortion(Empirical([0, 1, 2], weights=[1e308] * 3), [.5, 1.5])`` returned 0.0.
Finding 6: ``audit`` clamped ``best_scale`` to a 1e-3..1e3 grid (levels x 1e5 reported 0.001).
Finding 7: ``Gaussian(1e-160)`` tables came back with mse = 0. Crash list: sigma 1e160..1e300 and
1e-300 (OverflowError, ZeroDivisionError), denormal Empirical samples.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from codebooks import Empirical, Gaussian, audit, distortion, lloyd_max
from codebooks.densities import SCALE_RANGE

# N(0,1) optima (docs/references/quantization.md, independently computed to >= 16 digits)
GAUSS_MSE = {1: 0.36338022763241866, 2: 0.11748184782932929, 3: 0.03454776078850373, 4: 0.0095010080081918861}


@pytest.mark.parametrize("sigma", [1e-300, 1e-160, 1e-151, 1.1e150, 1e160, 1e300])
def test_sigma_outside_the_normal_range_is_refused(sigma):
    with pytest.raises(ValueError, match=r"sigma must be in \[1e-150, 1e\+150\]"):
        lloyd_max(Gaussian(sigma), 4)


@pytest.mark.parametrize("sigma", [SCALE_RANGE[0], 1e-100, 3.7e-7, 1e100, SCALE_RANGE[1]])
@pytest.mark.parametrize("bits", [1, 4])
def test_extreme_sigma_is_exact(sigma, bits):
    """mse / sigma^2 equals the N(0,1) optimum to 1e-13 relative: the solver works in sigma units
    (the 1e-13 allows a few roundings of sigma^2; the reference values have >= 16 digits)."""
    cb = lloyd_max(Gaussian(sigma), bits)
    assert cb.mse > 0 and cb.mse / sigma**2 == pytest.approx(GAUSS_MSE[bits], rel=1e-13)


def test_weights_past_float_max():
    e = Empirical([0.0, 1.0, 2.0], weights=[1e308] * 3)
    assert distortion(e, [0.5, 1.5]) == 0.25  # each sample is 0.5 from its level: exact in binary
    assert np.array_equal(e.probs, np.full(3, 1 / 3))
    assert Empirical(e.values, weights=e.masses) == e  # the stored masses rebuild it


@pytest.mark.parametrize("samples", [[5e-324, 1e-323, 2e-323], [1e-310, 2e-310, 3e-310], [0.0, 1e-200],
                                     [1e300, -1e300, 0.0]])
def test_samples_outside_the_normal_range_are_refused(samples):
    with pytest.raises(ValueError, match="samples must span at least 1e-150 and stay within"):
        lloyd_max(Empirical(samples), 1)


@pytest.mark.parametrize("factor", [1e5, 1e-5, 1e9, 1.3])
def test_best_scale_is_not_clamped(factor):
    """A Lloyd-Max table scaled by ``factor``: the best scale is 1/factor and the rescaled excess 0.
    D(s) is smooth at its minimum, so s is determined to ~sqrt(eps) = 1.5e-8 relative; the excess
    to 1e-9 % (rounding of D, 1e-11 relative)."""
    cb = lloyd_max(Gaussian(1.0), 3)
    rep = audit(Gaussian(1.0), cb.levels * factor)
    assert rep.best_scale == pytest.approx(1 / factor, rel=1e-7)
    assert abs(rep.rescaled_excess_percent) < 1e-9


def test_best_scale_of_an_empirical_density_is_the_global_minimum():
    """The breakpoint method against a dense scan of D(s) over 6 decades (200k points): no scanned
    scale does better, and the scan's best is within its spacing of the exact one."""
    rng = np.random.default_rng(4)
    e = Empirical(rng.standard_normal(60))
    levels = np.array([-1.7, -0.3, 0.4, 2.2]) * 1e3
    rep = audit(e, levels)
    c = e.mean
    a = levels - c
    t = 0.5 * (a[1:] + a[:-1])
    grid = np.exp(np.linspace(math.log(1e-7), math.log(1e-1), 200_001))
    scan = [distortion(e, c + s * a, c + s * t) for s in grid[::20]]
    best = distortion(e, c + rep.best_scale * a, c + rep.best_scale * t)
    assert best <= min(scan) * (1 + 1e-12)
