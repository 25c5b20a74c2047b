"""Vector-quantizer codebooks for NOVA-KV's gain-shape VQ: k-means, ECVQ, per-group training.

Notes
-----
NOVA-KV (:ref:`ref-nova-kv`) stores a per-token RMS gain and codes the gain-normalized
transform coefficients ("shapes") in groups of ``g = 4`` with one ``2**(2 g) = 256``-centroid
codebook per group, trained by 25 k-means iterations on calibration tokens.

Distortion is the (weighted) mean over vectors of the squared Euclidean error summed over the
``g`` coordinates, ``D = sum_i w_i ||x_i - c_{a_i}||^2 / sum_i w_i``, not per coordinate.

Encoding rule (kernels must match it): the index of ``x`` minimizes
``sum_d (x_d - c_jd)^2`` (+ ``lam * (-log2 p_j)`` for an entropy-constrained codebook), the sum
taken in coordinate order in float64 (not the expanded ``|x|^2 - 2 x.c + |c|^2``, which rounds
differently); ties go to the lower index. With ``lam > 0`` a cluster of probability 0 is never
chosen.

Lloyd iteration, for centroids ``C``, code lengths ``l_j = -log2 p_j`` and assignment ``a``:
``J(a, C, p) = D(a, C) + lam * sum_i w_i l_{a_i} / sum_i w_i`` (``lam = 0``: plain k-means,
``J = D``). One step is: assign (record ``J``), then move every cluster of positive weight to its
weighted mean and set ``p_j`` to its weight fraction. An empty cluster (zero weight) keeps its
previous centroid. The recorded history is non-increasing:

- the assignment step minimizes each point's term for fixed ``(C, p)``, so it cannot increase J;
- the centroid step: the weighted mean minimizes ``sum_{i in cluster} w_i ||x_i - c||^2``, so it
  cannot increase D; an empty cluster contributes nothing to D whatever its centroid, so keeping
  it is consistent with the bound;
- the probability step: ``sum_j q_j (-log2 p_j)`` over distributions ``p`` is minimized by the
  empirical fractions ``p = q`` (Gibbs' inequality), so it cannot increase the rate term.

Hence ``J_{t+1} = J(a_{t+1}, C_{t+1}, p_{t+1}) <= J(a_t, C_{t+1}, p_{t+1}) <= J(a_t, C_t, p_t) = J_t``
in exact arithmetic. In floating point it holds up to rounding: a computed mean is off by
``~eps |c|``, which can raise D by ``~eps^2 |x|^2`` (from 0, say, when every point sits on a centroid),
and the sums add ~N eps D; the means are computed in two passes (sum, then the mean residual) to
keep this small. The loop stops early when an assignment repeats the previous one: the means are
a function of the assignment alone, so the next update would reproduce the same centroids and
probabilities bit for bit, so the remaining steps could not change anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ._validate import check_int, finite_array

__all__ = ["VQCodebook", "kmeans", "ecvq", "kmeans_pp_init", "gain_shape_split", "train_group_codebooks",
           "KMEANS_ITERATIONS", "SEED_STRIDE", "MAX_CODE_BITS"]

#: NOVA-KV's released number of k-means iterations (:ref:`ref-nova-kv`).
KMEANS_ITERATIONS = 25
#: Group ``j``'s codebook in ``train_group_codebooks`` is seeded with ``seed * SEED_STRIDE + j``.
SEED_STRIDE = 100003
#: Largest ``bits_per_coef * g`` (code bits per group) that ``train_group_codebooks`` accepts.
MAX_CODE_BITS = 16


@dataclass(frozen=True, eq=False)
class VQCodebook:
    """A trained vector-quantizer codebook.

    Attributes
    ----------
    centroids : ndarray, shape (K, g), float64
        Read-only.
    distortion : float
        Final weighted mean squared error per vector (see the module notes) on the training data.
    history : tuple of float
        Cost after every assignment, non-increasing: D for k-means, the Lagrangian
        ``D + entropy_lambda * R`` (R in bits per vector) for ECVQ. ``len = iterations + 1``.
    iterations : int
        Lloyd steps performed (fewer than requested if a fixed point was reached).
    seed : int
        Seed of the k-means++ initialization.
    entropy_lambda : float
        Lagrange multiplier of the rate term (0 for plain k-means).
    probs : ndarray, shape (K,), float64
        Weight fraction of the training data in each cluster under the final assignment. Read-only.
    """

    centroids: np.ndarray
    distortion: float
    history: tuple[float, ...]
    iterations: int
    seed: int
    entropy_lambda: float
    probs: np.ndarray

    def __post_init__(self):
        C = _data("centroids", self.centroids)
        probs = finite_array("probs", self.probs)
        if probs.size != C.shape[0] or np.any(probs < 0) or not probs.sum() > 0:
            raise ValueError(f"probs must be {C.shape[0]} values >= 0 (one per centroid) with a positive sum")
        for name, arr in (("centroids", C), ("probs", probs)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "entropy_lambda", _lam("entropy_lambda", self.entropy_lambda))

    @property
    def k(self) -> int:
        """Number of centroids."""
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        """Vector dimension ``g``."""
        return int(self.centroids.shape[1])

    @property
    def entropy(self) -> float:
        """``-sum_j p_j log2 p_j``: bits per vector of an ideal entropy coder for the indices."""
        p = self.probs[self.probs > 0]
        return float(-np.sum(p * np.log2(p))) + 0.0  # + 0.0: no -0.0

    def encode(self, X) -> np.ndarray:
        """Indices of the nearest centroids (the module's encoding rule).

        Parameters
        ----------
        X : array_like, shape (N, g)

        Returns
        -------
        ndarray, shape (N,), int64
        """
        X = _data("X", X, dim=self.dim, min_rows=0)
        idx, _ = _assign(X, self.centroids, _code_lengths(self.probs, self.entropy_lambda), self.entropy_lambda)
        return idx

    def decode(self, idx) -> np.ndarray:
        """Centroids of ``idx``: shape (N, g), float64."""
        arr = np.asarray(idx)
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
            raise TypeError(f"idx must be a 1-D integer array, got dtype {arr.dtype}, shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.k):
            raise ValueError(f"idx must lie in 0..{self.k - 1}, got values in {arr.min()}..{arr.max()}")
        return self.centroids[arr]


# ---------------------------------------------------------------------------------------------
# validation


def _data(name: str, X, dim: int | None = None, min_rows: int = 1) -> np.ndarray:
    X = finite_array(name, X, ndim=2, min_size=0)
    if dim is not None and X.shape[1] != dim:
        raise ValueError(f"{name} must have {dim} columns, got shape {X.shape}")
    if X.shape[0] < min_rows or X.shape[1] < 1:
        raise ValueError(f"{name} must have at least {min_rows} row(s) and 1 column, got shape {X.shape}")
    return np.ascontiguousarray(X)


def _weights(weights, n: int) -> np.ndarray:
    if weights is None:
        return np.ones(n)
    w = finite_array("weights", weights, ndim=1, min_size=0)
    if w.size != n:
        raise ValueError(f"weights must have one entry per row of X ({n}), got {w.size}")
    if np.any(w < 0) or not w.sum() > 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    return w


def _seed(seed) -> int:
    return check_int("seed", seed, 0)


def _lam(name: str, lam) -> float:
    if isinstance(lam, bool) or not isinstance(lam, int | float) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {lam!r}")
    return float(lam)


def _code_lengths(probs: np.ndarray, lam: float) -> np.ndarray:
    """``-log2 p_j`` (+inf where ``p_j = 0``); zeros when ``lam == 0`` (the rate term is unused)."""
    if lam == 0.0:
        return np.zeros(probs.size)
    with np.errstate(divide="ignore"):
        return -np.log2(probs)


# ---------------------------------------------------------------------------------------------
# kernels


@njit(parallel=True, cache=True)
def _assign(X, C, codelen, lam):
    """Best index per row of ``X`` (N, g) among ``C`` (K, g) and its squared distance.

    Cost ``sum_d (x_d - c_jd)^2 + lam * codelen[j]`` (the rate term only if ``lam > 0``), strict
    ``<`` in ascending ``j``: ties go to the lower index. Returns (idx (N,) int64, dist (N,) float64).
    """
    n, g = X.shape
    k = C.shape[0]
    idx = np.zeros(n, dtype=np.int64)
    dist = np.zeros(n)
    for i in prange(n):
        best = np.inf
        bj = 0
        bd = 0.0
        for j in range(k):
            d = 0.0
            for t in range(g):
                r = X[i, t] - C[j, t]
                d += r * r
            cost = d + lam * codelen[j] if lam > 0.0 else d
            if cost < best or j == 0:  # j == 0: defined even if every cost overflows to inf
                best = cost
                bj = j
                bd = d
        idx[i] = bj
        dist[i] = bd
    return idx, dist


@njit(cache=True)
def _lloyd(X, w, C0, iterations, lam):
    """Lloyd / ECVQ iterations from centroids ``C0`` with uniform initial probabilities.

    Returns (centroids (K, g), probs (K,), history (steps + 1,), distortion, steps).
    See the module notes for the step order and the monotonicity argument.
    """
    n, g = X.shape
    k = C0.shape[0]
    C = C0.copy()
    wsum = w.sum()
    probs = np.full(k, 1.0 / k)
    codelen = np.full(k, np.log2(k)) if lam > 0.0 else np.zeros(k)  # -log2 of the uniform start
    hist = np.empty(iterations + 1)
    prev = np.full(n, -1, dtype=np.int64)
    steps = 0
    while True:
        idx, dist = _assign(X, C, codelen, lam)
        dsum = 0.0
        rsum = 0.0
        same = True
        wj = np.zeros(k)
        sj = np.zeros((k, g))
        for i in range(n):
            j = idx[i]
            same = same and j == prev[i]
            dsum += w[i] * dist[i]
            if lam > 0.0 and w[i] > 0.0:
                rsum += w[i] * codelen[j]
            wj[j] += w[i]
            for t in range(g):
                sj[j, t] += w[i] * X[i, t]
        D = dsum / wsum
        hist[steps] = D + lam * (rsum / wsum) if lam > 0.0 else D
        for j in range(k):
            probs[j] = wj[j] / wsum
        if steps == iterations or same:
            return C, probs, hist[:steps + 1], D, steps
        # weighted means in two passes (direct sum, then the mean of the residuals), a function of
        # the assignment alone, so a repeated assignment reproduces the centroids bit for bit
        rj = np.zeros((k, g))
        for i in range(n):
            j = idx[i]
            if w[i] > 0.0:  # then wj[j] >= w[i] > 0
                for t in range(g):
                    rj[j, t] += w[i] * (X[i, t] - sj[j, t] / wj[j])
        for j in range(k):
            if wj[j] > 0.0:  # an empty cluster keeps its centroid
                for t in range(g):
                    C[j, t] = sj[j, t] / wj[j] + rj[j, t] / wj[j]
            if lam > 0.0:
                codelen[j] = -np.log2(probs[j]) if probs[j] > 0.0 else np.inf
        prev[:] = idx
        steps += 1


# ---------------------------------------------------------------------------------------------
# training


def kmeans_pp_init(X, k: int, seed: int = 0, weights=None) -> np.ndarray:
    """k-means++ seeds (Arthur and Vassilvitskii 2007): ``k`` rows of ``X``, shape (k, g).

    Seed 1 is drawn with probability proportional to ``weights``, each next one proportional to
    ``w_i D_i^2`` (``D_i``: distance to the nearest seed so far; if all are 0, to ``weights``
    again, repeating a point), by one ``np.random.default_rng(seed)`` uniform per seed (drawn up
    front) inverted through the cumulative sum: deterministic given ``seed``.
    """
    X = _data("X", X)
    k = check_int("k", k, 1)
    if k > X.shape[0]:
        raise ValueError(f"k={k} centroids need at least {k} rows of X, got {X.shape[0]}")
    w = _weights(weights, X.shape[0])
    u = np.random.default_rng(_seed(seed)).random(k)
    return _kmeans_pp(X, w, u)


@njit(cache=True)
def _draw(p, u):
    """Index i with probability p_i / sum(p): the first i whose cumulative sum exceeds u * total
    (``searchsorted(cumsum(p), u * total, side="right")``), capped at the last positive p_i."""
    total = 0.0
    last = 0
    for i in range(p.shape[0]):
        total += p[i]
        if p[i] > 0.0:
            last = i
    target = u * total
    acc = 0.0
    for i in range(p.shape[0]):
        acc += p[i]
        if acc > target:
            return min(i, last)
    return last


@njit(cache=True)
def _kmeans_pp(X, w, u):
    """k-means++ seeding with the pre-drawn uniforms ``u`` (one per seed)."""
    n, g = X.shape
    k = u.shape[0]
    seeds = np.empty((k, g))
    seeds[0] = X[_draw(w, u[0])]
    d2 = np.empty(n)
    for i in range(n):
        s = 0.0
        for t in range(g):
            r = X[i, t] - seeds[0, t]
            s += r * r
        d2[i] = s
    p = np.empty(n)
    for j in range(1, k):
        total = 0.0
        for i in range(n):
            p[i] = w[i] * d2[i]
            total += p[i]
        seeds[j] = X[_draw(p if total > 0.0 else w, u[j])]
        for i in range(n):
            s = 0.0
            for t in range(g):
                r = X[i, t] - seeds[j, t]
                s += r * r
            if s < d2[i]:
                d2[i] = s
    return seeds


def _train(X, k, lam, iterations, seed, weights) -> VQCodebook:
    X = _data("X", X)
    w = _weights(weights, X.shape[0])
    iterations = check_int("iterations", iterations, 0)
    seed = _seed(seed)
    C0 = kmeans_pp_init(X, k, seed, w)
    C, probs, hist, dist, steps = _lloyd(X, w, C0, iterations, lam)
    return VQCodebook(centroids=C, distortion=float(dist), history=tuple(float(h) for h in hist),
                      iterations=int(steps), seed=seed, entropy_lambda=lam, probs=probs)


def kmeans(X, k: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0, weights=None) -> VQCodebook:
    """Weighted k-means (Lloyd) with k-means++ seeding.

    Parameters
    ----------
    X : array_like, shape (N, g)
        Finite training vectors, ``N >= k``.
    k : int
        Number of centroids, >= 1.
    iterations : int
        Maximum Lloyd steps (>= 0; 0 returns the k-means++ seeds). NOVA-KV uses 25.
    seed : int
        Non-negative seed of the k-means++ draws.
    weights : array_like, shape (N,), optional
        Non-negative point weights with a positive sum (default: all 1).

    Returns
    -------
    VQCodebook
        ``history`` is the distortion after every assignment (non-increasing).
    """
    return _train(X, k, 0.0, iterations, seed, weights)


def ecvq(X, k: int, lam: float, iterations: int = KMEANS_ITERATIONS, seed: int = 0, weights=None) -> VQCodebook:
    """Entropy-constrained VQ (Chou, Lookabaugh and Gray 1989).

    Parameters
    ----------
    X, k, iterations, seed, weights
        As in ``kmeans``.
    lam : float
        Lagrange multiplier >= 0 (squared-error units per bit); ``lam = 0`` equals ``kmeans``.

    Returns
    -------
    VQCodebook
        ``history`` is the Lagrangian ``D + lam * R`` after every assignment (non-increasing), with
        ``R`` the mean code length ``-log2 p`` in bits per vector.

    Notes
    -----
    Assignment minimizes ``||x - c_j||^2 + lam * (-log2 p_j)``; then each centroid moves to its
    cluster's weighted mean and ``p_j`` to its weight fraction. Starting from k-means++ seeds and
    uniform ``p``, clusters whose probability drops to 0 are never chosen again, so larger ``lam``
    trades distortion for fewer effective clusters and lower index entropy.
    """
    return _train(X, k, _lam("lam", lam), iterations, seed, weights)


def gain_shape_split(C) -> tuple[np.ndarray, np.ndarray]:
    """Per-token RMS gain and gain-normalized shape.

    Parameters
    ----------
    C : array_like, shape (N, n)
        Transform coefficients, one token per row; finite.

    Returns
    -------
    gains : ndarray, shape (N,), float64
        ``gamma = sqrt(mean(c^2))`` over the token's ``n`` coefficients.
    shapes : ndarray, shape (N, n), float64
        ``c / gamma`` (RMS 1); rows with ``gamma = 0`` get gain 0 and shape 0.

    Notes
    -----
    ``gamma`` is computed as ``m * sqrt(mean((c / m)^2))`` with ``m = max |c|`` so it neither
    overflows nor underflows. ``gains[:, None] * shapes`` equals ``C`` to within 2 ulp per entry
    (a division and a multiplication by the same number), exactly for zero rows.
    """
    X = _data("C", C, min_rows=0)
    m = np.max(np.abs(X), axis=1) if X.shape[0] else np.zeros(0)
    nz = m > 0
    gains = np.zeros(X.shape[0])
    shapes = np.zeros_like(X)
    scaled = X[nz] / m[nz, None]
    gains[nz] = m[nz] * np.sqrt(np.mean(scaled * scaled, axis=1))
    shapes[nz] = X[nz] / gains[nz, None]
    return gains, shapes


def train_group_codebooks(shapes, grouping_groups, bits_per_coef: int = 2, iterations: int = KMEANS_ITERATIONS,
                          seed: int = 0, *, weights=None) -> tuple[VQCodebook, ...]:
    """One k-means codebook per coefficient group (NOVA-KV's shape codebooks).

    Parameters
    ----------
    shapes : array_like, shape (N, n)
        Gain-normalized calibration coefficients (``gain_shape_split``).
    grouping_groups : array_like of int, shape (n_groups, g), or Grouping
        A partition of ``range(n)`` into groups of ``g`` (``Grouping.groups``).
    bits_per_coef : int
        Bits per coefficient, >= 1; each codebook has ``K = 2**(bits_per_coef * g)`` centroids
        (256 for ``g = 4`` at 2 bits); ``bits_per_coef * g <= MAX_CODE_BITS``.
    iterations : int
        Lloyd steps per codebook (default 25, as NOVA-KV).
    seed : int
        Group ``j`` is seeded with ``seed * SEED_STRIDE + j``.
    weights : array_like, shape (N,), optional
        Per-token weights (for example score weights for values).

    Returns
    -------
    tuple of VQCodebook
        In row order of ``grouping_groups``; codebook ``j`` quantizes ``shapes[:, groups[j]]``.

    Raises
    ------
    ValueError
        If ``N < K`` (too few calibration tokens for the codebook size), or on invalid arguments.
    """
    X = _data("shapes", shapes)
    groups = getattr(grouping_groups, "groups", grouping_groups)
    groups = np.asarray(groups)
    if not np.issubdtype(groups.dtype, np.integer) or groups.ndim != 2:
        raise TypeError(f"grouping_groups must be a 2-D integer array, got dtype {groups.dtype}, "
                        f"shape {groups.shape}")
    n = X.shape[1]
    if groups.size != n or not np.array_equal(np.sort(groups, axis=None), np.arange(n)):
        raise ValueError(f"grouping_groups must partition the {n} columns of shapes (each index exactly once)")
    g = groups.shape[1]
    bits_per_coef = check_int("bits_per_coef", bits_per_coef, 1)
    if bits_per_coef * g > MAX_CODE_BITS:
        raise ValueError(f"bits_per_coef * g = {bits_per_coef * g} code bits per group exceeds {MAX_CODE_BITS}")
    k = 2 ** (bits_per_coef * g)
    if X.shape[0] < k:
        raise ValueError(f"too few calibration tokens: {X.shape[0]} rows of shapes for codebooks of "
                         f"K = 2**({bits_per_coef}*{g}) = {k} centroids (need N >= K)")
    seed = _seed(seed)
    w = _weights(weights, X.shape[0])
    return tuple(kmeans(np.ascontiguousarray(X[:, row]), k, iterations, seed * SEED_STRIDE + j, w)
                 for j, row in enumerate(groups))
