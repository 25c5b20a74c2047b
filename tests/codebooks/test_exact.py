"""``lloyd_max(..., exact=True)``: the 50-digit refinement forgets its float64 start.

What makes the shipped tables the same bytes on every platform: the float64 solve's last bits
depend on the platform (scipy 1.16.3 and 1.17.1 give default sets up to 1,790 ulps apart), but
the refinement converges to the exact optimum and rounds, so any start within the float64 solve's
reach gives the same table. Correct rounding itself is checked against the independent mpmath
reference in ``test_mpmath_reference.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from codebooks import Empirical, Gaussian, PolarAngle, SphereMarginal, lloyd_max, shipped_tables
from codebooks._exact import refine_half
from codebooks.codebook import ConvergenceError

CASES = [(SphereMarginal(1024), 8), (SphereMarginal(2), 6), (Gaussian(1.0), 7), (PolarAngle(3), 4),
         (PolarAngle(1), 3)]


@pytest.mark.parametrize(("density", "bits"), CASES, ids=lambda v: repr(v))
def test_refinement_is_independent_of_the_start(density, bits):
    # A platform moves the float64 levels by up to ~2e-13 relative (< 1e-12 std); perturb them by
    # 1e-11 std (>10x more), seeded, and the refined table must not change in a single bit.
    fast = lloyd_max(density, bits)
    upper = fast.levels[2 ** (bits - 1):]
    base = refine_half(density, upper)
    rng = np.random.default_rng(7)
    for _ in range(2):
        moved = upper + 1e-11 * density.scale * rng.standard_normal(upper.size)
        assert refine_half(density, moved)[:3] == base[:3]  # levels, residual, mse (not the step count)


@pytest.mark.parametrize(("density", "bits"), CASES[:3], ids=lambda v: repr(v))
def test_exact_and_float64_tables_agree_to_the_float64_conditioning(density, bits):
    # Both are the optimum; the float64 one within its rounding floor times the system's
    # conditioning (level error <= 1e-14 std K^2, see test_mpmath_reference).
    fast, exact = lloyd_max(density, bits), lloyd_max(density, bits, exact=True)
    k = 2**bits
    assert np.max(np.abs(fast.levels - exact.levels)) <= 1e-14 * density.scale * k**2
    assert exact.mse == pytest.approx(fast.mse, rel=1e-13)
    np.testing.assert_array_equal(exact.levels - density.center, density.center - exact.levels[::-1])


def test_shipped_tables_are_the_exact_ones():
    tables = shipped_tables()
    assert {cb.solver for cb in tables.values()} == {"newton-tridiagonal+mp50"}
    got = tables["sphere_d128_b8"]
    want = lloyd_max(SphereMarginal(128), 8, exact=True)
    assert got.levels.tobytes() == want.levels.tobytes() and got.mse == want.mse


def test_exact_argument_is_checked_and_empirical_is_unchanged():
    with pytest.raises(TypeError, match="exact must be a bool"):
        lloyd_max(Gaussian(), 2, exact=1)
    emp = Empirical(np.random.default_rng(0).standard_normal(400))
    assert lloyd_max(emp, 3, exact=True) == lloyd_max(emp, 3)


def test_refinement_that_cannot_settle_raises(monkeypatch):
    import codebooks._exact as ex

    monkeypatch.setattr(ex, "_MAX_STEPS", 1)
    with pytest.raises(ConvergenceError, match="did not settle"):
        lloyd_max(SphereMarginal(64), 5, exact=True)
