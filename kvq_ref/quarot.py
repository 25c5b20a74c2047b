"""QuaRot KV cache: randomized Hadamard rotation, then clipped asymmetric per-token groups.

Notes
-----
REFERENCE.md section 8. Every vector is rotated, ``y = R x`` with the seeded randomized Hadamard
``D2 H P D1`` of ``kvq_ref.rotations`` (QuaRot applies H/sqrt(d) to q and k after RoPE and folds
it into the weights for values), then ``y`` is quantized per token in groups of
``g = min(group, dim)`` channels with the shared min/max rule of ``kvq_ref.uniform`` and clip ratio
``c`` (range ``[c*min, c*max]``, QuaRot's 0.95; entries outside take code 0 or L). Decoding
dequantizes and rotates back, ``x_hat = R^T y_hat``. Queries are rotated once
(``<q, x_hat> = <R q, y_hat>``) and weighted value sums are formed in the rotated domain with one
inverse rotation at the end.

Storage for shape ``(..., dim)``: ``codes`` uint8 ``(..., ceil(dim*bits/8))`` (``kvq_ref.packing``),
``scales``/``minima`` float16 ``(..., dim/g)``. Rate ``bits + 32/g``: 2.25 at INT2 with g = 128.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from .common import Encoded, RotatedQuantizer, as_array
from .packing import pack_codes, packed_size, unpack_codes
from .rotations import make_rotation
from .uniform import check_bits, check_clip_ratio, check_group, dequantize, quantize

__all__ = ["QuaRot"]


@dataclass(frozen=True)
class QuaRot(RotatedQuantizer):
    """QuaRot KV quantization: rotation + clipped asymmetric INT-b groups per token.

    Parameters
    ----------
    dim : int
        Vector dimension (>= 1; non-powers of two use the block-Hadamard rotation).
    bits : int
        1..8.
    group : int
        Channels per group; the effective group is ``min(group, dim)`` and must divide ``dim``.
    clip_ratio : float in (0, 1]
    rotation : {"hadamard", "haar"}
    seed : int

    Notes
    -----
    Idempotent only when ``clip_ratio == 1``. With ``c < 1`` the decoded group spans exactly
    ``[m, m + L*s]`` (for a group with ``min < 0 < max`` the clipped ends take codes 0 and L), so a
    re-encode clips that range again: every re-encode multiplies the stored minimum and range
    ``L*s`` by ``c`` (up to float16 rounding). At ``c = 1`` re-encoding reproduces every stored
    array exactly as long as float32 decoding, which moves the rotated values by ~1e-7 ||x||, stays
    inside the uniform rule's margins (half a float16 step of each minimum, 2^-13 of each range):
    only groups whose minimum lies within ~2e-4 ||x|| of zero or whose range is below ~1e-3 ||x||
    can miss them (none in 192k Gaussian vectors at 1..8 bits).
    """

    dim: int
    bits: int = 4
    group: int = 128
    clip_ratio: float = 0.95
    rotation: str = "hadamard"
    seed: int = 0
    name: ClassVar[str] = "quarot"

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        check_bits("bits", self.bits)
        check_group("group", self.group)
        if self.dim % self.g:
            raise ValueError(f"group must divide dim (or be >= dim), got group={self.group}, dim={self.dim}")
        check_clip_ratio(self.clip_ratio)
        if self.rotation not in ("hadamard", "haar"):
            raise ValueError(f"rotation must be 'hadamard' or 'haar', got {self.rotation!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def idempotent(self) -> bool:  # type: ignore[override]
        return self.clip_ratio == 1.0

    @property
    def g(self) -> int:
        """Effective group length ``min(group, dim)``."""
        return min(self.group, self.dim)

    @cached_property
    def rot(self):
        """The seeded rotation R."""
        return make_rotation(self.rotation, self.dim, self.seed)

    def layout(self, shape):
        lead = tuple(shape[:-1])
        side = (lead + (self.dim // self.g,), np.dtype(np.float16))
        return {"codes": (lead + (packed_size(self.dim, self.bits),), np.dtype(np.uint8)),
                "scales": side, "minima": side}

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., dim)."""
        x = as_array("x", x, dim=self.dim)
        codes, scales, minima = quantize(self.rot.apply(x), self.bits, self.g, -1, self.clip_ratio)
        return self._make(x.shape, {"codes": pack_codes(codes, self.bits), "scales": scales, "minima": minima})

    def _rotated(self, enc: Encoded) -> np.ndarray:
        """The dequantized rotated vectors ``y_hat``, float64 (N, dim), after validation."""
        self._check(enc)
        a = enc.arrays
        codes = unpack_codes(a["codes"], self.bits, self.dim)
        return dequantize(codes, a["scales"], a["minima"], self.g).reshape(-1, self.dim)
