"""The planner's allocator and additive model (``kvq_eval.plan``): exact against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvq_eval.plan import (Allocation, allocate, cost_units, dp_table, extrapolate_tq, lagrangian_path, lower_hull,
                           model_losses)

# Losses are multiples of 1/8 and costs multiples of 1/4 (exact in binary floating point), so the
# brute force and the dynamic program sum them without rounding: a tie is a tie in both.
_item = st.integers(1, 4).flatmap(lambda n: st.tuples(st.lists(st.integers(0, 24).map(lambda c: c / 4), min_size=n, max_size=n),
                                                       st.lists(st.integers(0, 40).map(lambda l: l / 8), min_size=n, max_size=n)))
_items = st.lists(_item, min_size=1, max_size=4)


def _brute(costs, losses, budget):
    """(least cost, least loss at that cost) over every allocation with loss <= budget, or None."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(c[j] for c, j in zip(costs, choice))
        loss = sum(l[j] for l, j in zip(losses, choice))
        if loss <= budget and (best is None or (cost, loss) < best):
            best = (cost, loss)
    return best


@settings(max_examples=300, deadline=None)
@given(_items, st.integers(0, 100).map(lambda b: b / 8))
def test_allocate_is_the_brute_force_optimum(items, budget):
    costs, losses = [c for c, _ in items], [l for _, l in items]
    got = allocate(costs, losses, budget)
    want = _brute(costs, losses, budget)
    assert got.method == "dp"
    if want is None:
        assert not got.feasible
        # the least-loss allocation, the cheapest among them
        least = min(sum(l[j] for l, j in zip(losses, ch)) for ch in itertools.product(*(range(len(c)) for c in costs)))
        assert got.loss == least
        assert got.cost == min(sum(c[j] for c, j in zip(costs, ch)) for ch in itertools.product(*(range(len(c)) for c in costs))
                               if sum(l[j] for l, j in zip(losses, ch)) == least)
    else:
        assert got.feasible and (got.cost, got.loss) == want
    # the reported sums are those of the choice
    assert got.cost == sum(c[j] for c, j in zip(costs, got.choice))
    assert got.loss == sum(l[j] for l, j in zip(losses, got.choice))


@settings(max_examples=200, deadline=None)
@given(_items)
def test_lagrangian_path_points_are_optimal_for_their_own_loss(items):
    """Everett: every greedy point on the convex hulls is a least-cost allocation for its loss, and
    the path runs from the cheapest allocation to the least-loss one, cost up and loss down."""
    costs, losses = [c for c, _ in items], [l for _, l in items]
    path = lagrangian_path(costs, losses)
    for a in path:
        assert a.cost == _brute(costs, losses, a.loss)[0]
    assert path[0].cost == sum(min(c) for c in costs)
    assert path[-1].loss == sum(min(l) for l in losses)
    assert all(b.cost >= a.cost and b.loss <= a.loss for a, b in zip(path, path[1:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=9))
def test_lower_hull_is_convex_and_below_every_point(points):
    cost = np.array([p[0] for p in points], dtype=float)
    loss = np.array([p[1] for p in points], dtype=float)
    h = lower_hull(cost, loss)
    hc, hl = cost[h], loss[h]
    assert np.all(np.diff(hc) > 0) and np.all(np.diff(hl) < 0)
    slopes = -np.diff(hl) / np.diff(hc)
    assert np.all(np.diff(slopes) < 0)  # strictly convex: no collinear middle point is kept
    assert hl[0] == loss[cost == cost.min()].min() and hl[-1] == loss.min()
    # every point lies on or above the hull's piecewise-linear function (and right of its start)
    for c, l in zip(cost, loss):
        if c >= hc[-1]:
            assert l >= hl[-1]
        else:
            assert l >= np.interp(c, hc, hl) - 1e-12


@settings(max_examples=100, deadline=None)
@given(_items, st.integers(0, 100).map(lambda b: b / 8), st.integers(0, 100).map(lambda b: b / 8))
def test_more_budget_never_costs_more(items, b1, b2):
    costs, losses = [c for c, _ in items], [l for _, l in items]
    lo, hi = sorted((b1, b2))
    a, b = allocate(costs, losses, lo), allocate(costs, losses, hi)
    if a.feasible:
        assert b.feasible and b.cost <= a.cost


def test_lagrangian_fallback_and_the_lattice():
    costs = [[2.25, 3.25, 4.25], [2.25, 3.25, 4.25]]
    losses = [[0.5, 0.2, 0.1], [0.9, 0.3, 0.05]]
    units, unit = cost_units(costs)
    assert unit == 1 and [u.tolist() for u in units] == [[0, 1, 2], [0, 1, 2]]
    assert cost_units([[1.0, 1.5, 2.0]])[1] == 0.5 and cost_units([[3.0]])[1] == 1
    best = dp_table(costs, losses)[0]
    assert best.tolist() == pytest.approx([1.4, 0.8, 0.5, 0.25, 0.15])
    exact = allocate(costs, losses, 0.6)
    assert (exact.choice, exact.cost, exact.method) == ((1, 1), 6.5, "dp")  # loss 0.5: 2 + 2 units
    lag = allocate(costs, losses, 0.6, max_states=2)
    assert lag.method == "lagrangian" and lag.loss <= 0.6 and lag.cost >= exact.cost
    none = allocate(costs, losses, 0.1)
    assert not none.feasible and none.choice == (2, 2) and none.loss == pytest.approx(0.15)


@pytest.mark.parametrize("bad, match", [
    (([], []), "same positive number of items"),
    (([[1.0]], [[1.0, 2.0]]), "same positive length"),
    (([[-1.0]], [[0.0]]), "costs must be >= 0"),
    (([[1.0]], [[float("nan")]]), "finite"),
])
def test_bad_curves_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        allocate(*bad, 1.0)
    for budget in (float("inf"), True, "1"):
        with pytest.raises(ValueError, match="budget must be a finite number"):
            allocate([[1.0]], [[0.0]], budget)


def test_model_losses_and_extrapolation():
    from codebooks import SphereMarginal
    from kvq_ref.common import codebook

    assert model_losses([-1e-5, 0.0, 2e-3]).tolist() == [0.0, 0.0, 2e-3]
    with pytest.raises(ValueError, match="finite"):
        model_losses([np.nan])
    got = extrapolate_tq({3: 0.02, 4: 0.005}, [3, 4, 5, 6], 64)
    d = {b: codebook(SphereMarginal(64), b).mse for b in (4, 5, 6)}
    assert got[3] == 0.02 and got[4] == 0.005
    assert got[5] == pytest.approx(0.005 * d[5] / d[4], rel=1e-14) and got[6] == pytest.approx(0.005 * d[6] / d[4], rel=1e-14)
    # D(b) falls about 4x per bit at high rate (the Panter-Dite 2^-2b law)
    assert 3.5 < got[5] / got[6] < 4.5
    with pytest.raises(ValueError, match="not above the highest measured"):
        extrapolate_tq({2: 0.1, 4: 0.01}, [3], 64)
