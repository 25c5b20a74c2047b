"""PolarQuant (arXiv 2502.02617): rotation + recursive polar transform + per-level angle codebooks.

Notes
-----
:ref:`ref-polarquant`. A vector x of dimension d is rotated once, ``y = R x`` (seeded, from
``kvq_ref.rotations.make_rotation``), and split into ``d / block`` blocks of ``block = 2^L``
coordinates. Each block goes through the recursive polar transform (coordinates numbered from 0
within a block; level-l nodes cover ``2^l`` consecutive coordinates)::

    level 1:      psi_j = atan2(y_{2j+1}, y_{2j}) mapped into [0, 2 pi),  r_j = hypot(y_{2j}, y_{2j+1})
    level l >= 2: psi_j = atan2(r_{2j+1}, r_{2j}) in [0, pi/2],           r_j = hypot(r_{2j}, r_{2j+1})

leaving ``block/2 + block/4 + ... + 1 = block - 1`` angles and one radius (the block norm). For
Gaussian y the angles are independent of each other and of the radius, level 1 uniform and level
l >= 2 with density ``~ sin^(2^(l-1) - 1)(2 psi)`` (``codebooks.PolarAngle``). Level l's angles are
quantized with ``bits[l-1]`` bits in the exact Lloyd-Max table of ``PolarAngle(l)`` (level 1: the
uniform table on [0, 2 pi)); the radius is stored in ``radius_dtype``.

Quantization rule (kernels must match): ``idx = #{thresholds < psi}``
(``np.searchsorted(thresholds, psi, side="left")``; an angle exactly on a threshold takes the lower
cell). ``atan2`` is taken of float64 values; a level-1 angle of ``-0.0``/tiny negative maps to
``psi + 2 pi`` (which may round to ``2 pi`` itself: the last cell, adjacent on the circle). A zero
pair/node has ``atan2(0, 0) = 0`` (code 0 at level 1; at level >= 2 a zero left child gives
``pi/2``, the last cell).

Decoding inverts the transform with the quantized angles from the top down,
``r_left = r cos psi_hat, r_right = r sin psi_hat`` and at level 1 ``(y_{2j}, y_{2j+1}) =
r_j (cos psi_hat, sin psi_hat)``, then applies ``R^T``. The decoded block has exactly the stored
radius as its norm; a zero block (radius 0) decodes to zeros.

Stored arrays (per vector, blocks in order, each block's angles in node order): ``codes_l1`` ..
``codes_lL``, the level-l codes of all blocks (``d / 2^l`` codes) packed with
``kvq_ref.packing.pack_codes`` at ``bits[l-1]`` bits; ``radii`` (``d / block`` values). Default
rate at d = 128: ``(8*4 + 4*2 + 2*2 + 1*2) + 16 = 62`` bits per 16 coordinates = 3.875 bits/element.

Queries are rotated once (``prepare_query``); ``scores``/``accumulate`` decode blocks in the
rotated domain only (one inverse rotation of the weighted sum in ``accumulate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from codebooks import PolarAngle

from .common import Encoded, RotatedQuantizer, as_array, codebook, fp_dtype, to_fp
from .packing import pack_codes, packed_size, unpack_codes
from .rotations import make_rotation

__all__ = ["PolarQuant"]

_TWO_PI = 2.0 * math.pi
_MAX_LEVELS = 16  # codebooks.PolarAngle supports levels 1..16


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | np.integer)


@dataclass(frozen=True)
class PolarQuant(RotatedQuantizer):
    """PolarQuant: seeded rotation, blockwise recursive polar transform, per-level angle tables.

    Parameters
    ----------
    dim : int
        Vector dimension d (>= 2, a multiple of ``block``).
    block : int
        Coordinates per polar block: a power of two ``2^L >= 2`` dividing ``dim``.
    bits : tuple of int
        Bits of the angles at levels 1..L (``len(bits) == log2(block)``, each 1..8).
    rotation : {"hadamard", "haar"}
        Preconditioning rotation of the whole vector.
    seed : int
    radius_dtype : {"float16", "float32"}
        Storage precision of the block radii.

    Notes
    -----
    Idempotent in real arithmetic, so ``idempotent`` is False only for the floating-point caveat
    below. A decoded block has the stored radius as its norm and its angles equal the quantized
    levels, which lie strictly inside their cells (and strictly inside (0, pi/2) at
    levels >= 2, so no child radius of a non-zero decoded block is zero); re-encoding therefore
    reproduces every angle code and the float16 radius. This is exact in real arithmetic. In
    floating point the float32 output and the two rotations perturb every rotated coordinate by
    ~1e-7 ||x||, which is harmless unless a block's radius is tiny next to ||x|| (below ~1e-4 of
    it; measured: 1e-4 holds, 1e-5 fails), where the perturbation moves that block's angles and
    reaches the float16 half-ulp of its radius; in particular a non-zero vector with an exactly
    zero rotated block is not a fixed point (the zero block re-encodes rounding noise).
    Zero vectors are fixed points.
    """

    dim: int
    block: int = 16
    bits: tuple = (4, 2, 2, 2)
    rotation: str = "hadamard"
    seed: int = 0
    radius_dtype: str = "float16"
    name: ClassVar[str] = "polarquant"
    idempotent: ClassVar[bool] = False  # see Notes: holds unless a block radius < ~1e-4 ||x||

    def __post_init__(self):
        if not _is_int(self.dim) or self.dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {self.dim!r}")
        b = self.block
        if not _is_int(b) or b < 2 or b & (b - 1) or b > 2**_MAX_LEVELS or self.dim % b:
            raise ValueError(f"block must be a power of two in 2..{2**_MAX_LEVELS} dividing dim={self.dim}, "
                             f"got {b!r}")
        if isinstance(self.bits, str) or not isinstance(self.bits, tuple | list | np.ndarray):
            raise TypeError(f"bits must be a tuple of integers (one per level), got {self.bits!r}")
        levels = int(b).bit_length() - 1
        bits = tuple(self.bits.tolist()) if isinstance(self.bits, np.ndarray) else tuple(self.bits)
        if len(bits) != levels or not all(_is_int(v) and 1 <= v <= 8 for v in bits):
            raise ValueError(f"bits must be {levels} integers in 1..8 (one per level of block={b}), "
                             f"got {self.bits!r}")
        object.__setattr__(self, "bits", tuple(int(v) for v in bits))
        object.__setattr__(self, "block", int(b))
        object.__setattr__(self, "dim", int(self.dim))
        if self.rotation not in ("hadamard", "haar"):
            raise ValueError(f"rotation must be 'hadamard' or 'haar', got {self.rotation!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        fp_dtype(self.radius_dtype)

    @property
    def levels(self) -> int:
        """L = log2(block), the number of angle levels."""
        return len(self.bits)

    @property
    def n_blocks(self) -> int:
        return self.dim // self.block

    @cached_property
    def rot(self):
        """The seeded rotation R."""
        return make_rotation(self.rotation, self.dim, self.seed)

    @cached_property
    def tables(self) -> tuple:
        """The Lloyd-Max ``Codebook`` of ``PolarAngle(l)`` at ``bits[l-1]``, for l = 1..L."""
        return tuple(codebook(PolarAngle(lv), b) for lv, b in enumerate(self.bits, start=1))

    def _count(self, level: int) -> int:
        """Angles of one vector at ``level`` (all blocks): d / 2^level."""
        return self.dim >> level

    def layout(self, shape):
        if len(shape) < 1 or shape[-1] != self.dim:
            raise ValueError(f"encoded shape {tuple(shape)} does not end in dim={self.dim}: corrupted buffer")
        lead = tuple(shape[:-1])
        out = {f"codes_l{lv}": (lead + (packed_size(self._count(lv), b),), np.dtype(np.uint8))
               for lv, b in enumerate(self.bits, start=1)}
        out["radii"] = (lead + (self.n_blocks,), fp_dtype(self.radius_dtype))
        return out

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., dim).

        Returns
        -------
        Encoded
            ``codes_l{l}``: uint8 (..., ceil(dim/2^l * bits[l-1] / 8)); ``radii``: radius_dtype
            (..., dim/block).
        """
        x = as_array("x", x, dim=self.dim)
        lead = x.shape[:-1]
        r = self.rot.apply(x.reshape(-1, self.dim))  # (N, d): level-0 "radii" are the coordinates
        arrays = {}
        for lv, (b, table) in enumerate(zip(self.bits, self.tables), start=1):
            left, right = r[:, 0::2], r[:, 1::2]
            psi = np.arctan2(right, left)
            if lv == 1:
                psi = np.where(psi < 0, psi + _TWO_PI, psi)
            codes = np.searchsorted(table.thresholds, psi, side="left").astype(np.uint8)
            arrays[f"codes_l{lv}"] = pack_codes(codes, b).reshape(lead + (-1,))
            r = np.hypot(left, right)  # (N, d / 2^lv), nodes of consecutive blocks in order
        arrays["radii"] = to_fp("radii", r, fp_dtype(self.radius_dtype)).reshape(lead + (self.n_blocks,))
        return self._make(x.shape, arrays)

    def _rotated(self, enc: Encoded) -> np.ndarray:
        """The decoded vectors in the rotated domain, float64 (N, d), after validation."""
        self._check(enc)
        r = enc.arrays["radii"].reshape(-1, self.n_blocks).astype(np.float64)
        n = r.shape[0]
        for lv in range(self.levels, 0, -1):
            packed = enc.arrays[f"codes_l{lv}"].reshape(n, -1)
            codes = unpack_codes(packed, self.bits[lv - 1], self._count(lv))
            psi = self.tables[lv - 1].levels[codes]  # (N, d / 2^lv)
            child = np.empty((n, 2 * r.shape[1]))
            child[:, 0::2] = r * np.cos(psi)
            child[:, 1::2] = r * np.sin(psi)
            r = child
        return r
