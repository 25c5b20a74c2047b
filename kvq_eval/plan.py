"""Per-(layer, role) bit allocation under a quality budget: the additive model and its exact optimum.

The planner (``kvq_eval.planner``) chooses, for every layer and for keys and values separately, one
candidate quantizer (TurboQuantMSE at 1..8 bits, or another registered method) so that the cache
holds the fewest stored bits while its predicted quality loss stays within a budget. This module is
the math of that choice: no model, no files.

The model
---------
``S[l, r, c]`` is the measured loss per token (nats: KL(fp32 || quant) by default, or the NLL
change) when only layer ``l``'s role ``r`` (keys or values) is stored by candidate ``c`` and
everything else is exact (``kvq_eval.sensitivity``). The additive model predicts the plan's loss as
the sum of its items::

    loss(plan) ~= sum_{l, r} S[l, r, plan[l, r]]

For small perturbations the KL is a quadratic form in them, and the sum is exact when the items'
perturbations are uncorrelated (independent seeded rotations per layer, head and role): the cross
terms vanish in expectation. Where they do not (errors that compound through later layers, the
softmax's nonlinearity at low bits), the validation of every plan on held-out windows
(``kvq_eval.planner``) measures how far it is off and corrects the budget. Model values are
clipped at 0 (``model_losses``): a measured negative NLL change is noise of one quantization
realization and must not pay for other items' damage (a KL is never negative).

Above the highest measured bit width of a TurboQuantMSE curve, a value can be extrapolated with the
exact distortion curve: ``S(b) = S(b0) D(b) / D(b0)`` with ``D`` the Lloyd-Max MSE of
SphereMarginal(d) at ``b`` bits. At high rate the loss is linear in the quantization error's
second moment (its bias and its variance both scale with ``D``), which is where the ratio holds.

The optimizer
-------------
``minimize sum_i cost[i, c_i]  subject to  sum_i loss[i, c_i] <= budget`` (one choice per item) is a
multiple-choice knapsack. Stored bits are an affine function of the mean rate over items
(``kvq_eval.accounting``: band and tables do not depend on the choice), so ``cost`` is the
candidate's rate in bits per element. ``allocate`` solves it exactly by dynamic programming over
the total cost: every rate of the candidate family is a multiple of a common unit (whole bits for
TurboQuantMSE at one head dimension), so the table of "least total loss at each total cost" is
small (``dp_table``). Where the lattice would be too large it falls back to the Lagrangian path.

The Lagrangian path (``lagrangian_path``) is the greedy marginal-return allocation over the lower
convex hulls of the item curves: start from each item's cheapest hull point and repeatedly take the
hull step with the largest loss decrease per bit. By Everett's theorem each point of the path
minimizes ``cost + lambda * loss`` for some ``lambda >= 0`` and is therefore optimal for the budget
equal to its own loss; between two path points the optimum may use non-hull points, which is what
the dynamic program adds. ``tests/kvq_eval/test_plan.py`` checks both against brute force.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce

import numpy as np

__all__ = ["Allocation", "allocate", "dp_table", "lagrangian_path", "lower_hull", "cost_units", "model_losses",
           "extrapolate_tq", "MAX_STATES"]

#: Largest dynamic-programming table (total-cost states) ``allocate`` builds before it falls back to
#: the Lagrangian path (60 items of TurboQuantMSE at 1..8 bits: 421 states).
MAX_STATES = 1 << 18


@dataclass(frozen=True)
class Allocation:
    """One choice per item.

    Attributes
    ----------
    choice : tuple of int
        Index of the chosen option of each item.
    cost, loss : float
        Sums of the chosen options' costs and losses.
    feasible : bool
        ``loss <= budget``; when no choice meets the budget, ``choice`` is the least-loss one (the
        cheapest among them) and ``feasible`` is False.
    method : {"dp", "lagrangian"}
        Exact dynamic program, or the Lagrangian path (``allocate``).
    """

    choice: tuple
    cost: float
    loss: float
    feasible: bool
    method: str


def _check_curves(costs, losses) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if len(costs) != len(losses) or not len(costs):
        raise ValueError(f"costs and losses must list the same positive number of items, got {len(costs)} and "
                         f"{len(losses)}")
    cs, ls = [], []
    for i, (c, l) in enumerate(zip(costs, losses)):
        c, l = np.asarray(c, dtype=np.float64), np.asarray(l, dtype=np.float64)
        if c.ndim != 1 or c.shape != l.shape or c.size == 0:
            raise ValueError(f"item {i}: costs and losses must be 1-D of the same positive length, got "
                             f"{c.shape} and {l.shape}")
        if not (np.all(np.isfinite(c)) and np.all(np.isfinite(l))):
            raise ValueError(f"item {i}: costs and losses must be finite")
        if np.any(c < 0):
            raise ValueError(f"item {i}: costs must be >= 0")
        cs.append(c)
        ls.append(l)
    return cs, ls


def _check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number, got {budget!r}")
    return float(budget)


def lower_hull(cost, loss) -> np.ndarray:
    """Indices of the lower convex hull of an item's (cost, loss) points, by increasing cost.

    The hull's first point is the cheapest option (least loss among equally cheap ones), its last
    the least-loss option (cheapest among them); along it the loss strictly decreases and the
    loss decrease per unit cost (the slope) strictly decreases. Dominated points (no cheaper and no
    better than another) and points above a chord are left out.
    """
    cost, loss = np.asarray(cost, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    order = np.lexsort((loss, cost))  # by cost, then loss
    pts: list[int] = []
    for j in order:
        if pts and cost[j] == cost[pts[-1]]:
            continue  # same cost, no less loss than the kept one
        if pts and loss[j] >= loss[pts[-1]]:
            continue  # dearer and no better
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            # b is on or above the chord a -> j: (loss_b - loss_a)(cost_j - cost_a) >= (loss_j - loss_a)(cost_b - cost_a)
            if (loss[b] - loss[a]) * (cost[j] - cost[a]) >= (loss[j] - loss[a]) * (cost[b] - cost[a]):
                pts.pop()
            else:
                break
        pts.append(int(j))
    return np.array(pts, dtype=np.int64)


def lagrangian_path(costs, losses) -> list[Allocation]:
    """The greedy marginal-return allocations over the items' lower convex hulls (module Notes).

    Returns
    -------
    list of Allocation
        From the cheapest allocation (every item at its cheapest hull point) to the least-loss one,
        one hull step at a time in order of decreasing loss decrease per unit cost; each is optimal
        (least cost) among all allocations whose loss is at most its own (Everett).
    """
    cs, ls = _check_curves(costs, losses)
    hulls = [lower_hull(c, l) for c, l in zip(cs, ls)]
    steps = []
    for i, (h, c, l) in enumerate(zip(hulls, cs, ls)):
        for k in range(1, h.size):
            slope = (l[h[k - 1]] - l[h[k]]) / (c[h[k]] - c[h[k - 1]])
            steps.append((-slope, i, k))
    steps.sort()  # largest slope first; ties by item then step (within an item slopes decrease)
    pos = [0] * len(cs)

    def current():
        choice = tuple(int(h[p]) for h, p in zip(hulls, pos))
        cost = float(sum(c[j] for c, j in zip(cs, choice)))
        loss = float(sum(l[j] for l, j in zip(ls, choice)))
        return Allocation(choice, cost, loss, True, "lagrangian")

    path = [current()]
    for _, i, k in steps:
        pos[i] = k
        path.append(current())
    return path


def cost_units(costs) -> tuple[list[np.ndarray], Fraction]:
    """Each item's costs above its cheapest option as integers of a common unit, and that unit.

    Costs are read as exact binary fractions (``Fraction(float)``); the unit is the greatest
    common divisor of all the offsets (1 when every offset is 0), so the integer costs are exact.
    """
    offsets = [[Fraction(float(x)) - Fraction(float(np.min(c))) for x in c] for c in costs]
    nonzero = [f for row in offsets for f in row if f]
    if not nonzero:
        return [np.zeros(len(row), dtype=np.int64) for row in offsets], Fraction(1)
    den = reduce(math.lcm, (f.denominator for f in nonzero))
    unit = Fraction(reduce(math.gcd, (f.numerator * (den // f.denominator) for f in nonzero)), den)
    return [np.array([int(f / unit) for f in row], dtype=np.int64) for row in offsets], unit


def dp_table(costs, losses, max_states: int = MAX_STATES):
    """Least total loss at every total cost, exactly (the multiple-choice knapsack's table).

    Returns
    -------
    best : ndarray, float64, shape (S,)
        ``best[s]`` is the least sum of losses over allocations whose total cost is
        ``base + s * unit`` (``inf`` where none has that cost).
    arg : ndarray, int16, shape (items, S)
        The choice of each item on the way to ``best`` (for ``allocate``'s backtracking).
    units : list of ndarray
        Integer costs of each item's options (``cost_units``).
    base : float
        Total cost of the cheapest allocation.
    unit : Fraction

    Raises
    ------
    ValueError
        When the table would have more than ``max_states`` states.
    """
    cs, ls = _check_curves(costs, losses)
    units, unit = cost_units(cs)
    n_states = 1 + sum(int(u.max()) for u in units)
    if n_states > max_states:
        raise ValueError(f"the cost lattice has {n_states} states, more than max_states={max_states}")
    if max(c.size for c in cs) > np.iinfo(np.int16).max:
        raise ValueError("an item has more options than the table's int16 choices hold")
    best = np.full(n_states, np.inf)
    best[0] = 0.0
    arg = np.zeros((len(cs), n_states), dtype=np.int16)
    for i, (u, l) in enumerate(zip(units, ls)):
        new = np.full(n_states, np.inf)
        for j in range(u.size):
            cand = np.full(n_states, np.inf)
            cand[u[j]:] = best[:n_states - u[j]] + l[j]
            better = cand < new
            new[better] = cand[better]
            arg[i, better] = j
        best = new
    return best, arg, units, float(sum(float(c.min()) for c in cs)), unit


def allocate(costs, losses, budget: float, max_states: int = MAX_STATES) -> Allocation:
    """The least-cost allocation whose summed loss is at most ``budget`` (module Notes).

    Parameters
    ----------
    costs, losses : sequence of 1-D array_like
        Per item, the cost (>= 0) and loss of each option (finite; the same length per item).
    budget : float
    max_states : int
        Largest exact table; beyond it the best point of the Lagrangian path is returned
        (``method="lagrangian"``: optimal for its own loss, which may be below ``budget``).

    Returns
    -------
    Allocation
        Among allocations of the least cost, the one of least loss. When none meets the budget,
        the least-loss allocation with ``feasible=False``.
    """
    budget = _check_budget(budget)
    cs, ls = _check_curves(costs, losses)
    try:
        best, arg, units, _, _ = dp_table(cs, ls, max_states)
    except ValueError as exc:
        if "max_states" not in str(exc):
            raise
        path = lagrangian_path(cs, ls)
        ok = [a for a in path if a.loss <= budget]
        return ok[0] if ok else Allocation(path[-1].choice, path[-1].cost, path[-1].loss, False, "lagrangian")
    ok = np.flatnonzero(best <= budget)
    feasible = ok.size > 0
    s = int(ok[0]) if feasible else int(np.argmin(best))  # argmin: the first (cheapest) least-loss state
    choice = []
    for i in range(len(cs) - 1, -1, -1):
        j = int(arg[i, s])
        choice.append(j)
        s -= int(units[i][j])
    choice = tuple(reversed(choice))
    cost = float(sum(c[j] for c, j in zip(cs, choice)))
    loss = float(sum(l[j] for l, j in zip(ls, choice)))
    return Allocation(choice, cost, loss, bool(feasible), "dp")


def model_losses(measured: np.ndarray) -> np.ndarray:
    """The additive model's item losses from measured mean NLL changes: clipped at 0 (module Notes)."""
    m = np.asarray(measured, dtype=np.float64)
    if not np.all(np.isfinite(m)):
        raise ValueError("measured losses must be finite")
    return np.maximum(m, 0.0)


def extrapolate_tq(loss_at: dict, bits, dim: int) -> dict:
    """TurboQuantMSE losses at ``bits`` from measured ones (``{bits: loss}``), by the distortion ratio.

    Bit widths in ``loss_at`` are kept; one above the highest measured width ``b0`` becomes
    ``loss_at[b0] * D(b) / D(b0)`` with ``D`` the exact Lloyd-Max MSE of SphereMarginal(dim) (module
    Notes); one below the lowest measured width is refused (the ratio holds at high rate only).
    """
    from kvq_ref.common import codebook
    from codebooks import SphereMarginal

    if not loss_at:
        raise ValueError("extrapolation needs at least one measured bit width")
    top = max(loss_at)
    out = {}
    for b in bits:
        if b in loss_at:
            out[b] = float(loss_at[b])
        elif b > top:
            out[b] = float(loss_at[top]) * codebook(SphereMarginal(dim), b).mse / codebook(SphereMarginal(dim), top).mse
        else:
            raise ValueError(f"bit width {b} is not measured and not above the highest measured one ({top}): "
                             f"the distortion ratio extrapolates upwards only")
    return out
