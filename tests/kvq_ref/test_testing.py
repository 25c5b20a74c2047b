"""kvq_ref.testing: the checks accept kvq_ref itself and reject a one-code or one-ulp-scale mistake."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from kvq_ref import KIVI, QuantizedKV, TurboQuantMSE
from kvq_ref.common import Encoded
from kvq_ref.packing import pack_codes
from kvq_ref.testing import (check_attention, check_decode, check_encode, decode_tolerance, kv_arrays,
                             threshold_ties, tie_rows)
from kvq_ref.turbo_block import TurboBlock


@settings(max_examples=15)
@given(kv_arrays(64, ties=tie_rows(TurboQuantMSE(64, 3), 8)))
def test_strategy_rows_are_finite_and_kvq_ref_passes_its_own_checks(x):
    assert x.shape[1] == 64 and np.all(np.isfinite(x))
    q = TurboQuantMSE(64, 3)
    check_encode(lambda v: q.encode(v).arrays, q, x)
    check_decode(lambda enc: q.decode(enc).astype(np.float64), q, x)


def test_check_encode_rejects_one_flipped_bit_and_missing_arrays():
    q = KIVI(32, 2, "key", residual=32)
    x = np.random.default_rng(0).standard_normal((64, 32))

    def bad(v):
        a = dict(q.encode(v).arrays)
        a["codes"] = a["codes"].copy()
        a["codes"].flat[5] ^= 1
        return a

    with pytest.raises(AssertionError, match="differ"):
        check_encode(bad, q, x)
    with pytest.raises(AssertionError, match="does not store"):
        check_encode(lambda v: {"codes": q.encode(v).arrays["codes"]}, q, x)


def test_check_decode_bound_and_a_float16_rounded_decoder_fails():
    q = TurboQuantMSE(128, 4)
    x = np.random.default_rng(1).standard_normal((20, 128))
    ratios = check_decode(lambda enc: q.decode(enc).astype(np.float32), q, x)
    assert np.all(ratios == 0)
    with pytest.raises(AssertionError, match="float32 bound"):  # float16 output: ~2^-11, far above (7+6) u
        check_decode(lambda enc: q.decode(enc).astype(np.float16), q, x)
    assert decode_tolerance(np.ones((1, 4)), 4)[0] == pytest.approx(8 * 2**-24 * 2)
    with pytest.raises(ValueError, match="power of two"):
        decode_tolerance(np.ones(4), 3)


def test_check_attention_accepts_float32_and_rejects_a_wrong_code():
    rng = np.random.default_rng(2)
    K, V = rng.standard_normal((97, 64)) + 0.5, rng.standard_normal((97, 64))
    kq, vq = TurboQuantMSE(64, 3, seed=1), TurboQuantMSE(64, 3, seed=2)
    cache = QuantizedKV.build(K, V, kq, vq, sink=4, window=16)
    q = 2 * rng.standard_normal((3, 64))
    from kvq_ref import attention_decode

    check_attention(lambda qq, c: attention_decode(qq, c).astype(np.float32), q, cache)
    a = dict(cache.values.arrays)
    a["codes"] = a["codes"].copy()
    a["codes"][np.argmax(cache.logits(q)[0, cache.middle]), 0] ^= 4  # the most attended value, coordinate 1
    wrong = QuantizedKV(cache.n, cache.d, cache.sink, cache.window, cache.band_keys, cache.band_values, kq, vq,
                        cache.keys, Encoded(cache.values.method, cache.values.config, cache.values.shape, a))
    with pytest.raises(AssertionError, match="exceed"):
        check_attention(lambda qq, c: attention_decode(qq, wrong), q, cache)


# --- ties in the domain where the comparison happens (issue 53) -----------------------------------------
TIE_QUANTIZERS = [TurboQuantMSE(64, 3), TurboQuantMSE(96, 2, rotation="haar", seed=3), TurboBlock("turbo3"),
                  TurboBlock("turbo4", profile="fork@69d8e4be+exact"), TurboBlock("turbo2", block=32, profile="kvq")]


@pytest.mark.parametrize("q", TIE_QUANTIZERS, ids=lambda q: f"{type(q).__name__}-{q.dim}-{q.bits}")
def test_tie_rows_sit_on_nonzero_thresholds_where_the_encoder_compares(q):
    x = tie_rows(q, 40, seed=1)
    y, thr = q.compared(x)
    on = np.isin(y, thr[thr != 0])
    assert x.shape == (40, q.dim) and np.all(np.isfinite(x))
    assert np.all((on | (y == 0)).any(axis=1)), "a row without an exact tie"
    assert on.sum() >= 40, f"only {on.sum()} coordinates on non-zero thresholds"


def test_input_domain_ties_are_no_ties_for_a_rotated_quantizer():
    """What the kit did before: threshold values written into x; no rotated coordinate lands on one."""
    q = TurboQuantMSE(64, 3)
    x = np.tile(threshold_ties(q.table.thresholds), (40, 10))[:, :64] * np.arange(1, 41)[:, None]
    y, thr = q.compared(x)
    assert not np.isin(y, thr[thr != 0]).any()


def _wrong_tie_encoder(q):
    """q's encoder with the other tie rule: a coordinate on a threshold takes the other cell."""
    def encode(x):
        y, thr = q.compared(x)
        if isinstance(q, TurboQuantMSE):
            codes = np.searchsorted(thr, y, side="right").astype(np.uint8)  # q takes the lower cell
            a = dict(q.encode(x).arrays)
            a["codes"] = pack_codes(codes, q.bits).reshape(a["codes"].shape)
            return a
        side = "left" if q.spec.tie == "high" else "right"
        idx = np.searchsorted(thr, y, side=side).astype(np.uint8)
        _, scales = q.unpack(q.encode(x).arrays["blocks"].reshape(-1, q.bytes_per_block))
        return {"blocks": q.pack(idx, scales).reshape(q.encode(x).arrays["blocks"].shape)}
    return encode


@pytest.mark.parametrize("q", TIE_QUANTIZERS[:4], ids=lambda q: f"{type(q).__name__}-{q.dim}-{q.bits}")
def test_the_kit_rejects_a_wrong_tie_rule(q):
    """Every example the kit draws with tie rows catches an encoder that breaks ties the other way
    (and the same encoder agrees with q on rows without ties, so only the ties catch it)."""
    wrong = _wrong_tie_encoder(q)
    plain = np.random.default_rng(0).standard_normal((30, q.dim))
    check_encode(wrong, q, plain)

    @settings(max_examples=10)
    @given(kv_arrays(q.dim, ties=tie_rows(q, 16, seed=2)))
    def caught(x):
        with pytest.raises(AssertionError, match="differ"):
            check_encode(wrong, q, x)

    caught()
