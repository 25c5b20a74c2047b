"""Closed-form attention-aware transforms: NOVA-KV keys and values, OSCAR rotations.

Notes
-----
:ref:`ref-nova-kv` (arXiv 2608.04074), :ref:`ref-oscar` (arXiv 2605.17757). Row-vector
convention: a key is a row ``k`` (1, d).

* NOVA-KV keys. With ``S = Sigma_q^(1/2)`` (symmetric) and ``A = S C_k S = V Lambda V^T``
  (Lambda descending), the coefficients are ``c = (k - mu_k) S V`` and the reconstruction is
  ``k_hat = c_hat V^T S^(-1) + mu_k``. For a key error ``e = k - k_hat = dc V^T S^(-1)``:
  ``E[(q.e)^2] = e Sigma_q e^T = dc dc^T`` (generalized Parseval), so plain MSE in c-space is the
  logit MSE, and the coefficient variances are Lambda. The query is multiplied once:
  ``q . k_hat = q_m . c_hat + q . mu_k`` with ``q_m = q S^(-1) V`` (``= V^T Sigma_q^(-1/2) q``).
  Optimality (derived): at high rate with the best bit allocation, a transform T gives
  ``D ~ (prod_i (T^-T Sigma_q T^-1)_ii (T C_k T^T)_ii)^(1/d)``; Hadamard's inequality bounds it
  below by ``(det Sigma_q det C_k)^(1/d)``, which this transform attains; a rotation attains it
  only when Sigma_q and C_k commute.
* NOVA-KV values: the score-weighted KLT, eigenvectors U of the covariance of v under
  ``omega_t = E[s_t^2]``; coefficients ``c = (v - mu_v) U`` (orthogonal).
* OSCAR: ``R = U H P_br`` with U the eigenvectors of Sigma_q (keys) or of the score-weighted
  value covariance (values, proxy weights E[s_t]), H the normalized Sylvester Hadamard matrix and
  ``P_br`` the bit-reversal permutation of the columns; ``y = x R``.

Numerics: eigen-decompositions in float64 (``numpy.linalg.eigh``); eigenvalues of Sigma_q below
``rel_floor * max`` are raised to that floor (rank-deficient Sigma_q: query-null directions cost
nothing and get ~zero coefficient variance) and the number raised is reported; tiny negative
eigenvalues of A from rounding are clipped to 0. NaN statistics raise ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.linalg import hadamard

from .calibration import HeadStats

__all__ = ["KeyTransform", "ValueTransform", "nova_key_transform", "nova_value_transform", "oscar_rotation",
           "bit_reversal", "DEFAULT_REL_FLOOR"]

DEFAULT_REL_FLOOR = 1e-8


def _sym(name: str, m, d: int | None = None) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or (d is not None and m.shape[0] != d):
        raise ValueError(f"{name} must be a square (d, d) matrix, got shape {m.shape}")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} contains NaN/Inf")
    return 0.5 * (m + m.T)


def _eig_desc(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and eigenvectors (columns) of a symmetric matrix; each vector's
    largest-magnitude entry is made positive so the basis is deterministic."""
    lam, vec = np.linalg.eigh(m)
    order = np.argsort(lam, kind="stable")[::-1]
    lam, vec = lam[order], vec[:, order]
    idx = np.argmax(np.abs(vec), axis=0)
    vec = vec * np.sign(vec[idx, np.arange(vec.shape[1])])
    return lam, vec


@dataclass(frozen=True, eq=False)
class KeyTransform:
    """NOVA-KV key transform of one head.

    Attributes
    ----------
    mu : ndarray, shape (d,)
        Key mean.
    forward : ndarray, shape (d, d)
        ``S V``: coefficients ``c = (k - mu) @ forward``.
    inverse : ndarray, shape (d, d)
        ``V^T S^-1``: ``k_hat = c_hat @ inverse + mu``; queries map as ``q_m = q @ inverse.T``.
    variances : ndarray, shape (d,)
        Coefficient variances (eigenvalues of A, descending, >= 0).
    floor : float
        Eigenvalue floor applied to Sigma_q.
    n_floored : int
        How many eigenvalues of Sigma_q were raised to the floor.
    """

    mu: np.ndarray
    forward: np.ndarray
    inverse: np.ndarray
    variances: np.ndarray
    floor: float
    n_floored: int

    def coefficients(self, k: np.ndarray) -> np.ndarray:
        return (np.asarray(k, dtype=np.float64) - self.mu) @ self.forward

    def reconstruct(self, c: np.ndarray) -> np.ndarray:
        return np.asarray(c, dtype=np.float64) @ self.inverse + self.mu

    def query(self, q: np.ndarray) -> np.ndarray:
        """``q_m`` such that ``q . k_hat = q_m . c_hat + q . mu``."""
        return np.asarray(q, dtype=np.float64) @ self.inverse.T


@dataclass(frozen=True, eq=False)
class ValueTransform:
    """NOVA-KV value transform (score-weighted KLT): ``c = (v - mu) @ basis``, ``v_hat = c_hat @ basis.T + mu``."""

    mu: np.ndarray
    basis: np.ndarray
    variances: np.ndarray

    def coefficients(self, v: np.ndarray) -> np.ndarray:
        return (np.asarray(v, dtype=np.float64) - self.mu) @ self.basis

    def reconstruct(self, c: np.ndarray) -> np.ndarray:
        return np.asarray(c, dtype=np.float64) @ self.basis.T + self.mu


def nova_key_transform(sigma_q, mu_k, cov_k, rel_floor: float = DEFAULT_REL_FLOOR) -> KeyTransform:
    """The NOVA-KV key transform from query and key statistics.

    Parameters
    ----------
    sigma_q : array_like, shape (d, d)
        ``E[q q^T]`` of the pooled queries.
    mu_k : array_like, shape (d,)
    cov_k : array_like, shape (d, d)
    rel_floor : float
        Relative eigenvalue floor for Sigma_q (> 0).

    Returns
    -------
    KeyTransform
    """
    sq = _sym("sigma_q", sigma_q)
    d = sq.shape[0]
    ck = _sym("cov_k", cov_k, d)
    mu = np.asarray(mu_k, dtype=np.float64)
    if mu.shape != (d,) or not np.all(np.isfinite(mu)):
        raise ValueError(f"mu_k must be a finite vector of length {d}")
    if not 0 < rel_floor < 1:
        raise ValueError(f"rel_floor must be in (0, 1), got {rel_floor!r}")
    lam_q, w = _eig_desc(sq)
    if lam_q[0] <= 0:
        raise ValueError("sigma_q has no positive eigenvalue (no query energy)")
    floor = rel_floor * lam_q[0]
    n_floored = int(np.count_nonzero(lam_q < floor))
    lam_q = np.maximum(lam_q, floor)
    s = (w * np.sqrt(lam_q)) @ w.T
    s_inv = (w / np.sqrt(lam_q)) @ w.T
    lam, v = _eig_desc(_sym("A", s @ ck @ s))
    return KeyTransform(mu=mu, forward=s @ v, inverse=v.T @ s_inv, variances=np.maximum(lam, 0.0),
                        floor=float(floor), n_floored=n_floored)


def nova_value_transform(mu_v, cov_v) -> ValueTransform:
    """The score-weighted KLT of the values.

    Parameters
    ----------
    mu_v : array_like, shape (d,)
        Score-weighted value mean.
    cov_v : array_like, shape (d, d)
        Score-weighted value covariance (weights ``E[s_t^2]``).
    """
    c = _sym("cov_v", cov_v)
    mu = np.asarray(mu_v, dtype=np.float64)
    if mu.shape != (c.shape[0],) or not np.all(np.isfinite(mu)):
        raise ValueError(f"mu_v must be a finite vector of length {c.shape[0]}")
    lam, u = _eig_desc(c)
    return ValueTransform(mu=mu, basis=u, variances=np.maximum(lam, 0.0))


def bit_reversal(d: int) -> np.ndarray:
    """The bit-reversal permutation of ``range(d)`` (d a power of two)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"bit reversal needs a power-of-two dimension, got {d}")
    m = d.bit_length() - 1
    return np.array([int(format(i, f"0{m}b")[::-1], 2) if m else 0 for i in range(d)])


def oscar_rotation(cov) -> np.ndarray:
    """OSCAR's ``R = U H P_br`` for a symmetric statistic ``cov`` (Sigma_q or a value covariance).

    Returns
    -------
    ndarray, shape (d, d), orthogonal; rotated rows are ``y = x @ R``.
    """
    c = _sym("cov", cov)
    d = c.shape[0]
    if d & (d - 1):
        raise ValueError(f"OSCAR's Hadamard step needs a power-of-two head dimension, got {d}")
    _, u = _eig_desc(c)
    rot = u @ (hadamard(d) / math.sqrt(d))
    return rot[:, bit_reversal(d)]


def head_transforms(stats: HeadStats, rel_floor: float = DEFAULT_REL_FLOOR) -> dict:
    """All transforms of one head: NOVA-KV key/value and OSCAR key/value rotations."""
    stats.check()
    return {
        "key": nova_key_transform(stats.sigma_q, stats.keys.mean, stats.keys.cov, rel_floor),
        "value": nova_value_transform(stats.values_s2.mean, stats.values_s2.cov),
        "oscar_key": oscar_rotation(stats.sigma_q),
        "oscar_value": oscar_rotation(stats.values_s1.cov),
    }
