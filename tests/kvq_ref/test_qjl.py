"""kvq_ref.qjl: outlier-aware 1-bit sketched keys (unbiased estimator) and uniform values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvq_ref.common import Encoded
from kvq_ref.qjl import QJL
from theory import qjl_variance

F16 = np.float16


def gaussian(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def keys_with_outliers(shape, seed=0, n_big=8, big=8.0):
    """Gaussian keys whose first channels (a fixed random set) are `big` times larger, like real keys."""
    rng = np.random.default_rng(seed)
    scale = np.ones(shape[-1])
    scale[rng.permutation(shape[-1])[:n_big]] = big
    return rng.standard_normal(shape) * scale


def split(q, x, idx):
    """(q_in, q_out), (x_in, x_out) for one channel set."""
    mask = np.zeros(x.shape[-1], bool)
    mask[idx] = True
    return (np.where(mask, 0, q), np.where(mask, q, 0)), (np.where(mask, 0, x), np.where(mask, x, 0))


def test_estimator_is_unbiased_regression_slope():
    """Per sketch seed, the OLS slope of estimates on true <q, k>; over 40 seeds their mean is 1
    within 4 standard errors (the seeds' slopes are independent; one fixed sketch alone has its own
    O(1/sqrt(m d)) deviation, averaged out here)."""
    k = keys_with_outliers((96, 128), 1)
    qs = gaussian((16, 128), 2) * 2
    true = (qs @ k.T).ravel()
    slopes, intercepts = [], []
    for seed in range(40):
        qjl = QJL(128, seed=seed)
        est = qjl.inner_product(qs, qjl.encode(k)).ravel()
        b, a = np.polyfit(true, est, 1)
        slopes.append(b)
        intercepts.append(a)
    slopes = np.array(slopes)
    se = slopes.std(ddof=1) / math.sqrt(slopes.size)
    assert abs(slopes.mean() - 1) < 4 * se, (slopes.mean(), se)
    ints = np.array(intercepts)
    assert abs(ints.mean()) < 4 * ints.std(ddof=1) / math.sqrt(ints.size)


def test_gaussian_sketch_variance_matches_theory():
    """Var over sketch seeds of est(q_in, k_in) + est(q_out, k_out) = the sum of the two parts'
    exact variances (theory.qjl_variance), times (stored float16 norm / norm)^2. The sample
    variance of N = 2000 draws has standard error sqrt((mu4 - var^2) / N); allowed 4.5 of them."""
    m, mo, n_out = 64, 32, 4
    k = keys_with_outliers((8, 32), 3, n_big=4, big=5.0)  # one token group
    qs = gaussian((2, 32), 4)
    ests = []
    for seed in range(2000):
        qjl = QJL(32, m=m, m_outlier=mo, n_outlier=n_out, sketch="gaussian", seed=seed)
        enc = qjl.encode(k)
        ests.append(qjl.inner_product(qs, enc))
    ests = np.array(ests)  # (seeds, 2 queries, 8 keys)
    idx = enc.arrays["outlier_idx"][0]
    for t in range(8):
        for j in range(2):
            (qi, qo), (ki, ko) = split(qs[j], k[t], idx)
            r_in = float(enc.arrays["norms"][t]) / np.linalg.norm(ki)
            r_out = float(enc.arrays["outlier_norms"][t]) / np.linalg.norm(ko)
            theory = (r_in**2 * qjl_variance(m, np.linalg.norm(qi), np.linalg.norm(ki), qi @ ki)
                      + r_out**2 * qjl_variance(mo, np.linalg.norm(qo), np.linalg.norm(ko), qo @ ko))
            e = ests[:, j, t]
            var = e.var(ddof=1)
            mu4 = np.mean((e - e.mean()) ** 4)
            se = math.sqrt((mu4 - var**2) / e.size)
            assert abs(var - theory) < 4.5 * se, (t, j, var, theory, se)
            # and the mean is the true inner product (unbiased), within 4.5 standard errors
            assert abs(e.mean() - (r_in * (qi @ ki) + r_out * (qo @ ko))) < 4.5 * math.sqrt(var / e.size)


def test_decode_is_mean_unbiased_and_its_error_matches_theory():
    """Gaussian sketch, m rows, part of dimension d_p: E k_hat = r k (r = float16 norm / norm) and
    E||k_hat - k||^2 = |k|^2 (r^2 (d_p pi/2 + m - 1)/m - 2 r + 1) per part (E||P S^T sign(S v)||^2 =
    m d_p + m (m-1) kappa^2). Monte Carlo over 1500 seeds, 4.5 standard errors."""
    dim, m, mo, n_out = 32, 64, 32, 4
    k = keys_with_outliers((1, dim), 5, n_big=4, big=5.0)
    hats = []
    for seed in range(1500):
        qjl = QJL(dim, m=m, m_outlier=mo, n_outlier=n_out, sketch="gaussian", seed=seed)
        enc = qjl.encode(k)
        hats.append(qjl.decode(enc)[0].astype(float))
    hats = np.array(hats)
    idx = enc.arrays["outlier_idx"][0]
    _, (ki, ko) = split(k[0], k[0], idx)
    r_in = float(enc.arrays["norms"][0]) / np.linalg.norm(ki)
    r_out = float(enc.arrays["outlier_norms"][0]) / np.linalg.norm(ko)
    mean_want = r_in * ki + r_out * ko
    z = (hats.mean(0) - mean_want) / (hats.std(0, ddof=1) / math.sqrt(len(hats)))
    assert np.all(np.abs(z) < 4.5)
    part = lambda v, r, mp, dp: v @ v * (r**2 * (dp * math.pi / 2 + mp - 1) / mp - 2 * r + 1)
    want = part(ki, r_in, m, dim - n_out) + part(ko, r_out, mo, n_out)
    err = np.sum((hats - k[0]) ** 2, 1)
    assert abs(err.mean() - want) < 4.5 * err.std(ddof=1) / math.sqrt(err.size)


@pytest.mark.parametrize("sketch", ["orthogonal", "gaussian"])
@pytest.mark.parametrize("n", [1, 54, 97])
def test_scores_equal_inner_products_with_the_decoded_keys(sketch, n):
    qjl = QJL(64, m=128, m_outlier=32, n_outlier=4, group=16, sketch=sketch, seed=9)
    k = keys_with_outliers((2, n, 64), n, n_big=4)
    enc = qjl.encode(k)
    qs = gaussian((3, 64), 10)
    ip = qjl.inner_product(qs, enc)
    assert ip.shape == (3, 2, n)
    kh = qjl.decode(enc).astype(float)
    # decode is float32: relative rounding 2^-24 per entry
    tol = 1e-6 * np.linalg.norm(qs, axis=1)[:, None, None] * np.linalg.norm(kh, axis=-1)[None]
    assert np.all(np.abs(ip - np.einsum("md,bnd->mbn", qs, kh)) <= tol)


@pytest.mark.parametrize("n", [32, 64, 54, 97, 1])
def test_stored_rate_matches_the_formula(n):
    qjl = QJL(128)  # m 256, m_outlier 64, 8 outliers per 32 tokens
    enc = qjl.encode(keys_with_outliers((3, n, 128), n))
    bits = 3 * (n * (256 + 64 + 2 * 16) + math.ceil(n / 32) * 8 * 8)
    assert 8 * enc.nbytes == bits
    assert enc.bits_per_element == bits / (3 * n * 128)
    if n % 32 == 0:
        assert enc.bits_per_element == (256 + 64 + 32 + 8 * 8 / 32) / 128 == 2.765625


def test_outlier_channels_by_group_norm_with_ties_to_the_lower_index():
    qjl = QJL(16, n_outlier=3, group=4)
    x = gaussian((10, 16), 11)
    x[:4, [5, 9, 2]] *= 20
    x[4:8] = 0.0  # all-zero group: every channel ties
    x[8:10] = 1.0  # short last group, all channels tie
    x[8, 7] = -1.5  # ... except channel 7
    idx = qjl.outlier_channels(x)
    assert idx.dtype == np.uint8 and idx.shape == (3, 3)
    norms = np.sqrt((x[:4] ** 2).sum(0))
    want = sorted(sorted(range(16), key=lambda j: (-norms[j], j))[:3])
    assert idx[0].tolist() == want == [2, 5, 9]
    assert idx[1].tolist() == [0, 1, 2]
    assert idx[2].tolist() == [0, 1, 7]
    enc = qjl.encode(x)
    assert np.array_equal(enc.arrays["outlier_idx"], idx)
    assert np.allclose(enc.arrays["outlier_norms"][:4].astype(float),
                       np.linalg.norm(x[:4, [2, 5, 9]], axis=1), rtol=2**-11)
    assert np.all(enc.arrays["norms"][4:8] == 0) and np.all(enc.arrays["outlier_norms"][4:8] == 0)


def test_outlier_groups_are_per_leading_index():
    qjl = QJL(8, n_outlier=1, group=2)
    x = np.zeros((2, 3, 8))
    x[0, :, 3] = 1.0
    x[1, :, 6] = 1.0
    assert qjl.outlier_channels(x)[..., 0].tolist() == [[3, 3], [6, 6]]


def test_keys_are_not_idempotent_values_are():
    key = QJL(32, m=64, m_outlier=16, n_outlier=2)
    assert not key.idempotent and QJL(32, role="value").idempotent
    enc = key.encode(gaussian((8, 32), 12))
    assert key.encode(key.decode(enc)) != enc  # the reconstruction re-sketches differently


@given(st.integers(1, 8), st.sampled_from([1, 8, 32]), st.integers(1, 70),
       hnp.arrays(np.float64, (3, 2, 70), elements=st.floats(-1, 1)), st.sampled_from([1e-5, 1.0, 300.0]))
def test_value_role_is_idempotent(bits, vg, dim, unit, scale):
    qjl = QJL(dim, role="value", value_bits=bits, value_group=vg)
    x = scale * unit[..., :dim]
    enc = qjl.encode(x)
    assert qjl.encode(qjl.decode(enc)) == enc


@pytest.mark.parametrize("bits", range(1, 9))
def test_value_role_rate(bits):
    qjl = QJL(128, role="value", value_bits=bits, value_group=32)
    enc = qjl.encode(gaussian((5, 128), 13))
    assert enc.bits_per_element == 8 * enc.nbytes / enc.elements == bits + 32 / 32
    v = QJL(128, role="value").encode(gaussian((2, 7, 128)))
    assert v.bits_per_element == 3.0 and v.arrays["scales"].shape == (2, 7, 4)


@pytest.mark.parametrize("role", ["key", "value"])
def test_zero_vectors(role):
    qjl = QJL(32, role=role, m=64, m_outlier=16, n_outlier=2)
    z = np.zeros((2, 5, 32))
    enc = qjl.encode(z)
    assert np.array_equal(qjl.decode(enc), np.zeros((2, 5, 32), np.float32))
    assert np.all(qjl.inner_product(gaussian((3, 32)), enc) == 0)


def test_corrupted_encodings_are_refused():
    qjl = QJL(32, m=64, m_outlier=16, n_outlier=3, group=4)
    enc = qjl.encode(gaussian((10, 32), 14))
    a = enc.arrays
    idx = a["outlier_idx"]
    dup, big, order = idx.copy(), idx.copy(), idx.copy()
    dup[0, 1] = dup[0, 0]
    big[1, 2] = 32
    order[2] = order[2][::-1]
    bad = [{k: v for k, v in a.items() if k != "outlier_norms"}, a | {"norms": a["norms"].astype(np.float32)},
           a | {"signs": a["signs"][:, :-1]}, a | {"outlier_idx": idx[:-1]}, a | {"outlier_idx": dup},
           a | {"outlier_idx": big}, a | {"outlier_idx": order}, a | {"norms": np.full_like(a["norms"], np.nan)}]
    for arrays in bad:
        with pytest.raises(ValueError):
            qjl.decode(Encoded(enc.method, enc.config, enc.shape, arrays))
        with pytest.raises(ValueError):
            qjl.inner_product(gaussian(32), Encoded(enc.method, enc.config, enc.shape, arrays))
    for other in (QJL(32, m=64, m_outlier=16, n_outlier=3, group=4, seed=1),
                  QJL(32, m=64, m_outlier=16, n_outlier=3, group=8), QJL(32, role="value")):
        with pytest.raises(ValueError, match="config"):
            other.decode(enc)
    with pytest.raises(ValueError, match="made by"):
        qjl.decode(dataclasses.replace(enc, method="kivi"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(role="query"), "role"), (dict(dim=257), "dim"), (dict(dim=1), "dim"), (dict(dim=0, role="value"), "dim"),
    (dict(m=0), "m"), (dict(m_outlier=0), "m_outlier"), (dict(n_outlier=0), "n_outlier"),
    (dict(n_outlier=64), "n_outlier"), (dict(group=0), "group"), (dict(sketch="srht"), "sketch"),
    (dict(seed=-1), "seed"), (dict(value_bits=9), "value_bits"), (dict(value_group=0), "value_group"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QJL(**(dict(dim=64) | kwargs))


def test_dim_256_keys_and_large_value_dims():
    qjl = QJL(256, m=64, m_outlier=16)
    enc = qjl.encode(keys_with_outliers((40, 256), 15))
    assert enc.arrays["outlier_idx"].max() <= 255
    assert QJL(512, role="value").encode(gaussian((2, 512))).bits_per_element == 3.0


def test_bad_inputs():
    qjl = QJL(16, m=32, m_outlier=8, n_outlier=2)
    with pytest.raises(ValueError, match="at least 2"):
        qjl.encode(gaussian(16))
    with pytest.raises(ValueError, match="last dimension 16"):
        qjl.encode(gaussian((4, 15)))
    x = gaussian((4, 16))
    x[1, 1] = np.nan
    with pytest.raises(ValueError, match="x contains NaN"):
        qjl.encode(x)
    with pytest.raises(ValueError, match="norms overflow"):
        qjl.encode(np.full((2, 16), 3e4))
