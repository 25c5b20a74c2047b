"""Equal-volume grouping of transform coefficients for fixed-size vector quantizers.

Notes
-----
:ref:`ref-nova-kv` (derived): coefficients with variances ``lambda_i`` split into groups
``G_j`` of ``g`` coefficients, each coded by a fixed-rate g-dimensional quantizer at the same bits
per coefficient, have high-rate distortion ``sum_j D_j`` with ``D_j`` proportional to the group's
geometric mean ``GM_j = exp(v_j)``, ``v_j = (1/g) sum_{i in G_j} log lambda_i`` (its log volume).
The mean of the ``v_j`` is the same for every partition, ``mu = (1/n) sum_i log lambda_i``, so
minimizing the arithmetic mean of the ``GM_j`` minimizes the excess over the variable-rate
(reverse water-filling) optimum,

    gap = mean_j exp(v_j) / exp(mu) - 1  >= 0,

which is zero iff every group has the same product of variances (AM-GM;
``theory.waterfill.grouping_gap``). Finding such a partition is balanced number partitioning of
``log lambda`` (NP-hard), so this module offers heuristics:

- ``consecutive``: ``[0, g), [g, 2g), ...`` (the baseline),
- ``round_robin``: NOVA-KV's released heuristic; rank ``r`` (variance descending) goes to group
  ``r mod (n/g)``,
- ``greedy``: largest first; each coefficient, in descending log-variance order, joins the
  not-yet-full group with the smallest current sum of log variances,
- ``swap``: greedy followed by ``refine_groups`` (steepest-descent pairwise swaps).

Sorting ties (equal variances) go to the lower coefficient index; group ties to the lower group
index. The results are deterministic. Every ``Grouping`` is canonical: rows sorted ascending and
rows ordered by their smallest index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from ._validate import check_int, finite_array

__all__ = ["Grouping", "consecutive_groups", "round_robin_groups", "greedy_groups", "refine_groups",
           "equal_volume_groups", "METHODS", "SWAP_RTOL"]

#: Names accepted by ``equal_volume_groups``.
METHODS = ("consecutive", "round_robin", "greedy", "swap")
#: A swap is applied only if it lowers ``sum_j exp(v_j)`` by more than this fraction of it.
SWAP_RTOL = 1e-15


@dataclass(frozen=True, eq=False)
class Grouping:
    """A partition of ``n`` coefficients into ``n / g`` groups of ``g``.

    Attributes
    ----------
    groups : ndarray, shape (n_groups, g), int64
        Coefficient indices; each row sorted ascending, rows ordered by their smallest index.
        Read-only.
    method : str
        Heuristic that produced it (``"greedy+swap"`` after refinement of a greedy start).
    gap : float
        ``theory.waterfill.grouping_gap``: the high-rate excess over the variable-rate optimum.
    log_volumes : ndarray, shape (n_groups,), float64
        Per-group mean log variance ``v_j`` (row order of ``groups``). Read-only.
    history : tuple of float
        For refined groupings, the gap before refinement and after every applied swap
        (non-increasing up to rounding); empty for the constructive heuristics.
    """

    groups: np.ndarray
    method: str
    gap: float
    log_volumes: np.ndarray
    history: tuple[float, ...] = ()

    @property
    def g(self) -> int:
        """Coefficients per group."""
        return int(self.groups.shape[1])

    @property
    def n_groups(self) -> int:
        """Number of groups."""
        return int(self.groups.shape[0])

    def labels(self) -> np.ndarray:
        """Group index of every coefficient: int64, shape (n,)."""
        out = np.empty(self.groups.size, dtype=np.int64)
        out[self.groups] = np.arange(self.n_groups)[:, None]
        return out


# ---------------------------------------------------------------------------------------------
# validation and construction


def _check(variances, g) -> tuple[np.ndarray, int]:
    lam = finite_array("variances", variances, ndim=1)
    if np.any(lam <= 0):
        raise ValueError(f"variances must be > 0, found {int(np.count_nonzero(lam <= 0))} value(s) <= 0")
    g = check_int("g", g, 1)
    if lam.size % g:
        raise ValueError(f"the number of variances ({lam.size}) must be divisible by g={g}")
    return lam, g


def _make(lam: np.ndarray, groups: np.ndarray, method: str, history=()) -> Grouping:
    """Canonicalize ``groups`` and score it (the gap of the module Notes, as theory.grouping_gap computes
    it; codebooks may not import theory, and tests/codebooks/test_grouping.py checks the two agree)."""
    groups = np.sort(np.asarray(groups, dtype=np.int64), axis=1)
    groups = groups[np.argsort(groups[:, 0], kind="stable")]
    groups.setflags(write=False)
    v = np.log(lam)[groups].mean(axis=1)
    v.setflags(write=False)
    shift = v.max()  # AM/GM of exp(v), evaluated stably
    gap = float(max(np.mean(np.exp(v - shift)) / math.exp(np.mean(v) - shift) - 1.0, 0.0))
    return Grouping(groups=groups, method=method, gap=gap, log_volumes=v,
                    history=tuple(float(h) for h in history))


def _rank(lam: np.ndarray) -> np.ndarray:
    """Indices by variance descending; equal variances in ascending index order."""
    return np.argsort(-lam, kind="stable")


def consecutive_groups(variances, g) -> Grouping:
    """Baseline grouping ``[0, g), [g, 2g), ...``.

    Parameters
    ----------
    variances : array_like, shape (n,)
        Positive finite coefficient variances; ``n`` divisible by ``g``.
    g : int
        Coefficients per group, >= 1.

    Returns
    -------
    Grouping
    """
    lam, g = _check(variances, g)
    return _make(lam, np.arange(lam.size).reshape(-1, g), "consecutive")


def round_robin_groups(variances, g) -> Grouping:
    """NOVA-KV's stratified round-robin: rank ``r`` (variance descending) joins group ``r mod (n/g)``.

    Parameters and Returns as in ``consecutive_groups``.

    Notes
    -----
    Group ``j`` receives ranks ``j, j + m, j + 2m, ...`` (``m = n/g``): one coefficient from each
    stratum of ``m`` consecutive ranks, always the ``j``-th largest of it, so group 0 has the
    largest volume. It can be worse than ``consecutive_groups`` on a given instance (for example
    ``[8, 1, 4, 2]`` with ``g = 2``, where the consecutive pairs have equal products).
    """
    lam, g = _check(variances, g)
    m = lam.size // g
    return _make(lam, _rank(lam).reshape(g, m).T, "round_robin")


@njit(cache=True)
def _greedy(x, order, g):
    """Largest first: ``x[order[t]]`` joins the open group with the smallest sum (ties: lower index).

    ``x`` (n,) float64 >= 0, ``order`` (n,) int64; returns groups (n // g, g) int64.
    """
    n = x.shape[0]
    m = n // g
    groups = np.empty((m, g), dtype=np.int64)
    count = np.zeros(m, dtype=np.int64)
    total = np.zeros(m)
    for t in range(n):
        i = order[t]
        best = -1
        for j in range(m):
            if count[j] < g and (best < 0 or total[j] < total[best]):
                best = j
        groups[best, count[best]] = i
        count[best] += 1
        total[best] += x[i]
    return groups


def greedy_groups(variances, g) -> Grouping:
    """Largest-first greedy on log variance.

    Parameters and Returns as in ``consecutive_groups``.

    Notes
    -----
    Coefficients are taken in descending log-variance order; each joins the not-yet-full group
    with the smallest current sum ``sum_{i in G_j} (log lambda_i - min_k log lambda_k)`` (ties: the
    lower group index). The sums are taken relative to the smallest log variance so that every
    item is >= 0 and the result does not depend on the variances' scale: with raw logs, variances
    below 1 would have negative logs and a started group would look lighter than an empty one, so
    the largest coefficients would pile into group 0. Every group ends with ``g`` items, so the
    shift does not change the objective. For ``g = 2`` the result pairs the ``k``-th largest with
    the ``k``-th smallest coefficient, which is optimal (the sums ``v_j`` are then majorized by
    those of any other pairing, and ``exp`` is convex).
    """
    lam, g = _check(variances, g)
    logv = np.log(lam)
    return _make(lam, _greedy(logv - logv.min(), _rank(lam).astype(np.int64), g), "greedy")


# ---------------------------------------------------------------------------------------------
# swap refinement


@njit(cache=True)
def _gap_from_terms(e, shift, mu):
    """``mean_j exp(v_j) / exp(mu) - 1`` from ``e_j = exp(v_j - shift)``."""
    return np.expm1(np.log(e.mean()) + shift - mu)


@njit(cache=True)
def _swap_refine(logv, groups, max_passes, rtol):
    """Steepest-descent swaps; returns (groups (m, g) int64, gap history (passes + 1,) float64).

    Terms ``e_j = exp(v_j - max log lambda)`` are <= 1 (no overflow). Swapping ``a`` in group p
    with ``b`` in group q shifts ``v_p`` by ``d = (log lambda_b - log lambda_a) / g`` and ``v_q``
    by ``-d``; the change ``e_p expm1(d) + e_q expm1(-d)`` is evaluated without cancellation
    against ``e``. Each pass scans all pairs in different groups (first best in scan order wins)
    and applies the best swap if it lowers ``sum_j e_j`` by more than ``rtol`` of it. The two
    touched groups' sums are recomputed from their members, so no rounding drift accumulates.
    """
    m, g = groups.shape
    grp = groups.copy()
    shift = logv.max()
    mu = logv.mean()
    e = np.empty(m)
    for j in range(m):
        s = 0.0
        for t in range(g):
            s += logv[grp[j, t]]
        e[j] = np.exp(s / g - shift)
    hist = np.empty(max_passes + 1)
    hist[0] = _gap_from_terms(e, shift, mu)
    used = 1
    for _ in range(max_passes):
        best = -rtol * e.sum()
        bp = -1
        ba = 0
        bq = 0
        bb = 0
        for p in range(m - 1):
            for a in range(g):
                la = logv[grp[p, a]]
                for q in range(p + 1, m):
                    for b in range(g):
                        d = (logv[grp[q, b]] - la) / g
                        if d != 0.0:
                            delta = e[p] * np.expm1(d) + e[q] * np.expm1(-d)
                            if delta < best:
                                best = delta
                                bp, ba, bq, bb = p, a, q, b
        if bp < 0:
            break
        tmp = grp[bp, ba]
        grp[bp, ba] = grp[bq, bb]
        grp[bq, bb] = tmp
        for j in (bp, bq):
            s = 0.0
            for t in range(g):
                s += logv[grp[j, t]]
            e[j] = np.exp(s / g - shift)
        hist[used] = _gap_from_terms(e, shift, mu)
        used += 1
    return grp, hist[:used]


def refine_groups(variances, grouping: Grouping, max_passes: int = 100) -> Grouping:
    """Improve ``grouping`` by pairwise swaps of coefficients between groups.

    Parameters
    ----------
    variances : array_like, shape (n,)
        The positive finite variances ``grouping`` was built for.
    grouping : Grouping
        Starting partition of ``range(n)``.
    max_passes : int
        At most this many swaps (>= 0); each pass scans all O(n^2) pairs once.

    Returns
    -------
    Grouping
        Method ``"<old method>+swap"``; ``history`` holds the gap before the first and after every
        applied swap.

    Notes
    -----
    Objective: ``sum_j exp(v_j)``, ``n_groups`` times the arithmetic mean of the group geometric
    means, a fixed multiple of ``1 + gap``. Each pass applies the best improving swap (steepest
    descent) if it lowers the objective by more than ``SWAP_RTOL`` relative; the loop stops at
    the first pass without one (a swap-local optimum) or after ``max_passes``. Since only
    strictly improving swaps are applied, the gap never increases (up to the rounding of its
    evaluation, ~1e-15 relative to ``1 + gap``) and no partition is visited twice.
    """
    if not isinstance(grouping, Grouping):
        raise TypeError(f"grouping must be a Grouping, got {type(grouping).__name__}")
    lam, g = _check(variances, grouping.g)
    if grouping.groups.size != lam.size or not np.array_equal(np.sort(grouping.groups, axis=None),
                                                              np.arange(lam.size)):
        raise ValueError(f"grouping must partition the {lam.size} coefficients of variances "
                         f"(it has {grouping.groups.size} indices)")
    max_passes = check_int("max_passes", max_passes, 0)
    groups, hist = _swap_refine(np.log(lam), np.ascontiguousarray(grouping.groups, dtype=np.int64),
                                max_passes, SWAP_RTOL)
    return _make(lam, groups, grouping.method + "+swap", hist)


def equal_volume_groups(variances, g, method: str = "swap") -> Grouping:
    """Group coefficients toward equal volumes with the named heuristic.

    Parameters
    ----------
    variances : array_like, shape (n,)
        Positive finite coefficient variances; ``n`` divisible by ``g``.
    g : int
        Coefficients per group, >= 1.
    method : {"consecutive", "round_robin", "greedy", "swap"}
        ``"swap"`` refines the greedy, round-robin and consecutive partitions with ``refine_groups``
        and keeps the best (ties: that order). Refinement never increases a gap, so ``"swap"`` is
        never worse than consecutive groups or either heuristic; single swaps can stall where a
        2-for-2 exchange is needed (the problem is NP-hard), which the multiple starts soften.

    Returns
    -------
    Grouping
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method == "consecutive":
        return consecutive_groups(variances, g)
    if method == "round_robin":
        return round_robin_groups(variances, g)
    if method == "greedy":
        return greedy_groups(variances, g)
    if method == "swap":
        starts = (greedy_groups(variances, g), round_robin_groups(variances, g), consecutive_groups(variances, g))
        refined = [refine_groups(variances, start) for start in starts]
        return min(refined, key=lambda r: r.gap)  # min keeps the first of equal gaps
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
