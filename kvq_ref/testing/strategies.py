"""Hypothesis strategies for realistic K/V: offsets, outlier channels, heavy tails, zeros, ties.

Real keys have per-channel offsets and a few channels 10-60x larger than the median (:ref:`ref-oscar`,
:ref:`ref-nova-kv`; Gemma's global layers reach 63x), tokens with heavy-tailed norms, and exact zeros; kernels
break on exactly these: a zero row puts every rotated coordinate on the middle threshold, and
values exactly on a threshold or a half step test the tie rules.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = ["kv_arrays", "kv_pairs", "threshold_ties"]


@st.composite
def kv_arrays(draw, d: int, n=st.integers(1, 64), dtype=np.float64, ties=None):
    """Token rows (n, d): offset channels, outlier channels, heavy-tailed norms, zero rows and ties.

    Parameters
    ----------
    d : int
        Row width.
    n : int or strategy
        Number of rows.
    dtype : numpy dtype
        float16 rows are rounded (and kept finite).
    ties : array, optional
        Values written into the rows: a 1-D array (``threshold_ties``: for methods that compare
        their inputs) at random positions, or rows (m, d) (``tie_rows``: for rotated quantizers,
        whose ties are in the rotated domain) replacing 1..min(n, m) random rows.
    """
    n = draw(n) if isinstance(n, st.SearchStrategy) else int(n)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = rng.standard_normal((n, d))
    if draw(st.booleans()):  # per-channel offsets (keys after RoPE keep channel means)
        x += rng.uniform(-3, 3, d)
    k = draw(st.integers(0, min(4, d)))  # outlier channels, 8-64x
    if k:
        x[:, rng.choice(d, k, replace=False)] *= rng.uniform(8, 64, k)
    if draw(st.booleans()):  # heavy-tailed token norms (Student t, 2 degrees of freedom)
        x *= np.abs(rng.standard_t(2, (n, 1))).clip(0.05, 50)
    x *= scale
    zeros = draw(st.lists(st.integers(0, n - 1), max_size=2))
    x[zeros] = 0.0
    ties = None if ties is None else np.asarray(ties, dtype=np.float64)
    if ties is not None and ties.ndim == 2 and ties.size:
        if ties.shape[1] != d:
            raise ValueError(f"ties rows must have d={d} columns, got shape {ties.shape}")
        m = draw(st.integers(1, min(n, ties.shape[0])))
        at = rng.choice(n, m, replace=False)
        x[at] = ties[rng.choice(ties.shape[0], m, replace=False)]  # as they are: scaling would move y off
    elif ties is not None and ties.size:
        pos = rng.integers(0, x.size, min(x.size, 2 * ties.size))
        x.flat[pos] = np.resize(ties, pos.size)
    if np.dtype(dtype) == np.float16:
        x = np.clip(x, -6e4, 6e4)
    return x.astype(dtype)


@st.composite
def kv_pairs(draw, d: int, n=st.integers(1, 64), dtype=np.float64):
    """(K, V) of the same shape from ``kv_arrays`` (values without the key offsets' structure tied)."""
    n = draw(n) if isinstance(n, st.SearchStrategy) else int(n)
    return draw(kv_arrays(d, n, dtype)), draw(kv_arrays(d, n, dtype))


def threshold_ties(thresholds, scale: float = 1.0, step: float | None = None) -> np.ndarray:
    """Values exactly on a quantizer's decision points, for ``kv_arrays(ties=...)``, in the input domain.

    Only for methods that compare their inputs (uniform grids, KIVI's half steps): a rotated
    quantizer never sees these values (use ``kvq_ref.testing.tie_rows``).

    thresholds : a codebook's thresholds (times ``scale``), and with ``step`` the half steps
    ``(k + 1/2) step`` of a uniform grid, k = -4..4 (exact float16 ties of min/max rules).
    """
    out = [np.asarray(thresholds, dtype=np.float64) * scale]
    if step is not None:
        out.append((np.arange(-4, 5) + 0.5) * step)
    return np.concatenate(out)
