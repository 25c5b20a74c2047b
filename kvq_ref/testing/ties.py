"""Rows whose rotated coordinates sit exactly on a quantizer's thresholds: ties where the comparison is.

Notes
-----
A rotated quantizer (TurboQuantMSE, TurboBlock) compares ``y = R x / ||x||`` with its thresholds,
so threshold values written into ``x`` are no ties at all (issue 53: 0 of 4,963 such rows put a
rotated coordinate on a non-zero threshold, and an encoder with the wrong tie rule passed). Here
the target is built in the rotated domain and rotated back: ``y0`` has ``k = max(1, d / 8)``
coordinates set to thresholds (drawn from all of them, 0 included) and the rest Gaussian, scaled to
``||y0|| = 1``; ``x = s R^T y0`` with a random scale ``s``. Rounding leaves ``y`` a few ulps off,
so ``x`` is corrected ``iterations`` times by ``||x|| R^T (t - y)`` on the tied coordinates
(``y`` as the quantizer's own ``compared`` computes it, in its arithmetic; for float32
arithmetic ``x`` is rounded to float32 after every step, as the encoder rounds its input). The
iterate with the most exact ties is kept; rows without one are drawn again. With 8 steps every row
of the shipped quantizers had several (about 8 of 16 at d = 128).
"""

from __future__ import annotations

import numpy as np

__all__ = ["tie_rows"]


def _attempt(q, n: int, rng, iterations: int):
    d = q.dim
    thr = np.asarray(q.compared(np.ones((1, d)))[1])
    f32 = thr.dtype == np.float32
    t64 = thr.astype(np.float64)
    k = max(1, d // 8)
    rows = np.arange(n)[:, None]
    pos = np.argsort(rng.random((n, d)), axis=1)[:, :k]
    tv = t64[rng.integers(0, t64.size, (n, k))]
    y0 = rng.standard_normal((n, d))
    y0[rows, pos] = 0.0
    y0 *= (np.sqrt(np.maximum(1.0 - np.sum(tv**2, axis=1), 0.1)) / np.linalg.norm(y0, axis=1))[:, None]
    y0[rows, pos] = tv
    x = q.rot.inverse(y0) * np.exp(rng.uniform(-2, 2, (n, 1)))
    best, best_x = np.full(n, -1), x.copy()
    for _ in range(iterations + 1):
        if f32:
            x = x.astype(np.float32).astype(np.float64)
        y = np.asarray(q.compared(x)[0])
        hits = np.sum(y[rows, pos] == tv.astype(thr.dtype), axis=1)
        better = hits > best
        best[better], best_x[better] = hits[better], x[better]
        err = np.zeros((n, d))
        err[rows, pos] = tv - y[rows, pos].astype(np.float64)
        x = x + q.rot.inverse(err) * np.linalg.norm(x, axis=1, keepdims=True)
    return best_x[best > 0]


def tie_rows(q, n: int = 16, seed: int = 0, iterations: int = 8) -> np.ndarray:
    """``n`` rows (n, q.dim), float64, each with coordinates exactly on ``q``'s thresholds where ``q``
    compares them (module Notes).

    Parameters
    ----------
    q : a quantizer with ``dim``, ``rot`` (``inverse``) and ``compared(x) -> (y, thresholds)``
        (TurboQuantMSE, TurboBlock).
    n, seed, iterations : rows, their seed, correction steps.

    Returns
    -------
    ndarray (n, d) float64 (float32 values when ``q`` compares in float32). Use them as inputs (e.g.
    ``kv_arrays(d, ties=tie_rows(q))``): an encoder that breaks ties the other way writes other codes.

    Raises
    ------
    TypeError
        ``q`` has no ``compared`` (it does not quantize rotated coordinates against thresholds).
    ValueError
        ``n`` < 1, or no exact tie was reached in 20 rounds.
    """
    if not callable(getattr(q, "compared", None)) or not hasattr(q, "rot"):
        raise TypeError(f"q must quantize rotated coordinates against thresholds (have compared() and rot), "
                        f"got {type(q).__name__}; for methods that compare their inputs use threshold_ties")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    rng = np.random.default_rng([seed, 53])
    out: list[np.ndarray] = []
    for _ in range(20):
        out.append(_attempt(q, n, rng, iterations))
        if sum(len(r) for r in out) >= n:
            return np.concatenate(out)[:n]
    raise ValueError(f"no rotated coordinate of {type(q).__name__} reached a threshold exactly in 20 rounds")
