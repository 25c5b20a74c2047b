"""The weighted empirical density: discrete data-driven codebooks.

Notes
-----
``Empirical(samples, weights)`` is a weighted discrete distribution; cells are half-open ``(a, b]``
(a sample on a threshold belongs to the lower cell, the quantizer's tie rule). Its codebooks are
solved by exact discrete Lloyd (``codebooks.solver``), and table files store it as
``(values, masses)``, which rebuild it bit for bit.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ._validate import finite_array
from .densities import SCALE_RANGE, Density

__all__ = ["Empirical"]


@dataclass(frozen=True, repr=False, eq=False)
class Empirical(Density):
    """Weighted empirical distribution of 1-D samples, for data-driven codebooks.

    Parameters
    ----------
    samples : array_like, shape (n,)
        Finite real samples with at least two distinct values.
    weights : array_like, shape (n,), optional
        Non-negative finite weights with a positive sum (default: equal weights).

    Notes
    -----
    Duplicates are merged: ``values`` (sorted, unique), ``masses`` (their summed weights) and
    ``probs = masses / masses.sum()`` hold the distribution; ``Empirical(values, masses)``
    rebuilds it bit for bit (this is what table files store). Cells are half-open ``(a, b]``.
    """

    samples: np.ndarray
    weights: np.ndarray | None = None
    values: np.ndarray = field(init=False)
    masses: np.ndarray = field(init=False)
    probs: np.ndarray = field(init=False)
    kind: ClassVar[str] = "empirical"
    is_discrete: ClassVar[bool] = True

    def __post_init__(self):
        x = finite_array("samples", self.samples, ndim=1, min_size=1)
        if self.weights is None:
            w = np.ones_like(x)
        else:
            w = finite_array("weights", self.weights, ndim=1, min_size=1)
            if w.shape != x.shape:
                raise ValueError(f"weights must have the shape of samples {x.shape}, got {w.shape}")
            if np.any(w < 0):
                raise ValueError("weights must be >= 0")
        keep = w > 0
        values, inverse = np.unique(x[keep], return_inverse=True)
        if values.size < 2:
            raise ValueError(
                "samples must contain at least 2 distinct values with positive weight "
                f"(got {values.size}); a constant sample has no codebook to solve"
            )
        spread, size = float(values[-1] - values[0]), float(np.max(np.abs(values)))
        if not (SCALE_RANGE[0] <= spread and size <= SCALE_RANGE[1]):
            raise ValueError(f"samples must span at least {SCALE_RANGE[0]:g} and stay within +-{SCALE_RANGE[1]:g} "
                             f"(got span {spread!r}, largest magnitude {size!r}): the distortion would leave the "
                             "normal float64 range; rescale the data")
        wk = w[keep]
        with np.errstate(over="ignore"):
            masses = np.bincount(inverse, weights=wk, minlength=values.size)
            if not (np.all(np.isfinite(masses)) and np.isfinite(masses.sum())):
                # sums overflow: rescale by a power of two (exact), so masses stay a faithful record
                wk = np.ldexp(wk, -math.frexp(float(wk.max()))[1] - int(math.ceil(math.log2(wk.size))) - 1)
                masses = np.bincount(inverse, weights=wk, minlength=values.size)
        rel = masses / masses.max()  # scale-invariant: no overflow or underflow of the total
        probs = rel / rel.sum()
        for name, arr in (("samples", x), ("weights", w), ("values", values), ("masses", masses),
                          ("probs", probs)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    def __eq__(self, other):
        return (isinstance(other, Empirical) and np.array_equal(self.values, other.values)
                and np.array_equal(self.masses, other.masses))

    __hash__ = None  # type: ignore[assignment]

    @property
    def digest(self) -> str:
        """sha256 of (values, masses) as little-endian float64: identifies the distribution."""
        h = hashlib.sha256()
        h.update(self.values.astype("<f8").tobytes())
        h.update(self.masses.astype("<f8").tobytes())
        return h.hexdigest()

    @property
    def support(self):
        return (float(self.values[0]), float(self.values[-1]))

    @property
    def mean(self):
        return float(np.dot(self.probs, self.values))

    @property
    def var(self):
        return float(np.dot(self.probs, (self.values - self.mean) ** 2))

    def params(self):
        return {"n_values": int(self.values.size), "sha256": self.digest}

    @property
    def label(self):
        return f"empirical_{self.digest[:12]}"

    def cdf(self, x):
        c = np.concatenate([[0.0], np.cumsum(self.probs)])
        return c[np.searchsorted(self.values, np.asarray(x, dtype=np.float64), side="right")]

    def sf(self, x):
        c = np.concatenate([np.cumsum(self.probs[::-1])[::-1], [0.0]])
        return c[np.searchsorted(self.values, np.asarray(x, dtype=np.float64), side="right")]

    def cell_moments(self, a, b):
        a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
        ia = np.searchsorted(self.values, a.ravel(), side="right")
        ib = np.searchsorted(self.values, b.ravel(), side="right")
        out = np.zeros((3, a.size))
        for j, (lo, hi) in enumerate(zip(ia, ib)):
            if hi > lo:
                v, p = self.values[lo:hi], self.probs[lo:hi]
                out[:, j] = (p.sum(), np.dot(p, v), np.dot(p, v * v))
        return tuple(o.reshape(a.shape) for o in out)

    def _compander(self, p):
        cum = np.cumsum(self.probs)
        idx = np.searchsorted(cum, np.asarray(p, dtype=np.float64) * cum[-1])
        return self.values[np.clip(idx, 0, self.values.size - 1)]
