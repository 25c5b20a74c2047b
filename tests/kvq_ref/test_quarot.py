"""kvq_ref.quarot: Hadamard rotation + asymmetric per-token groups.

Most laws here are those of our variant (``ExactQuaRot``: ``rule="exact"``, ``rotation="randomized"``,
clip 0.95, the earlier defaults); the official defaults are checked bit for bit against QuaRot's code
in tests/interop/test_quarot.py and for their laws at the end of this file.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq_ref.common import Encoded
from kvq_ref.packing import unpack_codes
from kvq_ref.quarot import QuaRot
from kvq_ref.uniform import dequantize

F16 = np.float16


def ExactQuaRot(*args, **kw):
    """QuaRot with our exact rule, the seeded randomized Hadamard and clip 0.95."""
    return QuaRot(*args, **{"rule": "exact", "rotation": "randomized", "clip_ratio": 0.95, **kw})


def gaussian(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


dims_groups = st.sampled_from([(16, 16), (64, 32), (96, 128), (96, 32), (128, 128), (128, 64), (40, 8)])


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim, group", [(128, 128), (128, 64), (128, 32), (96, 128), (96, 32)])
def test_rate_is_bits_plus_32_over_group(bits, dim, group):
    q = ExactQuaRot(dim, bits, group)
    enc = q.encode(gaussian((5, 3, dim)))
    g = min(group, dim)
    assert enc.bits_per_element == 8 * enc.nbytes / enc.elements == bits + 32 / g


def test_published_int2_rate():
    assert ExactQuaRot(128, 2, 128).encode(gaussian((7, 128))).bits_per_element == 2.25


def test_idempotent_only_without_clipping():
    assert ExactQuaRot(64, clip_ratio=1.0).idempotent and ExactQuaRot(64, clip_ratio=1).idempotent
    assert not ExactQuaRot(64, clip_ratio=0.95).idempotent


@given(dims_groups, st.integers(1, 8), st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 40.0]),
       st.sampled_from(["randomized", "haar"]))
def test_exact_fixed_point_at_clip_one(dg, bits, seed, scale, rotation):
    dim, group = dg
    q = ExactQuaRot(dim, bits, group, clip_ratio=1.0, rotation=rotation, seed=seed % 7)
    x = scale * gaussian((6, dim), seed)
    enc = q.encode(x)
    assert q.encode(q.decode(enc)) == enc


@given(dims_groups, st.integers(1, 8), st.floats(0.5, 0.99), st.integers(0, 2**32 - 1))
def test_clipping_shrinks_the_stored_range_by_the_clip_ratio_on_re_encode(dg, bits, c, seed):
    """Derived law (class Notes): for groups with min < 0 < max the decoded group spans exactly
    [m, m + L s]; re-encoding clips that span again, so m' ~ c m and L s' ~ c L s, up to float16
    rounding (one float16 step of m', L half-steps of s') and float32 decoding (~1e-7 |y|)."""
    dim, group = dg
    q = ExactQuaRot(dim, bits, group, clip_ratio=c)
    x = gaussian((8, dim), seed)
    g, L = q.g, 2**bits - 1
    y = q.rot.apply(x).reshape(8, dim // g, g)
    both = (y.min(-1) < 0) & (y.max(-1) > 0)
    enc = q.encode(x)
    enc2 = q.encode(q.decode(enc))
    s, m = enc.arrays["scales"].astype(float), enc.arrays["minima"].astype(float)
    s2, m2 = enc2.arrays["scales"].astype(float), enc2.arrays["minima"].astype(float)
    noise = 1e-6 * np.abs(y).max()
    dm = np.abs(m2 - c * m)
    assert np.all((dm <= 2**-10 * np.abs(c * m) + 2**-24 + noise)[both])
    ds = np.abs(L * s2 - c * L * s)
    assert np.all((ds <= dm + L * 2**-10 * s2 + 2**-24 * L + 2 * noise)[both])
    if bits >= 2 and c <= 0.9:
        assert enc2 != enc  # not a fixed point


@pytest.mark.parametrize("bits", [6, 8])
def test_rotated_domain_errors_follow_the_uniform_law(bits):
    """Theory: at high rate the non-extreme rounding errors of y = R x are ~ Uniform(-s/2, s/2)."""
    q = ExactQuaRot(128, bits, 32, clip_ratio=1.0)
    x = gaussian((3000, 128), 11)
    enc = q.encode(x)
    xh = q.decode(enc).astype(float)
    y, yh = q.rot.apply(x), q.rot.apply(xh)  # float32 decode noise ~1e-7 << s ~ 0.02..0.1
    # orthogonality: the error is the same in both domains
    assert np.allclose(np.sum((x - xh) ** 2, 1), np.sum((y - yh) ** 2, 1), rtol=1e-5)
    s = np.repeat(enc.arrays["scales"].astype(float), 32, axis=1)
    yg = y.reshape(3000, 4, 32)
    ext = ((yg == yg.max(-1, keepdims=True)) | (yg == yg.min(-1, keepdims=True))).reshape(3000, 128)
    u = ((y - yh) / s)[~ext]
    u2 = u**2
    assert abs(u.mean()) < 4 * u.std() / math.sqrt(u.size)
    assert abs(u2.mean() - 1 / 12) < 4 * u2.std() / math.sqrt(u2.size)


def test_stored_arrays_follow_the_uniform_rule_on_rotated_vectors():
    q = ExactQuaRot(64, 3, 16, clip_ratio=0.9, seed=3)
    x = gaussian((5, 64), 12)
    enc = q.encode(x)
    a = enc.arrays
    yh = dequantize(unpack_codes(a["codes"], 3, 64), a["scales"], a["minima"], 16)
    assert np.allclose(q.decode(enc), q.rot.inverse(yh), atol=1e-6)
    y = q.rot.apply(x).reshape(5, 4, 16)
    assert np.allclose(a["minima"].astype(float), 0.9 * y.min(-1), rtol=2**-10, atol=1e-7)


@pytest.mark.parametrize("rotation", ["randomized", "haar"])
def test_scores_and_accumulate_in_the_rotated_domain(rotation):
    q = ExactQuaRot(96, 4, 32, rotation=rotation, seed=5)
    enc = q.encode(gaussian((2, 30, 96), 13))
    xh = q.decode(enc).astype(float).reshape(60, 96)
    qs = gaussian((4, 96), 14)
    ip = q.inner_product(qs, enc)
    assert ip.shape == (4, 2, 30)
    # decode is float32: relative error ~ 1e-7 of |q| |x_hat|
    tol = 1e-6 * np.linalg.norm(qs, axis=1)[:, None] * np.linalg.norm(xh, axis=1)[None]
    assert np.all(np.abs(ip.reshape(4, 60) - qs @ xh.T) <= tol)
    assert np.allclose(q.prepare_query(qs), q.rot.apply(qs))
    p = np.abs(gaussian((4, 60), 15))
    acc = q.accumulate(p, enc)
    assert np.allclose(acc, p @ xh, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 64), (54, 64), (97, 64), (64,), (2, 3, 5, 64)])
def test_odd_shapes_and_zero_vectors(shape):
    q = ExactQuaRot(64, 2, 64)
    x = gaussian(shape, 16)
    y = q.decode(q.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32 and np.all(np.isfinite(y))
    # 2-bit per-token error: well below the vector norm on average
    assert np.mean(np.sum((x - y) ** 2, -1)) < 0.5 * np.mean(np.sum(x**2, -1))
    z = q.decode(q.encode(np.zeros(shape)))
    assert np.array_equal(z, np.zeros(shape, np.float32))


def test_corrupted_encodings_are_refused():
    q = ExactQuaRot(32, 3, 16)
    enc = q.encode(gaussian((6, 32), 17))
    a = enc.arrays
    for arrays in ({k: v for k, v in a.items() if k != "minima"}, a | {"scales": a["scales"].astype(np.float32)},
                   a | {"codes": a["codes"][:, :-1]}, a | {"scales": np.full_like(a["scales"], np.inf)},
                   a | {"residual": np.zeros(1, F16)}):
        with pytest.raises(ValueError):
            q.decode(Encoded(enc.method, enc.config, enc.shape, arrays))
    for other in (ExactQuaRot(32, 3, 16, seed=1), ExactQuaRot(32, 3, 16, clip_ratio=1.0), ExactQuaRot(32, 3, 8)):
        with pytest.raises(ValueError, match="config"):
            other.decode(enc)
    with pytest.raises(ValueError, match="made by"):
        q.decode(dataclasses.replace(enc, method="kivi"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=0), "dim"), (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(group=0), "group"),
    (dict(dim=96, group=64), "group"), (dict(clip_ratio=0.0), "clip_ratio"), (dict(clip_ratio=1.5), "clip_ratio"),
    (dict(rotation="dct"), "rotation"), (dict(seed=-1), "seed"), (dict(seed=1.0), "seed"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExactQuaRot(**(dict(dim=64) | kwargs))


def test_group_is_capped_at_dim():
    q = ExactQuaRot(96, 2, 128)
    assert q.g == 96 and q.encode(gaussian((3, 96))).arrays["scales"].shape == (3, 1)


def test_bad_inputs():
    q = ExactQuaRot(16)
    x = gaussian((4, 16))
    x[0, 0] = np.inf
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        q.encode(x)
    with pytest.raises(ValueError, match="last dimension 16"):
        q.encode(gaussian((4, 8)))


# --- the official defaults ----------------------------------------------------------------------------
def test_defaults_are_quarots_kernel():
    q = QuaRot(128, 2)
    assert (q.rule, q.rotation, q.clip_ratio) == ("kernel", "hadamard", 1.0) and not q.idempotent
    H = q.rot.matrix() * math.sqrt(128)  # the plain Sylvester matrix, no signs, no permutation
    idx = np.arange(128)
    np.testing.assert_allclose(H, (-1.0) ** np.array([[bin(i & j).count("1") for j in idx] for i in idx]),
                               atol=1e-12)
    x = gaussian((50, 128), 4) * 3 + 1
    enc = q.encode(x)
    assert enc.bits_per_element == 2.25
    y = q.rotate(x)
    assert np.array_equal(y, y.astype(F16).astype(np.float64))  # the rotated rows are float16
    y_hat = q._rotated(enc)
    s = enc.arrays["scales"].astype(np.float64)
    # half a step plus the float16 roundings of y + zero and of the quotient (<= 2^-11 of L * s each)
    assert np.all(np.abs(y_hat - y) <= s * (0.5 + 2 * 3 * 2.0**-11) + 1e-9)
    again = q.encode(q.decode(enc))  # not idempotent: codes may move by one step
    a, b = (unpack_codes(e.arrays["codes"], 2, 128).astype(int) for e in (enc, again))
    assert np.abs(a - b).max() <= 1


def test_kernel_rule_constant_rows_and_refusals():
    q = QuaRot(64, 4, rotation="randomized")
    enc = q.encode(np.zeros((3, 64)))
    assert np.all(enc.arrays["scales"] == F16(F16(1e-5) / F16(15))) and np.all(q.decode(enc) == 0)
    with pytest.raises(ValueError, match="does not clip"):
        QuaRot(64, clip_ratio=0.95)
    with pytest.raises(ValueError, match="power-of-two"):
        QuaRot(96)
    with pytest.raises(ValueError, match="rule"):
        QuaRot(64, rule="fake")
