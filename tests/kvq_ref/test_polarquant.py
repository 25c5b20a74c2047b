"""PolarQuant against the polar-angle theory of Gaussian vectors and the codebooks' tables."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate

from codebooks import PolarAngle, lloyd_max
from kvq_ref.common import Encoded
from kvq_ref.polarquant import PolarQuant

CONFIGS = [  # (dim, block, bits, rotation)
    (128, 16, (4, 2, 2, 2), "hadamard"),
    (64, 8, (3, 3, 2), "hadamard"),
    (96, 32, (4, 3, 3, 2, 2), "hadamard"),  # dim not a power of two: block-Hadamard + permutation
    (64, 4, (5, 3), "haar"),
    (32, 2, (3,), "hadamard"),
    (40, 8, (2, 1, 1), "haar"),
]


def _cos_moment(level: int, bits: int) -> float:
    """E[cos(psi - psi_hat)] for psi ~ PolarAngle(level), by quadrature cell by cell."""
    dens = PolarAngle(level)
    table = lloyd_max(dens, bits)
    edges = np.concatenate([[dens.support[0]], table.thresholds, [dens.support[1]]])
    total = 0.0
    for lo, hi, c in zip(edges[:-1], edges[1:], table.levels):
        val, _ = integrate.quad(lambda t, c=c: math.cos(t - c) * float(dens.pdf(t)), lo, hi,
                                epsabs=1e-14, epsrel=1e-13, limit=200)
        total += val
    return total


def _expected_relative_error(bits) -> float:
    """E||x - x_hat||^2 / ||x||^2 for Gaussian x (exact radii).

    Per block, y = R u(psi) with u the unit vector of the angles and R independent of them, so
    ||y - y_hat||^2 = 2 R^2 (1 - <u, u_hat>). Recursively u = (cos psi_L u_left, sin psi_L u_right),
    hence <u, u_hat> = cos psi cos psi_hat <u_l, u_hat_l> + sin psi sin psi_hat <u_r, u_hat_r>; the
    angles are independent, so E<u, u_hat> = prod_l E[cos(psi_l - psi_hat_l)] (at level 1,
    <u, u_hat> = cos(psi - psi_hat)). The ratio over a whole vector, sum_b R_b^2 D_b / sum_b R_b^2,
    has the same mean since the D_b are independent of all radii.
    """
    return 2.0 * (1.0 - math.prod(_cos_moment(lv, b) for lv, b in enumerate(bits, start=1)))


def _gauss(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


# --- rate -------------------------------------------------------------------------------------
def test_default_rate_is_3_875():
    q = PolarQuant(128)
    enc = q.encode(_gauss((5, 128), 0))
    assert enc.bits_per_element == 8 * enc.nbytes / enc.elements == 3.875
    assert {k: v.shape[-1] for k, v in enc.arrays.items()} == \
        {"codes_l1": 32, "codes_l2": 8, "codes_l3": 4, "codes_l4": 2, "radii": 8}


@pytest.mark.parametrize("dim, block, bits, rotation", CONFIGS)
@pytest.mark.parametrize("radius_dtype", ["float16", "float32"])
def test_rates_are_what_is_stored(dim, block, bits, rotation, radius_dtype):
    q = PolarQuant(dim, block, bits, rotation, radius_dtype=radius_dtype)
    enc = q.encode(_gauss((3, dim), 1))
    # level l has dim / 2^l angles packed into ceil(dim/2^l * b / 8) bytes per vector
    code_bytes = sum(math.ceil((dim >> lv) * b / 8) for lv, b in enumerate(bits, start=1))
    radius_bytes = (dim // block) * np.dtype(radius_dtype).itemsize
    assert enc.bits_per_element == 8 * enc.nbytes / enc.elements == 8 * (code_bytes + radius_bytes) / dim
    if block == 16 and radius_dtype == "float16":
        assert enc.bits_per_element == (sum((16 >> lv) * b for lv, b in enumerate(bits, 1)) + 16) / 16


# --- distortion against the independent expectation ----------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6])
def test_two_coordinate_blocks_match_the_uniform_codebook_exactly(bits):
    """block = 2 (level 1 only): the error of a pair is r^2 * 2 (1 - E cos(psi - psi_hat)); for the
    uniform table with K = 2^b cells of width w = 2 pi / K and mid-cell levels,
    E cos(psi - psi_hat) = (1/w) int_{-w/2}^{w/2} cos t dt = sin(pi/K) / (pi/K) exactly."""
    K = 2**bits
    sinc = math.sin(math.pi / K) / (math.pi / K)
    assert abs(_cos_moment(1, bits) - sinc) < 1e-12  # the quadrature agrees with the closed form
    target = 2 * (1 - sinc)
    x = _gauss((20_000, 32), seed=100 + bits)
    q = PolarQuant(32, 2, (bits,), radius_dtype="float32")
    err = np.sum((x - q.decode(q.encode(x))) ** 2, axis=1) / np.sum(x**2, axis=1)
    se = err.std(ddof=1) / math.sqrt(err.size)
    assert abs(err.mean() - target) <= 4.5 * se
    assert se < 0.01 * target  # the test resolves a ~5% error


@pytest.mark.parametrize("dim, block, bits, rotation", CONFIGS)
@pytest.mark.parametrize("radius_dtype", ["float32", "float16"])
def test_gaussian_distortion_matches_polar_theory(dim, block, bits, rotation, radius_dtype):
    """Monte Carlo mean of ||x - x_hat||^2 / ||x||^2 within 4.5 standard errors of
    2 (1 - prod_l E cos(psi_l - psi_hat_l)) (see _expected_relative_error). Any fixed rotation maps
    N(0, I) to N(0, I), so the theory holds after preconditioning. A float16 radius adds
    (R_hat - R)^2 / R^2 <= 2^-22 and a zero-mean first-order term: a bias below 1e-6, under 0.1 SE."""
    target = _expected_relative_error(bits)
    x = _gauss((400_000 // dim, dim), seed=dim + block)
    q = PolarQuant(dim, block, bits, rotation, seed=3, radius_dtype=radius_dtype)
    err = np.sum((x - q.decode(q.encode(x))) ** 2, axis=1) / np.sum(x**2, axis=1)
    se = err.std(ddof=1) / math.sqrt(err.size)
    assert abs(err.mean() - target) <= 4.5 * se
    assert se < 0.01 * target


@pytest.mark.parametrize("dim, block, bits, rotation", CONFIGS)
def test_polar_theory_is_consistent_with_the_per_level_codebook_mse(dim, block, bits, rotation):
    """With u_l = 1 - E cos(psi_l - psi_hat_l) and delta = psi - psi_hat:
    delta^2/2 - delta^4/24 <= 1 - cos delta <= delta^2/2, and |delta| <= h_l (the largest distance
    from a level to its cell's edges), so mse_l/2 (1 - h_l^2/12) <= u_l <= mse_l/2. With
    1 - prod(1 - u_l) between sum u_l - sum_{l<m} u_l u_m and sum u_l:

        sum_l mse_l (1 - h_l^2/12) - sum_{l<m} mse_l mse_m / 2  <=  2 (1 - prod c_l)  <=  sum_l mse_l.

    This fails if the tables' mse, the quadrature or the product formula were wrong (e.g. a level-1
    mse measured on the wrong interval, or a density normalised differently)."""
    tables = [lloyd_max(PolarAngle(lv), b) for lv, b in enumerate(bits, start=1)]
    mse = np.array([t.mse for t in tables])
    h = []
    for lv, t in enumerate(tables, start=1):
        lo, hi = PolarAngle(lv).support
        edges = np.concatenate([[lo], t.thresholds, [hi]])
        h.append(max(np.max(t.levels - edges[:-1]), np.max(edges[1:] - t.levels)))
    h = np.array(h)
    theory = _expected_relative_error(bits)
    pairs = sum(mse[i] * mse[j] for i in range(len(bits)) for j in range(i + 1, len(bits)))
    lower = float(np.sum(mse * (1 - h**2 / 12)) - pairs / 2)
    assert lower <= theory <= float(np.sum(mse))
    u = [1 - _cos_moment(lv, b) for lv, b in enumerate(bits, start=1)]
    assert np.all(np.array(u) <= mse / 2) and np.all(np.array(u) >= mse / 2 * (1 - h**2 / 12))


# --- laws -------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31), log_scale=st.floats(-2, 3), cfg=st.sampled_from(CONFIGS))
def test_idempotence(seed, log_scale, cfg):
    """decode -> encode reproduces every angle code and the float16 radius (Gaussian inputs: all
    block radii are comparable to ||x||, the documented precondition)."""
    dim, block, bits, rotation = cfg
    q = PolarQuant(dim, block, bits, rotation, seed=seed % 7)
    x = _gauss((9, dim), seed) * 10.0**log_scale
    enc = q.encode(x)
    assert q.encode(q.decode(enc)) == enc


def test_decoded_block_norm_is_the_stored_radius():
    q = PolarQuant(128, radius_dtype="float32")
    enc = q.encode(_gauss((50, 128), 5))
    yb = q._rotated(enc).reshape(50, 8, 16)
    assert np.allclose(np.linalg.norm(yb, axis=2), enc.arrays["radii"], rtol=1e-12)


def test_inner_product_and_accumulate_equal_the_decoded_vectors():
    rng = np.random.default_rng(3)
    for q in (PolarQuant(128), PolarQuant(96, 32, (4, 3, 3, 2, 2), "haar")):
        x, qs = rng.standard_normal((54, q.dim)), rng.standard_normal((4, q.dim))
        enc = q.encode(x)
        dec = q.decode(enc).astype(np.float64)
        # scores use float64 rotated blocks, decode is float32: |<q, x_hat>| ~ 10, float32 ulp ~ 1e-6
        assert np.allclose(q.inner_product(qs, enc), qs @ dec.T, atol=1e-4)
        assert q.inner_product(qs[0], enc).shape == (54,)
        p = rng.random((4, 54))
        assert np.allclose(q.accumulate(p, enc), p @ dec, atol=1e-4)


def test_shapes_zero_vectors_and_torch():
    q = PolarQuant(128)
    for shape in [(128,), (1, 128), (54, 128), (97, 128), (2, 3, 128)]:
        x = _gauss(shape, 0)
        enc = q.encode(x)
        dec = q.decode(enc)
        assert enc.shape == shape and dec.shape == shape and dec.dtype == np.float32
        assert enc.arrays["radii"].shape == shape[:-1] + (8,)
        assert q.inner_product(_gauss((128,), 1), enc).shape == shape[:-1]
    z = q.decode(q.encode(np.zeros((3, 128))))
    assert np.all(z == 0) and not np.any(np.isnan(z))
    # a vector with zero rotated blocks: those blocks have radius 0 and decode to zeros
    y = _gauss((1, 128), 2)
    y[:, 16:48] = 0
    enc = q.encode(q.rot.inverse(y))
    assert np.all(enc.arrays["radii"][0, 1:3] == 0)
    assert np.all(q._rotated(enc)[0, 16:48] == 0)
    t = torch.randn(5, 128, dtype=torch.bfloat16)
    assert q.encode(t) == q.encode(t.float().numpy())


def test_bad_parameters_and_inputs():
    cases = [
        (dict(dim=1), ValueError, "dim must be an integer >= 2"),
        (dict(dim=128, block=12), ValueError, "block must be a power of two"),
        (dict(dim=48, block=32), ValueError, "block must be a power of two .* dividing dim=48"),
        (dict(dim=128, block=1), ValueError, "block must be a power of two"),
        (dict(dim=128, block=16, bits=(4, 2, 2)), ValueError, "bits must be 4 integers in 1..8"),
        (dict(dim=128, block=16, bits=(4, 2, 2, 9)), ValueError, "bits must be 4 integers in 1..8"),
        (dict(dim=128, block=16, bits=(4, 0, 2, 2)), ValueError, "bits must be 4 integers in 1..8"),
        (dict(dim=128, block=16, bits=(4, True, 2, 2)), ValueError, "bits must be 4 integers"),
        (dict(dim=128, block=16, bits=4), TypeError, "bits must be a tuple"),
        (dict(dim=128, rotation="dct"), ValueError, "rotation must be"),
        (dict(dim=128, seed=-1), ValueError, "seed must be a non-negative integer"),
        (dict(dim=128, radius_dtype="bfloat16"), ValueError, "precision must be 'float16' or 'float32'"),
    ]
    for kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            PolarQuant(**kwargs)
    assert PolarQuant(64, 4, [3, 2]).bits == (3, 2)  # lists are normalised to tuples
    q = PolarQuant(128)
    with pytest.raises(ValueError, match="x must have last dimension 128"):
        q.encode(np.zeros((3, 64)))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        q.encode(np.full((2, 128), np.inf))
    with pytest.raises(TypeError, match="x must be a real floating-point array"):
        q.encode(np.zeros((2, 128), dtype=np.int64))
    with pytest.raises(ValueError, match="radii overflow float16"):
        q.encode(np.full((1, 128), 3e4))


def test_corrupted_buffers_are_refused():
    q = PolarQuant(128)
    enc = q.encode(_gauss((4, 128), 0))
    a = enc.arrays
    bad = [
        Encoded(enc.method, enc.config, enc.shape, {k: v for k, v in a.items() if k != "codes_l3"}),
        Encoded(enc.method, enc.config, enc.shape, {**a, "radii": a["radii"].astype(np.float32)}),
        Encoded(enc.method, enc.config, enc.shape, {**a, "codes_l1": a["codes_l1"][:, :-1]}),
        Encoded(enc.method, enc.config, enc.shape, {**a, "radii": np.full((4, 8), np.nan, np.float16)}),
        Encoded(enc.method, enc.config, (4, 64), a),
        Encoded("turboquant_mse", enc.config, enc.shape, a),
    ]
    for b in bad:
        with pytest.raises(ValueError, match="corrupted buffer|made by"):
            q.decode(b)
    for other in (replace(q, bits=(4, 2, 2, 3)), replace(q, seed=1), replace(q, radius_dtype="float32")):
        with pytest.raises(ValueError, match="config"):
            other.decode(enc)
    # (3, 3, 3) on dim 8: level 1 has 4 codes * 3 bits = 12 bits in 2 bytes, 4 padding bits
    q3 = PolarQuant(8, 8, (3, 3, 3))
    e3 = q3.encode(np.ones((2, 8)))
    c = e3.arrays["codes_l1"].copy()
    c[0, -1] |= 0x80
    with pytest.raises(ValueError, match="padding bits"):
        q3.decode(Encoded(e3.method, e3.config, e3.shape, {**e3.arrays, "codes_l1": c}))
