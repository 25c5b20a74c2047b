"""Norm correction (exact at 1 bit, Monte Carlo otherwise) and the curve helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from codebooks import Gaussian, SphereMarginal, lloyd_max
from theory import (entropy_coded_point, gap_curve, lloyd_max_curve, norm_correction_effect,
                    norm_correction_one_bit)


def test_one_bit_norm_correction_is_exact():
    for d in (16, 128):
        r = norm_correction_effect(d, 1, n=40_000, seed=3)
        assert r.corrected_se < 0.01 * r.corrected
        assert abs(r.corrected - norm_correction_one_bit(d)) <= 4.5 * r.corrected_se
        assert abs(r.plain - lloyd_max(SphereMarginal(d), 1).unit_distortion) <= 4.5 * r.plain_se


@pytest.mark.parametrize("bits, lo, hi", [(1, 0.10, 0.12), (2, 0.02, 0.03), (3, -0.006, -0.003),
                                          (4, -0.017, -0.013)])
def test_norm_correction_sign_flips_between_2_and_3_bits(bits, lo, hi):
    """docs/references/turboquant.md (measured): +11 %, +2.4 %, -0.4 %, -1.5 % at d = 128."""
    r = norm_correction_effect(128, bits, n=20_000, seed=bits)
    assert r.change_se < 0.1 * (hi - lo)
    assert lo < r.change < hi


def test_curves_match_codebooks():
    b = np.arange(1, 6)
    for dens in (SphereMarginal(80), Gaussian(3.0)):
        curve = lloyd_max_curve(dens, b)
        assert np.allclose(curve, [lloyd_max(dens, int(v)).mse / dens.second_moment for v in b], rtol=1e-15)
        assert np.allclose(gap_curve(dens, b), curve * 4.0**b, rtol=1e-15)


def test_entropy_coded_point_limits():
    # a huge step leaves one cell: rate 0, distortion = the variance
    rate, dist = entropy_coded_point(Gaussian(), 1e3)
    assert rate == pytest.approx(0.0, abs=1e-12) and dist == pytest.approx(1.0, rel=1e-12)
    # a fine step: D ~ step^2 / 12, rate ~ h(X) - log2(step)
    step = 1e-3
    rate, dist = entropy_coded_point(Gaussian(), step)
    assert dist == pytest.approx(step**2 / 12, rel=1e-5)
    assert rate == pytest.approx(0.5 * math.log2(2 * math.pi * math.e) - math.log2(step), abs=1e-6)


def test_curve_validation():
    with pytest.raises(ValueError, match="bits must be integers in 1..12"):
        lloyd_max_curve(Gaussian(), [0])
    with pytest.raises(ValueError, match="step must be finite and > 0"):
        entropy_coded_point(Gaussian(), -1.0)
    with pytest.raises(ValueError, match="n must be >= 100"):
        norm_correction_effect(16, 1, n=10)
