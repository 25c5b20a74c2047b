"""Reverse water-filling and the equal-volume grouping gap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from theory import group_log_volumes, grouping_gap, reverse_water_filling

variances = st.lists(st.floats(1e-4, 1e4), min_size=2, max_size=40)


@given(variances, st.floats(0.0, 200.0))
def test_budget_and_distortion(lam, budget):
    wf = reverse_water_filling(lam, budget)
    lam = np.asarray(lam)
    assert wf.total_bits == pytest.approx(budget, rel=1e-12, abs=1e-9)
    assert np.all(wf.bits >= 0)
    assert np.allclose(wf.distortion, np.minimum(wf.theta, lam), rtol=1e-12)
    # the allocation is what the distortion-rate of each Gaussian coefficient gives
    assert np.allclose(wf.distortion, lam * 4.0**-wf.bits, rtol=1e-9)


@given(variances, st.floats(1.0, 50.0), st.integers(0, 2**32 - 1))
def test_water_filling_beats_other_allocations(lam, budget, seed):
    """Convexity: any other split of the same budget has a higher total distortion."""
    wf = reverse_water_filling(lam, budget)
    lam = np.asarray(lam)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        w = rng.dirichlet(np.ones(lam.size))
        other = np.sum(np.minimum(lam, lam * 4.0 ** -(budget * w)))
        assert wf.total_distortion <= other * (1 + 1e-12)


def test_equal_variances_and_zero_budget():
    wf = reverse_water_filling([2.0] * 8, 16.0)
    assert np.allclose(wf.bits, 2.0) and wf.total_distortion == pytest.approx(8 * 2.0 / 16)
    wf = reverse_water_filling([1.0, 3.0], 0.0)
    assert wf.total_bits == 0.0 and wf.total_distortion == 4.0
    # a coefficient below the water gets no bits
    wf = reverse_water_filling([100.0, 1.0], 2.0)
    assert wf.bits[1] == 0.0 and wf.bits[0] == pytest.approx(2.0)


def test_equal_volume_partitions_have_zero_gap():
    # groups {0,3}, {1,2}: products 1*8 = 2*4
    lam = np.array([1.0, 2.0, 4.0, 8.0])
    assert grouping_gap(lam, [np.array([0, 3]), np.array([1, 2])]) == pytest.approx(0.0, abs=1e-15)
    assert grouping_gap(lam, np.array([0, 1, 1, 0])) == pytest.approx(0.0, abs=1e-15)
    # consecutive groups {0,1}, {2,3}: volumes sqrt(2), sqrt(32): AM/GM - 1 = (sqrt2+sqrt32)/2/sqrt(8) - 1
    expected = (math.sqrt(2) + math.sqrt(32)) / 2 / math.sqrt(8) - 1
    assert grouping_gap(lam, [np.array([0, 1]), np.array([2, 3])]) == pytest.approx(expected, rel=1e-14)


@given(st.integers(2, 8), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_random_partitions_have_nonnegative_gap(g, ngroups, seed):
    rng = np.random.default_rng(seed)
    lam = rng.lognormal(0, 2, g * ngroups)
    labels = rng.permutation(np.repeat(np.arange(ngroups), g))
    gap = grouping_gap(lam, labels)
    assert gap >= 0
    v = group_log_volumes(lam, labels)
    if np.ptp(v) > 1e-9:
        assert gap > 0


def test_validation():
    with pytest.raises(ValueError, match="variances must be > 0"):
        reverse_water_filling([1.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="variances must be finite"):
        reverse_water_filling([1.0, np.nan], 1.0)
    with pytest.raises(ValueError, match="total_bits must be finite and >= 0"):
        reverse_water_filling([1.0], -1.0)
    with pytest.raises(ValueError, match="partition the coefficients"):
        grouping_gap([1.0, 2.0, 3.0, 4.0], [np.array([0, 1]), np.array([1, 2])])
    with pytest.raises(ValueError, match="same size"):
        grouping_gap([1.0, 2.0, 3.0], [np.array([0, 1]), np.array([2])])
