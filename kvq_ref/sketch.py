"""The 1-bit QJL sketch: ``sign(S v)`` and ``||v||`` with an unbiased inner-product estimator.

Notes
-----
QJL (arXiv 2406.03482), :ref:`ref-qjl`. With rows ``s_j`` drawn so that ``s`` is rotation
invariant, ``E[(s.q) sign(s.v)] = kappa <q, v> / ||v||`` where ``kappa = E|s_1|``. Hence

    est(q, v) = ||v|| / (m kappa) * sum_j (s_j . q) sign(s_j . v)

is unbiased, and ``v_hat = ||v|| / (m kappa) * S^T sign(S v)`` reconstructs v in mean.

* ``kind="gaussian"``: i.i.d. N(0, 1) entries, ``kappa = sqrt(2/pi)``; the estimator's variance is
  exactly ``((pi/2) ||q||^2 ||v||^2 - <q, v>^2) / m`` (``theory.qjl_variance``).
* ``kind="orthogonal"``: rows in blocks of d, each block ``sqrt(d) Q`` with Q Haar orthogonal (QR
  per block, as QJL's code orthogonalizes per chunk); each row is uniform on the sphere of radius
  sqrt(d), so ``kappa = sqrt(d) E|X|`` with X ~ SphereMarginal(d), and it is unbiased too.

``constant="official"``: QJL's released code scales by ``sqrt(pi/2) / m`` (``kappa = sqrt(2/pi)``)
for every kind. With orthogonal rows that estimator is biased by ``kappa_orth / sqrt(2/pi)``:
x1.00196 at d = 128 (exact; ``benchmarks/results/fidelity.json`` measures x1.00195 +- 0.00002 by Monte
Carlo; the official facts quote x1.0018 from a smaller sample); ours (``"unbiased"``) divides by the
rows' own kappa and is unbiased. For Gaussian rows the two agree.

A zero vector has no direction: its signs are stored as +1 (sign(0) := +1, kernels must match)
and its norm as 0, so it decodes and scores to exactly 0.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .rotations import rng

__all__ = ["QJLSketch", "sketch_matrix"]


@lru_cache(maxsize=64)
def sketch_matrix(m: int, d: int, kind: str, seed: int, stream: int) -> tuple[np.ndarray, float]:
    """The m x d sketch matrix and its constant kappa (cached, read-only)."""
    g = rng(seed, stream)
    if kind == "gaussian":
        S = g.standard_normal((m, d))
        kappa = math.sqrt(2.0 / math.pi)
    elif kind == "orthogonal":
        blocks = []
        for _ in range(-(-m // d)):
            q, r = np.linalg.qr(g.standard_normal((d, d)))
            blocks.append(math.sqrt(d) * (q * np.sign(np.diag(r))).T)
        S = np.concatenate(blocks)[:m]
        kappa = math.sqrt(d) * math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    else:
        raise ValueError(f"sketch kind must be 'gaussian' or 'orthogonal', got {kind!r}")
    S.setflags(write=False)
    return S, kappa


class QJLSketch:
    """A fixed sketch ``S`` (m x d) with encode/estimate/reconstruct on the last axis.

    Parameters
    ----------
    m, d : int
        Rows and dimension.
    kind : {"gaussian", "orthogonal"}
    seed : int
    stream : int
        Random stream (see ``kvq_ref.rotations.rng``); separate sketches use separate streams.
    constant : {"unbiased", "official"}
        The estimator's scale (module Notes).
    """

    def __init__(self, m: int, d: int, kind: str = "gaussian", seed: int = 0, stream: int = 2,
                 constant: str = "unbiased"):
        if constant not in ("unbiased", "official"):
            raise ValueError(f"constant must be 'unbiased' or 'official', got {constant!r}")
        self.m, self.d, self.kind = int(m), int(d), kind
        self.S, self.kappa = sketch_matrix(self.m, self.d, kind, int(seed), int(stream))
        if constant == "official":
            self.kappa = math.sqrt(2.0 / math.pi)

    def signs(self, v: np.ndarray) -> np.ndarray:
        """``sign(S v) > 0`` as booleans (True for +1; sign(0) counts as +1), shape (..., m)."""
        return (np.asarray(v, dtype=np.float64) @ self.S.T) >= 0.0

    def estimate(self, q: np.ndarray, signs: np.ndarray, norms: np.ndarray) -> np.ndarray:
        """Unbiased ``<q, v>`` for queries ``q`` (M, d) and sketched vectors (N, m), (N,): (M, N)."""
        pm = np.where(signs, 1.0, -1.0)
        return (q @ self.S.T) @ pm.T * (norms / (self.m * self.kappa))

    def reconstruct(self, signs: np.ndarray, norms: np.ndarray) -> np.ndarray:
        """``||v|| / (m kappa) S^T sign(S v)``: the mean-unbiased reconstruction, shape (..., d)."""
        pm = np.where(signs, 1.0, -1.0)
        return (pm @ self.S) * (np.asarray(norms, dtype=np.float64)[..., None] / (self.m * self.kappa))
