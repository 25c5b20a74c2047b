"""TurboQuantMSE / TurboQuantProd / TurboQuantSplit against codebooks/ and theory/."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from codebooks import SphereMarginal, lloyd_max
from kvq_ref.common import Encoded
from kvq_ref.turboquant import TurboQuantMSE, TurboQuantProd, TurboQuantSplit
from theory import qjl_prod_distortion


def _unit(n, d, seed):
    g = np.random.default_rng(seed).standard_normal((n, d))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("bits", range(1, 9))
def test_mse_matches_codebook_distortion(d, bits):
    """E||x - x_hat||^2 of random unit vectors = d * mse of SphereMarginal(d) (any fixed rotation
    maps a uniform unit vector to a uniform one); Monte Carlo within 4 standard errors."""
    x = _unit(200_000 // d, d, seed=d * 10 + bits)
    q = TurboQuantMSE(d, bits, seed=bits)
    err = np.sum((x - q.decode(q.encode(x))) ** 2, axis=1)
    target = lloyd_max(SphereMarginal(d), bits).unit_distortion
    se = err.std(ddof=1) / math.sqrt(err.size)
    assert abs(err.mean() - target) <= 4 * se
    assert se < 0.05 * target  # the test resolves a 20% error at 4 SE


def test_haar_rotation_gives_the_same_distortion():
    x = _unit(4000, 64, seed=1)
    q = TurboQuantMSE(64, 3, rotation="haar")
    err = np.sum((x - q.decode(q.encode(x))) ** 2, axis=1)
    assert abs(err.mean() - lloyd_max(SphereMarginal(64), 3).unit_distortion) <= 4 * err.std() / math.sqrt(err.size)


@pytest.mark.parametrize("bits, sketch", [(1, "gaussian"), (2, "gaussian"), (3, "gaussian"), (3, "orthogonal")])
def test_prod_is_unbiased_and_its_variance_matches_theory(bits, sketch):
    """Each seed draws a new rotation and sketch; the estimator's error over seeds and vectors
    has mean 0 (slope 1) and, for a Gaussian sketch, mean square = theory.qjl_prod_distortion."""
    d = 32
    x = _unit(64, d, seed=0)
    y = _unit(1, d, seed=1)[0]
    est, true = [], []
    for seed in range(300):
        q = TurboQuantProd(d, bits, seed=seed, sketch=sketch, norm_dtype="float32")
        est.append(q.inner_product(y, q.encode(x)))
        true.append(x @ y)
    est, true = np.concatenate(est), np.concatenate(true)
    slope = np.dot(true, est) / np.dot(true, true)
    resid = est - slope * true
    slope_se = math.sqrt(np.dot(resid, resid) / (est.size - 1) / np.dot(true, true))
    assert abs(slope - 1) <= 4 * slope_se
    err2 = (est - true) ** 2
    if sketch == "gaussian":
        se = err2.std(ddof=1) / math.sqrt(err2.size)
        assert abs(err2.mean() - qjl_prod_distortion(bits, d)) <= 4.5 * se
    else:  # orthogonal rows: lower variance than the Gaussian sketch
        assert err2.mean() < qjl_prod_distortion(bits, d)


def test_rates_are_what_is_stored():
    x = np.random.default_rng(0).standard_normal((7, 128))
    for bits in range(1, 9):
        enc = TurboQuantMSE(128, bits).encode(x)
        assert enc.bits_per_element == 8 * enc.nbytes / x.size == bits + 16 / 128
    assert TurboQuantMSE(80, 3).encode(x[:, :80]).bits_per_element == 3 + 16 / 80
    assert TurboQuantMSE(128, 3, norm_dtype="float32").encode(x).bits_per_element == 3 + 32 / 128
    assert TurboQuantProd(128, 3).encode(x).bits_per_element == 2 + 1 + 32 / 128
    s = TurboQuantSplit.calibrate(x, 2.5)
    assert s.encode(x).bits_per_element == 2.5
    assert TurboQuantSplit.calibrate(x, 3.5).encode(x).bits_per_element == 3.5


@pytest.mark.parametrize("d, bits", [(32, 4), (96, 3), (128, 2), (128, 4)])
def test_reencoding_law(d, bits):
    """Codes are a fixed point iff 1/||c_hat|| is inside the table's invariant scales; then the
    norm-corrected encoding is a fixed point and the plain norm shrinks by ||c_hat||."""
    x = np.random.default_rng(d + bits).standard_normal((3000, d)) * 3
    for nc in (True, False):
        q = TurboQuantMSE(d, bits, norm_correction=nc)
        enc = q.encode(x)
        again = q.encode(q.decode(enc))
        chat, _ = q._parts(enc)
        s = 1.0 / np.linalg.norm(chat, axis=1)
        lo, hi = q.table.invariant_scales()
        inside = (s > lo * (1 + 1e-6)) & (s < hi * (1 - 1e-6))  # margin: float32 decode output
        assert inside.mean() > 0.99
        codes0 = q._parts(enc)[0]
        codes1 = q._parts(again)[0]
        same = np.all(codes0 == codes1, axis=1)
        assert np.all(same[inside])
        n0 = enc.arrays["norms"].astype(np.float64)[inside]
        n1 = again.arrays["norms"].astype(np.float64)[inside]
        if nc:
            assert np.array_equal(n0, n1)
        else:  # float16 storage of the shrunk norm: within one float16 rounding
            assert np.allclose(n1, n0 / s[inside], rtol=2**-10)
    assert not TurboQuantMSE.idempotent


def test_inner_product_is_query_rotated_once():
    rng = np.random.default_rng(3)
    x, q = rng.standard_normal((50, 128)), rng.standard_normal((4, 128))
    for m in (TurboQuantMSE(128, 4), TurboQuantMSE(128, 2, rotation="haar"), TurboQuantProd(128, 3),
              TurboQuantSplit.calibrate(x, 2.5)):
        enc = m.encode(x)
        # float32 decode vs float64 scores: |<q, x_hat>| ~ 10, float32 ulp 1e-6
        assert np.allclose(m.inner_product(q, enc), q @ m.decode(enc).astype(np.float64).T, atol=1e-4)
        assert m.inner_product(q[0], enc).shape == (50,)


def test_shapes_zero_vectors_and_torch():
    q = TurboQuantMSE(64, 3)
    for shape in [(64,), (1, 64), (54, 64), (97, 64), (2, 3, 64)]:
        x = np.random.default_rng(0).standard_normal(shape)
        enc = q.encode(x)
        assert enc.shape == shape and q.decode(enc).shape == shape and q.decode(enc).dtype == np.float32
    z = q.decode(q.encode(np.zeros((3, 64))))
    assert np.all(z == 0) and not np.any(np.isnan(z))
    zp = TurboQuantProd(64, 2)
    assert np.all(zp.decode(zp.encode(np.zeros((2, 64)))) == 0)
    t = torch.randn(5, 64, dtype=torch.bfloat16)
    assert q.encode(t) == q.encode(t.float().numpy())


def test_bad_parameters_and_inputs():
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        TurboQuantMSE(64, 9)
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        TurboQuantMSE(64, 0)
    with pytest.raises(ValueError, match="dim must be an integer >= 2"):
        TurboQuantMSE(1, 3)
    with pytest.raises(ValueError, match="rotation must be"):
        TurboQuantMSE(64, 3, rotation="dct")
    with pytest.raises(ValueError, match="precision must be 'float16' or 'float32'"):
        TurboQuantMSE(64, 3, norm_dtype="bfloat16")
    with pytest.raises(ValueError, match="sketch must be"):
        TurboQuantProd(64, 3, sketch="rademacher")
    with pytest.raises(ValueError, match="outliers must be"):
        TurboQuantSplit(128, (1, 1, 2))
    with pytest.raises(ValueError, match="rate must be 2.5 or 3.5"):
        TurboQuantSplit.calibrate(np.ones((4, 128)), 3.0)
    q = TurboQuantMSE(64, 3)
    with pytest.raises(ValueError, match="x must have last dimension 64"):
        q.encode(np.zeros((3, 32)))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        q.encode(np.full((2, 64), np.nan))
    with pytest.raises(TypeError, match="x must be a real floating-point array"):
        q.encode(np.zeros((2, 64), dtype=np.int32))
    with pytest.raises(ValueError, match="norms overflow float16"):
        q.encode(np.full((1, 64), 1e5))
    with pytest.raises(ValueError, match="q must have last dimension 64"):
        q.inner_product(np.zeros(8), q.encode(np.ones((2, 64))))


def test_corrupted_buffers_are_refused():
    q = TurboQuantMSE(64, 3)
    enc = q.encode(np.random.default_rng(0).standard_normal((4, 64)))
    bad = [
        Encoded(enc.method, enc.config, enc.shape, {"codes": enc.arrays["codes"]}),
        Encoded(enc.method, enc.config, enc.shape, {**enc.arrays, "norms": enc.arrays["norms"].astype(np.float32)}),
        Encoded(enc.method, enc.config, enc.shape, {**enc.arrays, "codes": enc.arrays["codes"][:, :-1]}),
        Encoded(enc.method, enc.config, enc.shape, {**enc.arrays, "norms": np.full(4, np.nan, np.float16)}),
        Encoded("kivi", enc.config, enc.shape, enc.arrays),
    ]
    for b in bad:
        with pytest.raises(ValueError, match="corrupted buffer|made by"):
            q.decode(b)
    with pytest.raises(ValueError, match="config"):
        replace(q, bits=2).decode(enc)
    # 64 * 3 bits fill 24 bytes exactly (no padding); a 5-bit table on 60 dims leaves 4 padding bits
    q5 = TurboQuantMSE(60, 5)
    e5 = q5.encode(np.ones((2, 60)))
    c5 = e5.arrays["codes"].copy()
    c5[0, -1] |= 0x80  # 300 bits -> 38 bytes, 4 padding bits
    with pytest.raises(ValueError, match="padding bits"):
        q5.decode(Encoded(e5.method, e5.config, e5.shape, {**e5.arrays, "codes": c5}))
