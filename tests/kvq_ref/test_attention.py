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


def test_a_band_value_past_float16_is_refused_not_nan():
    """Issue 53: a band value past 65504 was stored as Inf and attention_decode returned NaN."""
    K, V, q = *_kv(40, 8)[:2], np.ones((1, 8))
    V = V.copy()
    V[0, 3] = 7e4  # a sink token
    with pytest.raises(ValueError, match=r"V: the band tokens \(first 4, last 8\) are kept in float16, but 1 value"):
        QuantizedKV.build(K, V, TurboQuantMSE(8, 2), TurboQuantMSE(8, 2), sink=4, window=8)
    K2 = K.copy()
    K2[20, 0] = -1e5  # a middle token with no method: float16 as well
    with pytest.raises(ValueError, match="K: the middle tokens"):
        QuantizedKV.build(K2, V * 0, None, None, sink=4, window=8)
    V[0, 3] = 65519.0  # rounds to 65504: fits
    cache = QuantizedKV.build(K, V, TurboQuantMSE(8, 2), TurboQuantMSE(8, 2), sink=4, window=8)
    assert np.all(np.isfinite(attention_decode(q, cache)))
    import dataclasses
    with pytest.raises(ValueError, match="band_values holds NaN/Inf"):
        dataclasses.replace(cache, band_values=np.full_like(cache.band_values, np.inf))


@pytest.mark.parametrize("scale", [float("nan"), 0.0, -0.5, True, float("inf"), "0.3", np.bool_(True)])
def test_bad_logit_scales_are_refused(scale):
    """Issue 53: scale NaN, 0, negative or True was accepted (NaN, uniform or inverted attention)."""
    K, V, Q = _kv(10, 8)
    cache = QuantizedKV.build(K, V, None, None)
    for call in (lambda: attention_decode(Q[:1], cache, scale=scale),
                 lambda: attention_prefill(Q[:3], cache, scale=scale),
                 lambda: exact_attention(Q[:3], K, V, scale=scale)):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            call()
    assert np.all(np.isfinite(attention_decode(Q[:1], cache, scale=np.float32(0.25))))
