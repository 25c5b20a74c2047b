"""Calibration statistics: exact merging, accurate moments, attention weights, storage, errors."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from codebooks import TableFileError
from codebooks.calibration import CalibrationStats, Moments, attention_weights
from tests.nova_data import generator, sequence

D = 16


@pytest.fixture(scope="module")
def seqs():
    gen = generator(D, seed=3)
    return [sequence(gen, 4, 2, 200, s) for s in range(4)]


def _one_pass(seqs):
    st = CalibrationStats(D)
    for s in seqs:
        st.update(0, *s[0])
    return st


def _arrays(st):
    h = st.head(0, 1)
    return [h.qq, h.keys.mean, h.keys.m2, h.values_s2.mean, h.values_s2.m2, h.values_s1.m2,
            np.array([h.n_queries, h.keys.weight, h.values_s2.weight, h.values_s1.weight])]


def test_merge_of_shards_equals_one_pass(seqs):
    whole = _one_pass(seqs)
    shards = [_one_pass(seqs[:1]), _one_pass(seqs[1:3]), _one_pass(seqs[3:])]
    merged = shards[0].merge(shards[1]).merge(shards[2])
    for a, b in zip(_arrays(whole), _arrays(merged)):
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(a).max())


def test_moments_are_accurate_with_large_offsets():
    """Chan's update keeps the covariance exact where E[xx^T] - mu mu^T would cancel."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, 4)) * 1e-3 + 1e5
    m = Moments(4)
    for chunk in np.array_split(x, 7):
        m.add(chunk)
    ref = np.cov(x.T, bias=True)
    assert np.allclose(m.cov, ref, rtol=1e-9)
    assert np.allclose(m.mean, x.mean(axis=0), rtol=1e-15)
    w = rng.uniform(0, 1, 5000)
    mw = Moments(4)
    mw.add(x, w)
    assert np.allclose(mw.cov, np.cov(x.T, aweights=w, bias=True), rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 9, 512])
def test_attention_weights_match_a_direct_softmax(causal, chunk):
    """Chunks that split T unevenly, one chunk, and per-query chunks all give the direct softmax's
    sums. Tolerance: the sums are at most 18 (2 heads x 9 queries), where one float64 ulp is 3.6e-15, so
    1e-14 absolute allows the few ulps a different summation order (chunked, BLAS) can move them."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 9, 4)), rng.standard_normal((9, 4))
    s1, s2, count = attention_weights(q, k, 0.5, causal=causal, chunk=chunk)
    p = np.zeros((2, 9, 9))
    for h in range(2):
        for i in range(9):
            n = i + 1 if causal else 9
            z = k[:n] @ q[h, i] * 0.5
            e = np.exp(z - z.max())
            p[h, i, :n] = e / e.sum()
    assert np.allclose(s1, p.sum(axis=(0, 1)), atol=1e-14, rtol=0)
    assert np.allclose(s2, (p**2).sum(axis=(0, 1)), atol=1e-14, rtol=0)
    assert list(count) == ([2 * (9 - t) for t in range(9)] if causal else [18] * 9)


def test_gqa_pooling_and_weights(seqs):
    st = _one_pass(seqs[:1])
    q, k, v = seqs[0][0]
    h1 = st.head(0, 1)
    pooled = q[2:4].reshape(-1, D)  # query heads 2, 3 belong to KV head 1
    assert np.allclose(h1.sigma_q, pooled.T @ pooled / pooled.shape[0], rtol=1e-13)
    assert h1.keys.weight == 200
    assert np.allclose(h1.keys.mean, k[1].mean(axis=0), rtol=1e-13)
    # each token's weight E[s_t^2] averages over the queries that see it; weights sum <= tokens
    assert 0 < h1.values_s2.weight <= h1.values_s1.weight <= 200


def test_save_load_round_trip_and_corruption(seqs, tmp_path):
    st = _one_pass(seqs)
    st.save(tmp_path / "c")
    back = CalibrationStats.load(tmp_path / "c")
    for a, b in zip(_arrays(st), _arrays(back)):
        assert np.array_equal(a, b)
    raw = (tmp_path / "c" / "tables.safetensors").read_bytes()
    bad = bytearray(raw)
    bad[len(raw) // 2] ^= 0x10
    (tmp_path / "c" / "tables.safetensors").write_bytes(bytes(bad))
    with pytest.raises(TableFileError, match="tables.safetensors"):
        CalibrationStats.load(tmp_path / "c")
    shutil.rmtree(tmp_path / "c")
    st.save(tmp_path / "c")
    with pytest.raises(TableFileError, match="holds 'calibration' artifacts, expected 'codebooks'"):
        from codebooks import load_tables

        load_tables(tmp_path / "c")


def test_bad_input():
    st = CalibrationStats(D)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((4, 10, D)), rng.standard_normal((2, 10, D))
    with pytest.raises(ValueError, match="must share T and d"):
        st.update(0, q[:, :9], k, k)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        st.update(0, q[:3], k, k)
    with pytest.raises(ValueError, match="q must be"):
        st.update(0, q[0], k, k)
    bad = k.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        st.update(0, q, bad, k)
    st.update(0, q, k, k)
    with pytest.raises(ValueError, match="calibration saw 10 key tokens for this head; the transforms of "
                                         "dimension 16 need at least 17"):
        st.head(0, 0).check()
    st.head(0, 0).qq[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        st.head(0, 0).check(min_tokens=1)
    with pytest.raises(KeyError, match="no statistics for layer 3"):
        st.head(3, 0)
    with pytest.raises(ValueError, match="d must be an integer >= 2"):
        CalibrationStats(1)
