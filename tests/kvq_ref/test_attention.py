"""Attention over a quantized cache: the band, the hooks, the metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvq_ref.attention import (QuantizedKV, attention_decode, attention_prefill, exact_attention, logit_mse,
                               relative_error, topk_agreement)
from kvq_ref.turboquant import TurboQuantMSE, TurboQuantProd


def _kv(n, d, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((3, 4, d))


def test_exact_attention_against_a_direct_loop():
    K, V, Q = _kv(9, 8)
    out = exact_attention(Q, K, V)
    for h in range(3):
        for i in range(4):
            pos = 9 - 4 + i
            z = K[: pos + 1] @ Q[h, i] / math.sqrt(8)
            p = np.exp(z - z.max())
            assert np.allclose(out[h, i], (p / p.sum()) @ V[: pos + 1], atol=1e-14)


def test_fp16_cache_matches_exact_to_fp16_precision():
    K, V, Q = _kv(120, 64)
    cache = QuantizedKV.build(K, V, None, None, sink=8, window=16)
    assert cache.bits_per_element() == {"keys": 16.0, "values": 16.0, "total": 16.0}
    # float16 keeps 11 significant bits: relative error of the output ~ 2^-11
    assert relative_error(attention_prefill(Q, cache), exact_attention(Q, K, V)) < 2e-3


def test_band_tokens_are_exact_and_middle_uses_the_method():
    K, V, Q = _kv(200, 64, seed=1)
    m = TurboQuantMSE(64, 2)
    cache = QuantizedKV.build(K, V, m, m, sink=5, window=20)
    Kh, Vh = cache.dequantized()
    band = np.r_[0:5, 180:200]
    assert np.array_equal(Kh[band], K[band].astype(np.float16).astype(np.float64))
    assert np.allclose(Kh[5:180], m.decode(m.encode(K[5:180])), atol=0)
    # logits go through the method's rotated-query scores and equal q . k_hat
    q = Q[0]
    assert np.allclose(cache.logits(q), q @ Kh.T, atol=1e-4)
    # attention over the cache equals exact attention over the dequantized tensors
    assert np.allclose(attention_prefill(Q, cache), exact_attention(Q, Kh, Vh), atol=1e-5)
    bits = cache.bits_per_element()
    assert bits["keys"] == pytest.approx((25 * 64 * 16 + 175 * (64 * 2 + 16)) / (200 * 64))


def test_decode_step_is_the_last_prefill_row():
    K, V, Q = _kv(64, 32, seed=2)
    m = TurboQuantMSE(32, 3)
    cache = QuantizedKV.build(K, V, m, m, sink=4, window=4)
    assert np.allclose(attention_decode(Q[:, -1], cache), attention_prefill(Q, cache)[:, -1], atol=1e-12)


def test_more_bits_less_error_and_estimator_scores():
    K, V, Q = _kv(256, 64, seed=3)
    ref = exact_attention(Q, K, V)
    errs = [relative_error(attention_prefill(Q, QuantizedKV.build(K, V, TurboQuantMSE(64, b), TurboQuantMSE(64, b))),
                           ref) for b in (1, 2, 3, 4)]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    prod = TurboQuantProd(64, 3)
    cache = QuantizedKV.build(K, V, prod, None)
    # estimator-based logits differ from <q, decode(k)> (they are not a reconstruction's dot product)
    Kh, _ = cache.dequantized()
    assert logit_mse(Q[0], K, cache) > 0
    assert np.allclose(cache.logits(Q[0]), prod.inner_product(Q[0], prod.encode(K)), atol=1e-9)


def test_metrics():
    a = np.array([[3.0, 2.0, 1.0, 0.0]])
    assert topk_agreement(a, a, 2) == 1.0
    assert topk_agreement(a, np.array([[0.0, 2.0, 1.0, 3.0]]), 2) == 0.5
    assert relative_error([1.0, 0.0], [1.0, 0.0]) == 0.0
    assert relative_error([2.0], [1.0]) == 1.0
    with pytest.raises(ValueError, match="k must be an integer in 1..4"):
        topk_agreement(a, a, 5)


def test_validation():
    K, V, Q = _kv(10, 8)
    with pytest.raises(ValueError, match="K and V must both be"):
        QuantizedKV.build(K, V[:5], None, None)
    with pytest.raises(ValueError, match="sink must be a non-negative integer"):
        QuantizedKV.build(K, V, None, None, sink=-1)
    with pytest.raises(ValueError, match="V contains NaN"):
        QuantizedKV.build(K, np.full_like(V, np.nan), None, None)
    cache = QuantizedKV.build(K, V, None, None)
    with pytest.raises(ValueError, match="Q has 11 positions"):
        attention_prefill(np.zeros((11, 8)), cache)
    # band larger than the sequence: everything in float16
    big = QuantizedKV.build(K, V, TurboQuantMSE(8, 2), TurboQuantMSE(8, 2), sink=8, window=8)
    assert big.keys is None and big.bits_per_element()["total"] == 16.0
