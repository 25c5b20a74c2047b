"""The fused CPU kernels produce exactly what the TurboQuantMSE spec path produces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_ref.common import Encoded
from kvq_ref.fast import _buckets, _count_below, decode_fast, encode_fast
from kvq_ref.turboquant import TurboQuantMSE


@given(st.sampled_from([2, 3, 16, 54, 64, 80, 96, 97, 128, 256]), st.integers(1, 8), st.booleans(),
       st.sampled_from(["float16", "float32"]), st.integers(1, 300), st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_fused_equals_spec(d, bits, norm_correction, norm_dtype, n, seed):
    q = TurboQuantMSE(d, bits, seed=seed % 7, norm_correction=norm_correction, norm_dtype=norm_dtype)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0  # some zero vectors
    enc = q.encode(x)
    assert encode_fast(q, x) == enc
    assert np.array_equal(decode_fast(q, enc), q.decode(enc))
    assert encode_fast(q, x.astype(np.float64)) == q.encode(x.astype(np.float64))


@given(st.integers(1, 8), st.lists(st.floats(-3, 3), min_size=1, max_size=50))
def test_bucket_search_is_searchsorted(bits, ys):
    from codebooks import SphereMarginal, lloyd_max

    cb = lloyd_max(SphereMarginal(64), bits)
    t = cb.thresholds
    lo, inv_w, first, padded = _buckets(t, cb.levels)
    probe = np.concatenate([np.asarray(ys) / 8, t, np.nextafter(t, -1), np.nextafter(t, 1), [-1e9, 1e9]])
    for y in probe:
        assert _count_below(padded, y, lo, inv_w, first) == np.searchsorted(t, y, side="left")


def test_shapes_and_errors():
    q = TurboQuantMSE(128, 4)
    x = np.random.default_rng(0).standard_normal((2, 3, 128)).astype(np.float32)
    enc = encode_fast(q, x)
    assert enc.shape == (2, 3, 128) and decode_fast(q, enc).shape == (2, 3, 128)
    with pytest.raises(ValueError, match="rotation='hadamard'"):
        encode_fast(TurboQuantMSE(128, 4, rotation="haar"), x)
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        encode_fast(q, np.full((1, 128), np.nan, np.float32))
    with pytest.raises(ValueError, match="x must have last dimension 128"):
        encode_fast(q, np.zeros((1, 64), np.float32))
    bad = Encoded(enc.method, enc.config, enc.shape, {**enc.arrays, "norms": enc.arrays["norms"][..., :1]})
    with pytest.raises(ValueError, match="corrupted buffer"):
        decode_fast(q, bad)


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64), (0, 2, 64)])
def test_zero_rows_give_the_reference_encoding(shape):
    """Issue 53: encode_fast on zero rows raised numpy's reshape error; now it is q.encode's Encoded."""
    q = TurboQuantMSE(64, 3)
    enc, ref = encode_fast(q, np.zeros(shape)), q.encode(np.zeros(shape))
    assert enc.shape == ref.shape and enc.arrays.keys() == ref.arrays.keys()
    for k in ref.arrays:
        assert enc.arrays[k].shape == ref.arrays[k].shape and enc.arrays[k].dtype == ref.arrays[k].dtype
    assert decode_fast(q, enc).shape == shape
