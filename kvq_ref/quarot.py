"""QuaRot KV cache: Hadamard rotation, then asymmetric per-token integer groups.

Notes
-----
:ref:`ref-quarot`; the official behaviour is in that section and ``tests/interop/data/quarot/`` (QuaRot
commit 5008669), which the defaults reproduce bit for bit (``tests/interop/test_quarot.py``). Every
vector is rotated, ``y = R x``, then quantized per token in groups of ``g = min(group, dim)``
channels (QuaRot: g = head_dim). Decoding dequantizes and rotates back, ``x_hat = R^T y_hat``.
Queries are rotated once (``<q, x_hat> = <R q, y_hat>``) and weighted value sums are formed in the
rotated domain with one inverse rotation at the end.

Defaults (official): ``rotation="hadamard"`` is the plain Sylvester Hadamard ``H / sqrt(d)``
(``H[i, j] = (-1)^popcount(i & j)``, no random signs, d a power of two), applied to the float16
input and rounded to float16 as QuaRot's ``matmul_had_cuda`` does; ``rule="kernel"`` is the INT
KV-cache kernel (``asym_quantize_and_pack_i4``, ``kvq_ref.official.minmax_f16`` with the range floor
``f16(1e-5)``): float16 arithmetic, round half to even, float16 scale and zero ``-min``, no clip;
decode ``f32(code * scale - zero)`` (the flashinfer decode kernel). ``clip_ratio`` must be 1 with it.

Named deviations (effects measured by ``benchmarks/fidelity.py``, ``benchmarks/results/fidelity.json``):

* ``rule="exact"``: the float64 min/max rule of ``kvq_ref.uniform`` with clip ratio ``c`` (range
  ``[c*min, c*max]``; entries outside take code 0 or L), our earlier default with ``c = 0.95``. The
  fake-quant path's clip flag (default 1.0; papers' scripts pass 0.95) is reproduced exactly by
  ``kvq_ref.official.quarot_fakequant_k``/``_v``; the NOVA-KV/OSCAR papers' QuaRot baseline uses
  no clip.
* ``rotation="randomized"``: our seeded randomized block Hadamard ``D2 H P D1`` of
  ``kvq_ref.rotations`` (any d with a power-of-two block, e.g. 80, 96), no float16 rounding of y;
  ``"haar"``: a seeded Haar rotation.

Measured (``benchmarks/fidelity.py``, d = 128 synthetic keys with offset and outlier channels; relative
MSE, same rate 2.25 / 4.25 bits): INT2 official 0.269; ``rule="exact"`` 0.269 (99.91 % of codes
agree); with ``clip_ratio=0.95`` 0.242 (98.0 % agree); ``rotation="randomized"`` 0.250; the earlier
default (randomized, exact, clip 0.95) 0.225. INT4: 0.0107, 0.0107 (99.7 %), 0.0100 (88.8 %), 0.0099,
0.0092. The clip and the random signs help on this data; the official code uses neither.

Storage for shape ``(..., dim)``: ``codes`` uint8 ``(..., ceil(dim*bits/8))`` (``kvq_ref.packing``;
at 4 bits QuaRot's byte ``code[2j] | code[2j+1] << 4``), ``scales``/``minima`` float16
``(..., dim/g)`` (QuaRot stores ``zero = -minima``). Rate ``bits + 32/g``: 2.25 at INT2 with g = 128.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from .common import Encoded, RotatedQuantizer, as_array
from .official import QUAROT_RANGE_FLOOR, dequant_kernel, minmax_f16
from .packing import pack_codes, packed_size, unpack_codes
from .rotations import HadamardRotation, make_rotation
from .uniform import check_bits, check_clip_ratio, check_group, dequantize, quantize

__all__ = ["QuaRot"]


@dataclass(frozen=True)
class QuaRot(RotatedQuantizer):
    """QuaRot KV quantization: rotation + asymmetric INT-b groups per token.

    Parameters
    ----------
    dim : int
        Vector dimension (>= 1; a power of two for the plain Hadamard).
    bits : int
        1..8.
    group : int
        Channels per group; the effective group is ``min(group, dim)`` and must divide ``dim``.
    clip_ratio : float in (0, 1]
        1 (official); below 1 only with ``rule="exact"``.
    rotation : {"hadamard", "randomized", "haar"}
    seed : int
        Seed of the randomized and Haar rotations (the plain Hadamard has none).
    rule : {"kernel", "exact"}

    Notes
    -----
    ``rule="exact"`` is idempotent only when ``clip_ratio == 1``. With ``c < 1`` the decoded group spans
    exactly ``[m, m + L*s]`` (for a group with ``min < 0 < max`` the clipped ends take codes 0 and L), so a
    re-encode clips that range again: every re-encode multiplies the stored minimum and range
    ``L*s`` by ``c`` (up to float16 rounding). At ``c = 1`` re-encoding reproduces every stored
    array exactly as long as float32 decoding, which moves the rotated values by ~1e-7 ||x||, stays
    inside the uniform rule's margins (half a float16 step of each minimum, 2^-13 of each range):
    only groups whose minimum lies within ~2e-4 ||x|| of zero or whose range is below ~1e-3 ||x||
    can miss them (none in 192k Gaussian vectors at 1..8 bits). ``rule="kernel"`` is not idempotent
    (the float32 decode is rounded to float16 and rotated again); re-encoding keeps the layout.
    """

    dim: int
    bits: int = 4
    group: int = 128
    clip_ratio: float = 1.0
    rotation: str = "hadamard"
    seed: int = 0
    rule: str = "kernel"
    name: ClassVar[str] = "quarot"

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        check_bits("bits", self.bits)
        check_group("group", self.group)
        if self.dim % self.g:
            raise ValueError(f"group must divide dim (or be >= dim), got group={self.group}, dim={self.dim}")
        check_clip_ratio(self.clip_ratio)
        if self.rotation not in ("hadamard", "randomized", "haar"):
            raise ValueError(f"rotation must be 'hadamard', 'randomized' or 'haar', got {self.rotation!r}")
        if self.rotation == "hadamard" and self.dim & (self.dim - 1):
            raise ValueError(f"the plain Hadamard needs a power-of-two dim, got {self.dim}; "
                             "use rotation='randomized' (block Hadamard)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.rule not in ("kernel", "exact"):
            raise ValueError(f"rule must be 'kernel' or 'exact', got {self.rule!r}")
        if self.rule == "kernel" and self.clip_ratio != 1.0:
            raise ValueError(f"QuaRot's kernel rule does not clip: clip_ratio must be 1 with rule='kernel', "
                             f"got {self.clip_ratio}; use rule='exact'")

    @property
    def idempotent(self) -> bool:  # type: ignore[override]
        return self.rule == "exact" and self.clip_ratio == 1.0

    @property
    def g(self) -> int:
        """Effective group length ``min(group, dim)``."""
        return min(self.group, self.dim)

    @cached_property
    def rot(self):
        """The rotation R."""
        if self.rotation == "hadamard":
            ones = np.ones(self.dim)
            return HadamardRotation.from_signs(ones, ones)
        return make_rotation("hadamard" if self.rotation == "randomized" else "haar", self.dim, self.seed)

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """The rows the quantizer sees: ``R x`` (float16 values for the plain Hadamard), float64."""
        if self.rotation != "hadamard":
            return self.rot.apply(x)
        with np.errstate(over="ignore"):
            y = self.rot.apply(np.asarray(x).astype(np.float16).astype(np.float64)).astype(np.float16)
        if not np.all(np.isfinite(y)):
            raise ValueError("x overflows float16 (|x| or |R x| > 65504)")
        return y.astype(np.float64)

    def layout(self, shape):
        lead = tuple(shape[:-1])
        side = (lead + (self.dim // self.g,), np.dtype(np.float16))
        return {"codes": (lead + (packed_size(self.dim, self.bits),), np.dtype(np.uint8)),
                "scales": side, "minima": side}

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., dim)."""
        x = as_array("x", x, dim=self.dim)
        y = self.rotate(x)
        if self.rule == "kernel":
            codes, scales, minima = minmax_f16(y, self.bits, self.g, -1, range_floor=QUAROT_RANGE_FLOOR)
        else:
            codes, scales, minima = quantize(y, self.bits, self.g, -1, self.clip_ratio)
        return self._make(x.shape, {"codes": pack_codes(codes, self.bits), "scales": scales, "minima": minima})

    def _rotated(self, enc: Encoded) -> np.ndarray:
        """The dequantized rotated vectors ``y_hat``, float64 (N, dim), after validation."""
        self._check(enc)
        a = enc.arrays
        codes = unpack_codes(a["codes"], self.bits, self.dim)
        if self.rule == "kernel":
            y = dequant_kernel(codes, a["scales"], a["minima"], self.g).astype(np.float64)
        else:
            y = dequantize(codes, a["scales"], a["minima"], self.g)
        return y.reshape(-1, self.dim)
