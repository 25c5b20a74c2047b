"""The ``Codebook``: a solved scalar quantizer table and how it was made."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ._validate import check_bits, check_int, finite_array, strictly_increasing
from ._version import TABLE_SCHEMA_VERSION, __version__
from .densities import Density, SphereMarginal

__all__ = ["Codebook", "ConvergenceError"]


class ConvergenceError(RuntimeError):
    """A solve did not reach its tolerance; no table is returned."""


@dataclass(frozen=True, eq=False)
class Codebook:
    """A scalar quantizer table for one density and bit width.

    Parameters
    ----------
    levels : ndarray, shape (2**bits,), float64
        Reconstruction levels, strictly increasing.
    thresholds : ndarray, shape (2**bits - 1,), float64
        Decision thresholds, strictly increasing and interleaved with the levels.
    mse : float
        Per-coordinate distortion ``E[(X - Q(X))^2]`` under ``density``.
    density : Density
        The density the table was solved for.
    bits : int
        Bit width; ``len(levels) == 2**bits``.
    solver : str
        Name of the algorithm that produced the table.
    iterations : int
        Iterations the solver used (for ``"newton-tridiagonal+mp50"`` the float64 Newton steps; the
        50-digit refinement's few steps are not counted, as their number depends on the start).
    residual : float
        Final centroid-condition residual ``max_i |c_i - E[X | cell i]| / std(X)``.
    version : str
        Package version that produced the table.
    schema : int
        Table-file schema version.

    Notes
    -----
    Quantization rule (kernels must match it): the index of ``x`` is the number of thresholds
    strictly below ``x`` (``searchsorted(thresholds, x, side="left")``), so a value exactly on a
    threshold maps to the lower cell.
    """

    levels: np.ndarray
    thresholds: np.ndarray
    mse: float
    density: Density
    bits: int
    solver: str
    iterations: int
    residual: float
    version: str = __version__
    schema: int = field(default=TABLE_SCHEMA_VERSION)

    def __post_init__(self):
        object.__setattr__(self, "bits", check_bits(self.bits))
        if not isinstance(self.density, Density):
            raise TypeError(f"density must be a Density, got {type(self.density).__name__}")
        levels = finite_array("levels", self.levels)
        thresholds = finite_array("thresholds", self.thresholds, min_size=0)
        if levels.size != 2**self.bits:
            raise ValueError(f"levels must have 2**bits={2**self.bits} entries, got {levels.size}")
        if thresholds.size != levels.size - 1:
            raise ValueError(f"thresholds must have {levels.size - 1} entries, got {thresholds.size}")
        strictly_increasing("levels", levels)
        strictly_increasing("thresholds", thresholds)
        if thresholds.size and not (np.all(levels[:-1] < thresholds) and np.all(thresholds < levels[1:])):
            raise ValueError("thresholds must interleave the levels: levels[i] < thresholds[i] < levels[i+1]")
        if isinstance(self.mse, bool) or not isinstance(self.mse, numbers.Real) or not math.isfinite(self.mse) \
                or self.mse < 0:
            raise ValueError(f"mse must be finite and >= 0, got {self.mse!r}")
        for name, arr in (("levels", levels), ("thresholds", thresholds)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "mse", float(self.mse))
        if not isinstance(self.solver, str) or not self.solver:
            raise TypeError(f"solver must be a non-empty string, got {self.solver!r}")
        object.__setattr__(self, "iterations", check_int("iterations", self.iterations, lo=0))
        if isinstance(self.residual, bool) or not isinstance(self.residual, numbers.Real) \
                or not math.isfinite(self.residual) or self.residual < 0:
            raise ValueError(f"residual must be a finite number >= 0, got {self.residual!r}")
        object.__setattr__(self, "residual", float(self.residual))
        if not isinstance(self.version, str) or not self.version:
            raise TypeError(f"version must be a non-empty string, got {self.version!r}")
        object.__setattr__(self, "schema", check_int("schema", self.schema, lo=1))

    @property
    def name(self) -> str:
        """Identifier used in table files, e.g. ``sphere_d128_b4``."""
        return f"{self.density.label}_b{self.bits}"

    @property
    def unit_distortion(self) -> float | None:
        """``d * mse`` for ``SphereMarginal(d)``: E||x - x_hat||^2 of a rotated unit vector."""
        if isinstance(self.density, SphereMarginal):
            return self.density.d * self.mse
        return None

    def invariant_scales(self) -> tuple[float, float]:
        """Open interval of factors s > 0 for which every scaled level ``s * levels[i]`` stays in cell i.

        A re-encoded vector of levels whose coordinates are all multiplied by one factor (as when a
        quantizer normalizes ``c_hat`` by its norm) keeps its codes iff the factor lies inside this
        interval (for the levels it uses). For cell i = (t_(i-1), t_i]: a positive level needs
        ``t_(i-1) < s c_i <= t_i``, a negative one the mirrored bounds; 0 is never a level here.

        Returns
        -------
        (lo, hi) : tuple of float
            ``lo < 1 < hi`` for any table whose levels lie inside their cells.
        """
        lo, hi = 0.0, np.inf
        t = self.thresholds
        for i, c in enumerate(self.levels):
            below = t[i - 1] if i > 0 else -np.inf
            above = t[i] if i < t.size else np.inf
            if c > 0:
                lo, hi = max(lo, below / c), min(hi, above / c)
            elif c < 0:
                lo, hi = max(lo, above / c), min(hi, below / c)
        return float(lo), float(hi)

    def quantize(self, x) -> np.ndarray:
        """Indices of the cells holding ``x`` (ties go to the lower cell).

        Parameters
        ----------
        x : array_like of float

        Returns
        -------
        ndarray of int64, same shape as ``x``
        """
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("x must be finite")
        return np.searchsorted(self.thresholds, x, side="left").astype(np.int64)

    def dequantize(self, idx) -> np.ndarray:
        """Levels for cell indices ``idx`` (int array in 0..2**bits-1)."""
        idx = np.asarray(idx)
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"idx must be an integer array, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.levels.size):
            raise ValueError(f"idx must be in 0..{self.levels.size - 1}")
        return self.levels[idx]

    def __eq__(self, other):
        if not isinstance(other, Codebook):
            return NotImplemented
        return (np.array_equal(self.levels, other.levels)
                and np.array_equal(self.thresholds, other.thresholds)
                and self.mse == other.mse and self.density == other.density
                and self.bits == other.bits and self.solver == other.solver
                and self.iterations == other.iterations and self.residual == other.residual
                and self.version == other.version and self.schema == other.schema)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        ud = self.unit_distortion
        extra = f", unit_distortion={ud:.6g}" if ud is not None else ""
        return (f"Codebook({self.density!r}, bits={self.bits}, mse={self.mse:.10g}{extra}, "
                f"solver={self.solver!r}, iterations={self.iterations}, residual={self.residual:.2e})")
