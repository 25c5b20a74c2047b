"""The llama.cpp TurboQuant fork's block formats turbo2/turbo3/turbo4, byte for byte.

Notes
-----
REFERENCE.md section 5. One block is one vector of ``block`` values (128, one attention head, or
32 as in several forks); ``dim == block``. Encoding::

    y   = D(s2) (H / sqrt(block)) D(s1) x / ||x||       (HadamardRotation.from_signs(s1, s2))
    idx = #{thresholds < y_j}                          (searchsorted side="left": ties go low)
    c   = levels[idx],   gamma = fp16(||x|| / ||c||)   ("norm correction": ||x_hat|| = ||x||)
    x_hat = gamma * R^T c

with the exact Lloyd-Max table of ``SphereMarginal(block)`` at 2/3/4 bits (``codebooks``). The
two ±1 sign vectors are drawn from ``rng(seed, STREAM_MISC)`` (s1 first, then s2, each
``choice([-1, 1], block)``): the fork's hard-coded sign vectors are not reproduced, only the
structure ``D2 H D1``. A zero vector is stored with gamma = +0 and decodes to zeros.

Byte layout of one block (little-endian, fields concatenated, blocks concatenated in C order)::

    fmt     block 128                                  block 32
    turbo2  norm fp16 | qs[32]             34 B 2.125  norm | qs[8]            10 B  2.5
    turbo3  norm fp16 | qs[32] | signs[16] 50 B 3.125  norm | qs[8] | signs[4] 14 B  3.5
    turbo4  norm fp16 | unused fp16 = 0 | qs[64]
                                           68 B 4.25   norm | qs[16]           18 B  4.5

(bytes per block, bits per value). ``qs`` of turbo2/turbo3: 2-bit values, element j at bits
``2 (j % 4)`` of byte ``j / 4`` (turbo3 stores the low 2 bits of its 3-bit index there);
``signs``: the high bit of element j's 3-bit index at bit ``j % 8`` of byte ``j / 8``; turbo4
``qs``: element j at bits ``4 (j % 2)`` of byte ``j / 2``. These placements are exactly
``kvq_ref.packing.pack_codes`` at 2, 1 and 4 bits, which builds them. The 32-value turbo4 has no
unused field (2 + 16 bytes = 4.5 b/v). ``norm`` is gamma, the norm-correction scale.

A buffer whose norm is NaN/Inf or has its sign bit set (the encoder never writes -0 or a negative
scale), or whose unused field is not zero, is refused with ``ValueError`` (``from_bytes``,
``decode``). Queries are rotated once (``<q, x_hat> = gamma <R q, c>``) and weighted sums of
values are formed in the rotated domain with one inverse rotation, as in ``TurboQuantMSE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from codebooks import SphereMarginal

from .common import Encoded, RotatedQuantizer, as_array, check_shape, codebook, to_fp
from .turboquant import quantize_rotated
from .packing import pack_codes, unpack_codes
from .rotations import STREAM_MISC, HadamardRotation, rng

__all__ = ["TurboBlock", "FORMATS"]

#: bits per index of each format
FORMATS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}
_F16 = np.dtype("<f2")


@dataclass(frozen=True)
class TurboBlock(RotatedQuantizer):
    """A turbo2/turbo3/turbo4 block quantizer with the fork's exact byte layout.

    Parameters
    ----------
    fmt : {"turbo2", "turbo3", "turbo4"}
        2, 3 or 4 bits per value.
    block : {128, 32}
        Values per block (= vector dimension).
    seed : int
        Seed of the two sign vectors of the rotation.

    Notes
    -----
    Not idempotent for every input (like ``TurboQuantMSE``). Re-encoding ``x_hat = gamma R^T c``
    sees the rotated unit vector ``c / ||c||`` and the norm ``gamma ||c||``. When ``||c||`` lies in
    ``fixed_point_band`` (from the table's ``invariant_scales``; about (0.46, 1.54), (0.77, 1.23),
    (0.88, 1.12) for turbo2/3/4 at 128 values) every code is kept and the new scale is
    ``gamma ||c|| / ||c|| = gamma`` again (float16-exact), so ``encode(decode(e)) == e``. At 128
    values ``||c||^2`` concentrates at ``1 - block * mse`` and Gaussian vectors stay inside (measured
    ``||c||`` in 0.92..1.04 for turbo4 over 20000 vectors); very spiky rotated vectors leave it, and
    at 32 values ordinary Gaussian vectors do too (0.015% for turbo3, 0.15% for turbo4). The law
    that always holds: decoded norms equal input norms to float16 precision, and blocks inside the
    band are fixed points.
    """

    fmt: str = "turbo3"
    block: int = 128
    seed: int = 0
    name: ClassVar[str] = "turbo_block"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {self.fmt!r}")
        if isinstance(self.block, bool) or self.block not in (32, 128):
            raise ValueError(f"block must be 128 or 32, got {self.block!r}")
        object.__setattr__(self, "block", int(self.block))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def dim(self) -> int:
        return self.block

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt]

    @property
    def _has_unused(self) -> bool:
        return self.fmt == "turbo4" and self.block == 128

    @property
    def _qs_offset(self) -> int:
        return 4 if self._has_unused else 2

    @property
    def bytes_per_block(self) -> int:
        """Stored bytes per block (34/50/68 at 128 values, 10/14/18 at 32)."""
        b = self.block
        return {"turbo2": 2 + b // 4, "turbo3": 2 + b // 4 + b // 8,
                "turbo4": self._qs_offset + b // 2}[self.fmt]

    @cached_property
    def rot(self) -> HadamardRotation:
        """``D(s2) (H / sqrt(block)) D(s1)`` with both signs from ``rng(seed, STREAM_MISC)``."""
        g = rng(self.seed, STREAM_MISC)
        s1 = g.choice(np.array([-1.0, 1.0]), size=self.block)
        s2 = g.choice(np.array([-1.0, 1.0]), size=self.block)
        return HadamardRotation.from_signs(s1, s2)

    @cached_property
    def table(self):
        """The Lloyd-Max ``Codebook`` of SphereMarginal(block) at 2/3/4 bits."""
        return codebook(SphereMarginal(self.block), self.bits)

    @property
    def fixed_point_band(self) -> tuple[float, float]:
        """Interval of ``||c||`` (norm of a block's levels) whose re-encode keeps every code.

        The reciprocal of ``table.invariant_scales()``: re-encoding multiplies every level by
        ``1 / ||c||``.
        """
        lo, hi = self.table.invariant_scales()
        return 1.0 / hi, 1.0 / lo

    def layout(self, shape):
        if len(shape) < 1 or shape[-1] != self.block:
            raise ValueError(f"encoded shape {tuple(shape)} does not end in block={self.block}: corrupted buffer")
        return {"blocks": (tuple(shape[:-1]) + (self.bytes_per_block,), np.dtype(np.uint8))}

    # --- the byte layout --------------------------------------------------------------------------
    def pack(self, indices: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Assemble blocks from indices and float16 scales.

        Parameters
        ----------
        indices : ndarray of ints, shape (N, block), values 0 .. 2^bits - 1
        scales : ndarray, shape (N,), float16 (the stored norm field)

        Returns
        -------
        ndarray of uint8, shape (N, bytes_per_block)
        """
        idx = np.asarray(indices)
        if idx.ndim != 2 or idx.shape[1] != self.block:
            raise ValueError(f"indices must have shape (N, {self.block}), got {idx.shape}")
        scales = np.asarray(scales)
        if scales.dtype != np.float16 or scales.shape != idx.shape[:1]:
            raise ValueError(f"scales must be float16 of shape ({idx.shape[0]},)")
        out = np.zeros((idx.shape[0], self.bytes_per_block), dtype=np.uint8)
        out[:, 0:2] = scales.astype(_F16).reshape(-1, 1).view(np.uint8)
        q = self._qs_offset
        if self.fmt == "turbo4":
            out[:, q:] = pack_codes(idx, 4)
        else:
            out[:, q:q + self.block // 4] = pack_codes(idx & 3, 2)
            if self.fmt == "turbo3":
                out[:, q + self.block // 4:] = pack_codes(idx >> 2, 1)
        return out

    def unpack(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices (N, block) uint8 and scales (N,) float16 of blocks (N, bytes_per_block).

        Raises
        ------
        ValueError
            Wrong size, a NaN/Inf or sign-bit-set norm, or a non-zero unused field.
        """
        blocks = np.asarray(blocks)
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != self.bytes_per_block:
            raise ValueError(f"blocks must be uint8 of shape (N, {self.bytes_per_block}): corrupted buffer")
        scales = np.ascontiguousarray(blocks[:, 0:2]).view(_F16)[:, 0].astype(np.float16)
        if not np.all(np.isfinite(scales)) or np.any(np.signbit(scales)):
            raise ValueError(f"{self.fmt} block norm is NaN/Inf or negative: corrupted buffer")
        if self._has_unused and np.any(blocks[:, 2:4]):
            raise ValueError(f"{self.fmt} block unused field is not zero: corrupted buffer")
        q = self._qs_offset
        if self.fmt == "turbo4":
            idx = unpack_codes(blocks[:, q:], 4, self.block)
        else:
            idx = unpack_codes(blocks[:, q:q + self.block // 4], 2, self.block)
            if self.fmt == "turbo3":
                idx = idx | (unpack_codes(blocks[:, q + self.block // 4:], 1, self.block) << 2)
        return idx, scales

    def to_bytes(self, enc: Encoded) -> bytes:
        """All blocks of ``enc`` concatenated (C order), ``bytes_per_block`` bytes each."""
        self._check(enc)
        return np.ascontiguousarray(enc.arrays["blocks"]).tobytes()

    def from_bytes(self, raw, shape) -> Encoded:
        """The ``Encoded`` of a tensor of ``shape`` (..., block) from its raw blocks.

        Raises
        ------
        ValueError
            ``shape`` not ending in ``block``, a length other than
            ``prod(shape[:-1]) * bytes_per_block``, or corrupted fields (see ``unpack``).
        """
        shape = check_shape("shape", shape)
        if shape[-1] != self.block:
            raise ValueError(f"shape must end in block={self.block}, got {shape}")
        buf = np.frombuffer(bytes(raw), dtype=np.uint8)
        n = math.prod(shape[:-1])
        if buf.size != n * self.bytes_per_block:
            raise ValueError(f"raw buffer has {buf.size} bytes, {shape} needs {n} blocks of "
                             f"{self.bytes_per_block} = {n * self.bytes_per_block}: corrupted buffer")
        enc = self._make(shape, {"blocks": buf.reshape(shape[:-1] + (self.bytes_per_block,)).copy()})
        self.unpack(buf.reshape(n, self.bytes_per_block))
        return enc

    # --- quantizer ------------------------------------------------------------------------------
    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., block) into blocks uint8 (..., bytes_per_block)."""
        x = as_array("x", x, dim=self.block)
        # TurboQuant's rule with norm correction (shared with TurboQuantMSE: same norm, same order)
        idx, scale = quantize_rotated(np.ascontiguousarray(x.reshape(-1, self.block)), self.rot, self.table, True)
        blocks = self.pack(idx, to_fp("norms", scale, np.dtype(np.float16)))
        return self._make(x.shape, {"blocks": blocks.reshape(x.shape[:-1] + (self.bytes_per_block,))})

    def _parts(self, enc: Encoded):
        """(c in the rotated domain (N, block) float64, scales (N,) float64) after validation."""
        self._check(enc)
        idx, scales = self.unpack(enc.arrays["blocks"].reshape(-1, self.bytes_per_block))
        return self.table.levels[idx], scales.astype(np.float64)

    def _rotated(self, enc: Encoded) -> np.ndarray:
        chat, scale = self._parts(enc)
        return chat * scale[:, None]
