"""VQ codebooks: Lloyd monotonicity, seeding, ECVQ, gain-shape split, per-group training, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from codebooks.grouping import greedy_groups
from codebooks.vq import (SEED_STRIDE, VQCodebook, ecvq, gain_shape_split, kmeans, kmeans_pp_init,
                          train_group_codebooks)

EPS = np.finfo(np.float64).eps


@st.composite
def datasets(draw):
    """(X (N, g), k, seed, weights or None); sometimes with repeated rows and zero weights."""
    g = draw(st.integers(1, 4))
    k = draw(st.integers(1, 16))
    n = draw(st.integers(k, 200))
    rs = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(rs)
    X = rng.standard_t(3, (n, g))
    if draw(st.booleans()):  # duplicates: fewer distinct points than rows (possibly than k)
        X = X[rng.integers(0, max(1, n // 3), n)]
    weights = None
    if draw(st.booleans()):
        weights = rng.exponential(1.0, n) * (rng.random(n) > 0.2)
        weights[0] = 1.0
    return X, k, draw(st.integers(0, 2**31)), weights


def _mse(cb, X, weights=None):
    err = np.sum((cb.decode(cb.encode(X)) - X) ** 2, axis=1)
    return float(np.average(err, weights=weights))


@given(datasets())
def test_kmeans_history_never_increases(data):
    X, k, seed, weights = data
    cb = kmeans(X, k, iterations=30, seed=seed, weights=weights)
    h = np.array(cb.history)
    assert h.size == cb.iterations + 1 and cb.iterations <= 30
    # non-increasing up to rounding: ~1e-16 relative, plus ~eps^2 |x|^2 when D is ~0
    assert np.all(np.diff(h) <= 1e-12 * h[:-1] + 1e-24 * np.mean(X**2) * X.shape[1])
    assert cb.distortion == h[-1]
    assert cb.centroids.shape == (k, X.shape[1]) and np.all(np.isfinite(cb.centroids))
    assert cb.distortion == pytest.approx(_mse(cb, X, weights), rel=1e-12, abs=1e-15)
    assert np.sum(cb.probs) == pytest.approx(1.0, rel=1e-12) and cb.entropy_lambda == 0.0
    # more iterations never hurt: a run is a prefix of a longer one
    short = kmeans(X, k, iterations=3, seed=seed, weights=weights)
    assert short.history == cb.history[:len(short.history)]


def test_kmeans_is_deterministic_given_the_seed():
    X = np.random.default_rng(1).normal(size=(500, 4))
    a, b = kmeans(X, 32, seed=5), kmeans(X, 32, seed=5)
    assert np.array_equal(a.centroids, b.centroids) and a.history == b.history and a.seed == 5
    assert not np.array_equal(a.centroids, kmeans(X, 32, seed=6).centroids)


def test_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(2)
    centers = np.array([[0.0, 0.0, 0.0], [50.0, 0.0, 0.0], [0.0, 50.0, 0.0], [0.0, 0.0, 50.0], [50.0, 50.0, 50.0]])
    labels = rng.integers(0, 5, 1000)
    X = centers[labels] + rng.normal(0.0, 0.5, (1000, 3))
    for seed in range(5):
        cb = kmeans(X, 5, seed=seed)
        match = np.argmin(np.sum((cb.centroids[:, None] - centers[None]) ** 2, axis=2), axis=1)
        assert sorted(match) == list(range(5))  # one centroid per true cluster
        assert np.max(np.abs(cb.centroids - centers[match])) < 0.2
        idx = cb.encode(X)
        assert np.array_equal(match[idx], labels)
        assert cb.distortion == pytest.approx(3 * 0.25, rel=0.15)


@given(datasets())
def test_kmeans_pp_seeds_are_data_points(data):
    X, k, seed, weights = data
    seeds = kmeans_pp_init(X, k, seed, weights)
    w = np.ones(len(X)) if weights is None else weights
    for s in seeds:
        hit = np.all(X == s, axis=1)
        assert hit.any() and np.any(w[hit] > 0)  # a row of X that carries weight
    assert np.array_equal(kmeans(X, k, iterations=0, seed=seed, weights=weights).centroids, seeds)
    assert np.array_equal(seeds, kmeans_pp_init(X, k, seed, weights))


def test_kmeans_pp_picks_distinct_points_while_it_can():
    X = np.random.default_rng(3).normal(size=(12, 2))
    seeds = kmeans_pp_init(X, 12, seed=4)
    assert sorted(map(tuple, seeds)) == sorted(map(tuple, X))  # D^2 sampling never repeats a seed
    cb = kmeans(X, 12, seed=4)
    assert cb.distortion == 0.0
    # 3 distinct points, 5 seeds: the rest repeat points
    Y = np.repeat(X[:3], 4, axis=0)
    assert len({tuple(s) for s in kmeans_pp_init(Y, 5, seed=0)}) == 3


@given(datasets())
def test_ecvq_with_zero_lambda_is_kmeans(data):
    X, k, seed, weights = data
    a, b = ecvq(X, k, 0.0, seed=seed, weights=weights), kmeans(X, k, seed=seed, weights=weights)
    assert np.array_equal(a.centroids, b.centroids) and np.array_equal(a.probs, b.probs)
    assert a.history == b.history and a.distortion == b.distortion


@given(datasets(), st.floats(0.01, 10.0))
def test_ecvq_lagrangian_never_increases(data, lam):
    X, k, seed, weights = data
    cb = ecvq(X, k, lam, iterations=30, seed=seed, weights=weights)
    h = np.array(cb.history)
    assert np.all(np.isfinite(h)) and np.all(np.diff(h) <= 1e-12 * h[:-1] + 1e-24 * np.mean(X**2) * X.shape[1])
    assert cb.entropy_lambda == lam and cb.distortion <= h[-1] + 1e-12 * h[-1]
    idx = cb.encode(X)
    assert np.all(cb.probs[idx] > 0)  # clusters of probability 0 are never chosen


def test_ecvq_larger_lambda_lowers_entropy():
    X = np.random.default_rng(4).normal(size=(4000, 2))
    runs = [ecvq(X, 16, lam, seed=1) for lam in (0.0, 0.3, 1.0, 3.0)]
    H = [r.entropy for r in runs]
    D = [r.distortion for r in runs]
    assert all(h1 > h2 for h1, h2 in zip(H, H[1:])), H
    assert all(d1 < d2 for d1, d2 in zip(D, D[1:])), D
    assert runs[0].entropy > 3.8 and runs[-1].entropy < 0.5


def test_tie_rule_lower_index():
    x = np.zeros((1, 2))
    for C in ([[1.0, 0.0], [-1.0, 0.0]], [[-1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]):
        cb = VQCodebook(np.array(C), 0.0, (0.0,), 0, 0, 0.0, np.array([0.5, 0.5]))
        assert cb.encode(x).tolist() == [0]
    # equal Lagrangian costs at x = 0: 1 + 1 bit == 0 + 2 bits -> index 0; lambda pulls toward likely cells
    cb = VQCodebook(np.array([[1.0], [0.0]]), 0.0, (0.0,), 0, 0, 1.0, np.array([0.5, 0.25]))
    assert cb.encode(np.zeros((1, 1))).tolist() == [0]
    assert cb.encode(np.array([[0.2], [-0.3]])).tolist() == [0, 1]  # 0.2 is nearer to 0.0, but 1 bit cheaper
    # a cluster of probability 0 is never chosen when lambda > 0
    cb = VQCodebook(np.array([[0.0], [5.0]]), 0.0, (0.0,), 0, 0, 0.5, np.array([0.0, 1.0]))
    assert cb.encode(np.array([[0.0]])).tolist() == [1]


def test_encode_decode_round_trip():
    X = np.random.default_rng(5).normal(size=(300, 4))
    cb = kmeans(X, 64, seed=0)
    assert np.array_equal(cb.encode(cb.centroids), np.arange(64))
    idx = np.random.default_rng(6).integers(0, 64, 50)
    out = cb.decode(idx)
    assert out.shape == (50, 4) and out.dtype == np.float64
    assert np.array_equal(cb.encode(out), idx)
    assert cb.encode(np.empty((0, 4))).shape == (0,) and cb.encode(X).dtype == np.int64
    assert not cb.centroids.flags.writeable and not cb.probs.flags.writeable


@given(st.integers(0, 40), st.integers(1, 64), st.integers(0, 2**32 - 1), st.sampled_from([1e-300, 1.0, 1e300]))
def test_gain_shape_split_reconstructs(n_tok, n, seed, scale):
    rng = np.random.default_rng(seed)
    C = rng.normal(size=(n_tok, n)) * scale
    if n_tok:
        C[rng.random(n_tok) < 0.2] = 0.0
    gains, shapes = gain_shape_split(C)
    assert gains.shape == (n_tok,) and shapes.shape == (n_tok, n)
    assert np.all(np.isfinite(gains)) and np.all(np.isfinite(shapes)) and np.all(gains >= 0)
    assert np.all(np.abs(gains[:, None] * shapes - C) <= 2 * EPS * np.abs(C))
    nz = gains > 0
    assert np.allclose(np.sqrt(np.mean(shapes[nz] ** 2, axis=1)), 1.0, rtol=1e-14)
    assert np.array_equal(nz, np.any(C != 0, axis=1))
    assert np.all(shapes[~nz] == 0.0)


def test_gain_shape_split_examples():
    gains, shapes = gain_shape_split(np.array([[3.0, -4.0], [0.0, 0.0], [1.0, 1.0]]))
    assert gains.tolist() == [np.sqrt(12.5), 0.0, 1.0]
    assert shapes[1].tolist() == [0.0, 0.0] and shapes[2].tolist() == [1.0, 1.0]


def test_train_group_codebooks():
    rng = np.random.default_rng(7)
    C = rng.normal(size=(400, 16)) * np.sqrt(np.arange(16, 0, -1))
    gains, shapes = gain_shape_split(C)
    grouping = greedy_groups(np.var(shapes, axis=0), 4)
    cbs = train_group_codebooks(shapes, grouping.groups, bits_per_coef=2, iterations=2, seed=3)
    assert len(cbs) == 4 and all(cb.centroids.shape == (256, 4) for cb in cbs)
    assert [cb.seed for cb in cbs] == [3 * SEED_STRIDE + j for j in range(4)]
    assert all(cb.iterations <= 2 for cb in cbs)
    # codebook j is plain k-means on the group's columns
    j = 2
    ref = kmeans(shapes[:, grouping.groups[j]], 256, iterations=2, seed=3 * SEED_STRIDE + j)
    assert np.array_equal(cbs[j].centroids, ref.centroids)
    # a Grouping is accepted directly; 1 bit per coefficient at g = 4 -> 16 centroids
    cbs1 = train_group_codebooks(shapes, grouping, bits_per_coef=1, iterations=5)
    assert all(cb.k == 16 for cb in cbs1)
    wts = rng.random(400)
    cbw = train_group_codebooks(shapes, grouping, bits_per_coef=1, iterations=5, weights=wts)
    assert np.array_equal(cbw[0].centroids, kmeans(shapes[:, grouping.groups[0]], 16, 5, 0, wts).centroids)


def test_train_group_codebooks_needs_enough_tokens():
    shapes = np.random.default_rng(8).normal(size=(255, 8))
    groups = np.arange(8).reshape(2, 4)
    with pytest.raises(ValueError, match=r"255 rows of shapes .* K = 2\*\*\(2\*4\) = 256 centroids"):
        train_group_codebooks(shapes, groups)
    assert len(train_group_codebooks(shapes[:16], groups, bits_per_coef=1, iterations=1)) == 2


def test_bad_inputs():
    X = np.random.default_rng(9).normal(size=(20, 2))
    with pytest.raises(ValueError, match="k=21 centroids need at least 21 rows"):
        kmeans(X, 21)
    with pytest.raises(ValueError, match="k must be >= 1"):
        kmeans(X, 0)
    with pytest.raises(ValueError, match="X must be 2-D"):
        kmeans(X[:, 0], 2)
    with pytest.raises(ValueError, match="X must be finite"):
        kmeans(np.where(X > 1, np.nan, X), 2)
    with pytest.raises(ValueError, match="iterations must be >= 0"):
        kmeans(X, 2, iterations=-1)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        kmeans(X, 2, seed=-1)
    with pytest.raises(ValueError, match="weights must have one entry per row of X"):
        kmeans(X, 2, weights=np.ones(3))
    with pytest.raises(ValueError, match="weights must be >= 0 with a positive sum"):
        kmeans(X, 2, weights=-np.ones(20))
    with pytest.raises(ValueError, match="weights must be >= 0 with a positive sum"):
        kmeans(X, 2, weights=np.zeros(20))
    with pytest.raises(ValueError, match="lam must be a finite number >= 0"):
        ecvq(X, 2, -1.0)
    cb = kmeans(X, 4)
    with pytest.raises(ValueError, match="X must have 2 columns"):
        cb.encode(np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"idx must lie in 0\.\.3"):
        cb.decode(np.array([0, 4]))
    with pytest.raises(TypeError, match="idx must be a 1-D integer array"):
        cb.decode(np.array([0.0]))
    with pytest.raises(ValueError, match="C must be 2-D"):
        gain_shape_split(np.ones(4))
    with pytest.raises(ValueError, match="grouping_groups must partition the 2 columns"):
        train_group_codebooks(X, np.array([[0, 0]]))
    with pytest.raises(TypeError, match="grouping_groups must be a 2-D integer array"):
        train_group_codebooks(X, np.array([0, 1]))
    with pytest.raises(ValueError, match="exceeds 16"):
        train_group_codebooks(X, np.array([[0, 1]]), bits_per_coef=9)
    with pytest.raises(ValueError, match="bits_per_coef must be >= 1"):
        train_group_codebooks(X, np.array([[0, 1]]), bits_per_coef=0)
