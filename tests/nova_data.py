"""Synthetic anisotropic attention data for NOVA-KV/OSCAR tests (Sigma_q and C_k do not commute)."""

import numpy as np


def generator(d: int, seed: int = 0):
    """Fixed mixing matrices: queries with a few strong directions, keys with decaying variances in a
    random basis plus a channel offset, values independent."""
    rng = np.random.default_rng(seed)
    a = 0.3 * np.eye(d) + 0.1 * rng.standard_normal((d, d))
    a[:, : max(1, d // 16)] *= 8.0
    qk, _ = np.linalg.qr(rng.standard_normal((d, d)))
    b = qk * np.geomspace(3.0, 0.05, d)
    qv, _ = np.linalg.qr(rng.standard_normal((d, d)))
    c = qv * np.geomspace(2.0, 0.1, d)
    offset = rng.normal(0.0, 1.0, d)
    return a, b, c, offset


def sequence(gen, hq: int, hkv: int, t: int, seed: int) -> dict:
    """One sequence {0: (q (hq, t, d), k (hkv, t, d), v (hkv, t, d))}."""
    a, b, c, offset = gen
    d = a.shape[0]
    rng = np.random.default_rng(1000 + seed)
    q = rng.standard_normal((hq, t, d)) @ a.T
    k = rng.standard_normal((hkv, t, d)) @ b.T + offset
    v = rng.standard_normal((hkv, t, d)) @ c.T
    return {0: (q, k, v)}
