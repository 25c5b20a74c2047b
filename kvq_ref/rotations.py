"""Seeded orthogonal rotations: Haar (dense) and randomized (block-)Hadamard (fast).

Randomness: ``rng(seed, stream)`` is ``np.random.default_rng([seed, stream])``; every consumer has
its own stream number, so the same seed always gives the same rotation, and rotations, sketches
and outlier choices never share random draws.

Randomized Hadamard, for ``d = m * 2^k`` with m odd (block size ``b = 2^k``)::

    y = D2 . H_b . P . D1 . x

``D1, D2``: diagonal random signs; ``P``: a random permutation of the coordinates when m > 1 (it
spreads neighbouring channels over different blocks), the identity when d is a power of two;
``H_b``: block-diagonal normalized Walsh-Hadamard matrices of size b (Sylvester order), applied by
the fast transform. For d a power of two this is the two-sign form ``D2 (H/sqrt(d)) D1`` used by
production kernels. Kernels must apply exactly this sequence: ``x[..., perm]`` after ``D1``, the
butterflies ``(a, b) -> (a + b, a - b)`` over h = 1, 2, 4, ... within each block, then the scale
``1/sqrt(b)`` and ``D2``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
from numba import njit, prange

from .threads import rows_parallel

__all__ = ["Rotation", "HaarRotation", "HadamardRotation", "MatrixRotation", "make_rotation", "rng", "fwht", "fwht_row",
           "hadamard_block_size", "STREAM_ROTATION", "STREAM_SKETCH", "STREAM_OUTLIER_SKETCH",
           "STREAM_MISC"]

STREAM_ROTATION = 1
STREAM_SKETCH = 2
STREAM_OUTLIER_SKETCH = 3
STREAM_MISC = 4


def rng(seed: int, stream: int) -> np.random.Generator:
    """The generator for ``seed`` and a consumer's ``stream`` number."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng([int(seed), int(stream)])


def hadamard_block_size(d: int) -> int:
    """Largest power of two dividing ``d``."""
    return d & -d


@njit(cache=True)
def fwht_row(x, block):
    """In-place unnormalized Walsh-Hadamard transform of one row, in blocks of ``block``.

    Butterflies ``(a, b) -> (a + b, a - b)`` for h = 1, 2, 4, ... (Sylvester order).
    """
    d = x.shape[0]
    for start in range(0, d, block):
        h = 1
        if block >= 4:  # stages h = 1 and 2 fused per group of 4 (the same operations, in order)
            for j in range(start, start + block, 4):
                a = x[j] + x[j + 1]
                b = x[j] - x[j + 1]
                c = x[j + 2] + x[j + 3]
                e = x[j + 2] - x[j + 3]
                x[j] = a + c
                x[j + 1] = b + e
                x[j + 2] = a - c
                x[j + 3] = b - e
            h = 4
        while h < block:
            for j in range(start, start + block, 2 * h):
                for i in range(j, j + h):
                    a = x[i]
                    b = x[i + h]
                    x[i] = a + b
                    x[i + h] = a - b
            h *= 2


@rows_parallel
@njit(parallel=True, cache=True)
def _fwht_rows(x, block):
    for r in prange(x.shape[0]):
        fwht_row(x[r], block)


def fwht(x: np.ndarray, block: int | None = None) -> np.ndarray:
    """Normalized (orthonormal) Walsh-Hadamard transform along the last axis, blockwise.

    Parameters
    ----------
    x : ndarray, shape (..., d)
    block : int, optional
        Power of two dividing d (default: d, which must then be a power of two).

    Returns
    -------
    ndarray, float64, same shape (a new array)
    """
    d = x.shape[-1]
    block = d if block is None else block
    if block < 1 or block & (block - 1) or d % block:
        raise ValueError(f"block must be a power of two dividing d={d}, got {block}")
    y = np.array(x, dtype=np.float64, order="C").reshape(-1, d)
    _fwht_rows(y, block)
    y *= 1.0 / math.sqrt(block)
    return y.reshape(x.shape)


class Rotation(ABC):
    """An orthogonal map of R^d applied along the last axis."""

    def __init__(self, d: int, seed: int):
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
            raise ValueError(f"d must be a positive integer, got {d!r}")
        self.d = int(d)
        self.seed = int(seed)

    @abstractmethod
    def apply(self, x: np.ndarray) -> np.ndarray:
        """``R x`` for every vector of ``x`` (shape (..., d)), float64."""

    @abstractmethod
    def inverse(self, y: np.ndarray) -> np.ndarray:
        """``R^T y``."""

    def matrix(self) -> np.ndarray:
        """The dense d x d matrix R (for tests and small problems)."""
        return self.apply(np.eye(self.d)).T

    def _check(self, x):
        if x.shape[-1] != self.d:
            raise ValueError(f"rotation of dimension {self.d} applied to shape {x.shape}")


class HaarRotation(Rotation):
    """Uniform random orthogonal matrix: QR of a Gaussian matrix with the signs of diag(R) fixed."""

    def __init__(self, d: int, seed: int = 0):
        super().__init__(d, seed)
        g = rng(seed, STREAM_ROTATION).standard_normal((self.d, self.d))
        q, r = np.linalg.qr(g)
        self.q = q * np.sign(np.diag(r))  # Haar-distributed (Mezzadri 2007)

    def apply(self, x):
        self._check(x)
        return np.asarray(x, dtype=np.float64) @ self.q.T

    def inverse(self, y):
        self._check(y)
        return np.asarray(y, dtype=np.float64) @ self.q


class HadamardRotation(Rotation):
    """Randomized block-Hadamard rotation ``D2 H_b P D1`` (see module docstring)."""

    def __init__(self, d: int, seed: int = 0):
        super().__init__(d, seed)
        g = rng(seed, STREAM_ROTATION)
        self.block = hadamard_block_size(self.d)
        self.signs1 = g.choice(np.array([-1.0, 1.0]), size=self.d)
        self.signs2 = g.choice(np.array([-1.0, 1.0]), size=self.d)
        self.perm = g.permutation(self.d) if self.block < self.d else np.arange(self.d)
        self.inv_perm = np.argsort(self.perm)

    @classmethod
    def from_signs(cls, signs1: np.ndarray, signs2: np.ndarray) -> "HadamardRotation":
        """The two-sign rotation ``D2 (H/sqrt(d)) D1`` with given sign vectors (d a power of two)."""
        d = len(signs1)
        if d & (d - 1) or len(signs2) != d:
            raise ValueError("from_signs needs two sign vectors of the same power-of-two length")
        obj = cls.__new__(cls)
        Rotation.__init__(obj, d, 0)
        obj.block = d
        obj.signs1 = np.asarray(signs1, dtype=np.float64)
        obj.signs2 = np.asarray(signs2, dtype=np.float64)
        obj.perm = obj.inv_perm = np.arange(d)
        return obj

    def apply(self, x):
        self._check(x)
        y = (np.asarray(x, dtype=np.float64) * self.signs1)[..., self.perm]
        return fwht(y, self.block) * self.signs2

    def inverse(self, y):
        self._check(y)
        x = fwht(np.asarray(y, dtype=np.float64) * self.signs2, self.block)
        return x[..., self.inv_perm] * self.signs1


class MatrixRotation(Rotation):
    """A given orthogonal matrix M (e.g. OSCAR's calibrated rotation): ``apply(x) = x @ M^T``."""

    def __init__(self, matrix: np.ndarray):
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != m.shape[1] or not np.allclose(m @ m.T, np.eye(m.shape[0]), atol=1e-10):
            raise ValueError("matrix must be a square orthogonal matrix")
        super().__init__(m.shape[0], 0)
        self.m = m

    def apply(self, x):
        self._check(x)
        return np.asarray(x, dtype=np.float64) @ self.m.T

    def inverse(self, y):
        self._check(y)
        return np.asarray(y, dtype=np.float64) @ self.m


def make_rotation(kind: str, d: int, seed: int) -> Rotation:
    """``"hadamard"`` or ``"haar"`` rotation of dimension d for ``seed``."""
    if kind == "hadamard":
        return HadamardRotation(d, seed)
    if kind == "haar":
        return HaarRotation(d, seed)
    raise ValueError(f"rotation must be 'hadamard' or 'haar', got {kind!r}")
