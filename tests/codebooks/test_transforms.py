"""NOVA-KV / OSCAR transforms: generalized Parseval, the Hadamard-inequality optimum, robustness."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import hadamard

from codebooks import Gaussian, lloyd_max
from codebooks.transforms import bit_reversal, nova_key_transform, nova_value_transform, oscar_rotation
from theory import reverse_water_filling

D = 16


def _stats(d, seed, commute=False):
    """Sigma_q and C_k that do not commute (or do, sharing an eigenbasis)."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((d, d)))
    w, _ = np.linalg.qr(rng.standard_normal((d, d)))
    sq = (u * np.geomspace(10, 0.1, d)) @ u.T
    ck = ((u if commute else w) * np.geomspace(4, 0.01, d)) @ (u if commute else w).T
    return sq, rng.normal(0, 1, d), ck


def test_generalized_parseval():
    sq, mu, ck = _stats(D, 0)
    t = nova_key_transform(sq, mu, ck)
    rng = np.random.default_rng(1)
    dc = rng.standard_normal((50, D))
    e = dc @ t.inverse  # a key error made by a coefficient error dc
    lhs = np.einsum("ni,ij,nj->n", e, sq, e)
    assert np.allclose(lhs, np.sum(dc**2, axis=1), rtol=1e-10, atol=0)
    # coefficient covariance is diag(variances), reconstruction inverts, queries fold the inverse
    assert np.allclose(t.forward.T @ ck @ t.forward, np.diag(t.variances), atol=1e-10)
    k = rng.standard_normal((5, D))
    assert np.allclose(t.reconstruct(t.coefficients(k)), k, atol=1e-12)
    q = rng.standard_normal((3, D))
    c = t.coefficients(k)
    assert np.allclose(q @ t.reconstruct(c).T, t.query(q) @ c.T + (q @ mu)[:, None], atol=1e-10)


def _high_rate_factor(F, G, sq, ck):
    """(prod_i (G Sigma_q G^T)_ii (F^T C_k F)_ii)^(1/d): the high-rate, optimally allocated logit MSE
    of coding c = (k - mu) F independently and reconstructing c_hat G, up to the common factor
    d kappa 4^-b."""
    return np.exp(np.mean(np.log(np.diag(G @ sq @ G.T)) + np.log(np.diag(F.T @ ck @ F))))


def _rotations(sq, ck, d, seed):
    rng = np.random.default_rng(seed)
    haar, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return {"identity": np.eye(d), "random": haar, "hadamard": hadamard(d) / np.sqrt(d),
            "klt_k": np.linalg.eigh(ck)[1], "eig_sigma_q": np.linalg.eigh(sq)[1]}


def test_nova_attains_the_hadamard_inequality_bound_and_rotations_do_not():
    sq, mu, ck = _stats(D, 2)
    bound = np.exp((np.linalg.slogdet(sq)[1] + np.linalg.slogdet(ck)[1]) / D)
    t = nova_key_transform(sq, mu, ck)
    assert _high_rate_factor(t.forward, t.inverse, sq, ck) == pytest.approx(bound, rel=1e-10)
    for name, r in _rotations(sq, ck, D, 3).items():  # c = k R, k_hat = c R^T
        assert _high_rate_factor(r, r.T, sq, ck) > 1.05 * bound, name


def test_commuting_statistics_let_the_best_rotation_match():
    sq, mu, ck = _stats(D, 4, commute=True)
    bound = np.exp((np.linalg.slogdet(sq)[1] + np.linalg.slogdet(ck)[1]) / D)
    r = np.linalg.eigh(sq)[1]
    assert _high_rate_factor(r, r.T, sq, ck) == pytest.approx(bound, rel=1e-9)
    t = nova_key_transform(sq, mu, ck)
    assert _high_rate_factor(t.forward, t.inverse, sq, ck) == pytest.approx(bound, rel=1e-10)


def _code(x, std, bits):
    """Scalar Lloyd-Max quantization of Gaussian coefficients with per-coefficient integer bits."""
    out = np.zeros_like(x)
    for i in range(x.shape[1]):
        if bits[i] > 0 and std[i] > 0:
            cb = lloyd_max(Gaussian(float(std[i])), int(bits[i]))
            out[:, i] = cb.levels[cb.quantize(x[:, i])]
    return out


def _integer_allocation(var, total):
    wf = reverse_water_filling(np.maximum(var, 1e-30), float(total))
    bits = np.floor(wf.bits).astype(int)
    frac = wf.bits - bits
    for i in np.argsort(-frac)[: total - bits.sum()]:
        bits[i] += 1
    return np.minimum(bits, 12)


def test_held_out_logit_mse_nova_beats_every_rotation_at_the_same_bits():
    """Same scheme in every coefficient space: water-filled integer bits (3 per coefficient on
    average) and Gaussian Lloyd-Max tables; held-out Gaussian keys and queries."""
    sq, mu, ck = _stats(D, 5)
    rng = np.random.default_rng(6)
    n = 4000
    k = rng.multivariate_normal(mu, ck, n)
    q = rng.multivariate_normal(np.zeros(D), sq, 400)
    t = nova_key_transform(sq, mu, ck)
    spaces = {"nova": (t.forward, t.inverse)}
    spaces.update({name: (r, r.T) for name, r in _rotations(sq, ck, D, 7).items()})
    mse = {}
    for name, (F, G) in spaces.items():
        c = (k - mu) @ F
        var = np.diag(F.T @ ck @ F)
        bits = _integer_allocation(var, 3 * D)
        khat = _code(c, np.sqrt(var), bits) @ G + mu
        mse[name] = float(np.mean((q @ (k - khat).T) ** 2))
    assert all(mse["nova"] < 0.8 * v for name, v in mse.items() if name != "nova"), mse


def test_rank_deficient_sigma_q_is_floored_and_reported():
    sq, mu, ck = _stats(D, 8)
    u = np.linalg.eigh(sq)[1]
    sq_low = (u[:, -4:] * np.array([1.0, 2.0, 3.0, 4.0])) @ u[:, -4:].T  # rank 4
    t = nova_key_transform(sq_low, mu, ck, rel_floor=1e-8)
    assert t.n_floored == D - 4 and t.floor == pytest.approx(4e-8, rel=1e-6)
    assert np.all(np.isfinite(t.forward)) and np.all(np.isfinite(t.inverse))
    # S^-1 Sigma_q S^-1 is the projector onto the queries' range, so e Sigma_q e^T = ||P dc||^2:
    # at most ||dc||^2, with equality on the coefficients of the 4 directions queries use
    dc = np.random.default_rng(9).standard_normal((10, D))
    e = dc @ t.inverse
    lhs = np.einsum("ni,ij,nj->n", e, sq_low, e)
    assert np.all(lhs <= np.sum(dc**2, axis=1) * (1 + 1e-9))
    seen = t.inverse @ sq_low @ t.inverse.T  # G Sigma_q G^T: the projector in coefficient space
    w, vec = np.linalg.eigh(seen)
    assert np.sum(w > 1e-6) == 4 and np.allclose(w[w > 1e-6], 1.0, atol=1e-6)
    dc_seen = vec[:, w > 1e-6].T  # coefficient errors inside the visible subspace
    e2 = dc_seen @ t.inverse
    assert np.allclose(np.einsum("ni,ij,nj->n", e2, sq_low, e2), np.sum(dc_seen**2, axis=1), rtol=1e-6)


def test_value_transform_is_the_weighted_klt():
    sq, mu, ck = _stats(D, 10)
    v = nova_value_transform(mu, ck)
    assert np.allclose(v.basis.T @ v.basis, np.eye(D), atol=1e-12)
    assert np.allclose(v.basis.T @ ck @ v.basis, np.diag(v.variances), atol=1e-10)
    assert np.all(np.diff(v.variances) <= 0)


def test_oscar_rotation():
    assert list(bit_reversal(8)) == [0, 4, 2, 6, 1, 5, 3, 7]
    sq, _, _ = _stats(D, 11)
    r = oscar_rotation(sq)
    assert np.allclose(r @ r.T, np.eye(D), atol=1e-12)
    u = np.linalg.eigh(sq)[1][:, ::-1]
    u = u * np.sign(u[np.argmax(np.abs(u), axis=0), np.arange(D)])
    assert np.allclose(r, (u @ hadamard(D) / 4.0)[:, bit_reversal(D)], atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two head dimension"):
        oscar_rotation(np.eye(12))


def test_bad_statistics():
    sq, mu, ck = _stats(D, 12)
    bad = sq.copy()
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="sigma_q contains NaN"):
        nova_key_transform(bad, mu, ck)
    with pytest.raises(ValueError, match="cov_k must be a square"):
        nova_key_transform(sq, mu, ck[:4, :4])
    with pytest.raises(ValueError, match="mu_k must be a finite vector of length 16"):
        nova_key_transform(sq, mu[:3], ck)
    with pytest.raises(ValueError, match="no query energy"):
        nova_key_transform(np.zeros((D, D)), mu, ck)
