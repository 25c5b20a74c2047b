"""KIVI (ICML 2024): asymmetric 2-bit KV cache, keys per channel, values per token.

Notes
-----
REFERENCE.md section 8. Input ``(..., n, dim)`` with tokens on the second-to-last axis. The last
``n mod residual`` tokens stay float16 (KIVI keeps the newest tokens in full precision until a
block of ``residual`` has gathered); the first ``n_q = n - n mod residual`` are quantized with the
shared min/max rule of ``kvq_ref.uniform`` (float16 scale and minimum per group, see its rounding
rule):

* ``role="key"``: per channel, over groups of ``group`` consecutive tokens (keys have outlier
  channels, so each channel gets its own range); ``residual`` is a multiple of ``group``.
* ``role="value"``: per token, over groups of ``group`` consecutive channels (the last group of
  a token is shorter when ``group`` does not divide ``dim``).

Storage, for shape ``(..., n, dim)`` (``kvq_ref.packing`` little-endian bit streams):

* key: ``codes`` uint8 ``(..., n_q/group, dim, ceil(group*bits/8))`` (row ``[g, j]`` holds the
  codes of tokens ``g*group .. g*group+group-1`` of channel j, i.e. packed along tokens as KIVI's
  kernel does), ``scales``/``minima`` float16 ``(..., n_q/group, dim)``;
* value: ``codes`` uint8 ``(..., n_q, ceil(dim*bits/8))``, ``scales``/``minima`` float16
  ``(..., n_q, ceil(dim/group))``;
* ``residual`` float16 ``(..., n mod residual, dim)``.

Rate of the quantized part: ``bits + 32/group`` bits/element (3.0 at 2 bits, G=32) when the packed
rows have no padding (``group*bits`` resp. ``dim*bits`` a multiple of 8) and, for values, ``group``
divides ``dim``; the residual tokens cost 16 bits/element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .common import Encoded, Quantizer, as_array, to_fp
from .packing import pack_codes, packed_size, unpack_codes
from .uniform import check_bits, check_group, dequantize, quantize

__all__ = ["KIVI"]

_F16 = np.dtype(np.float16)


@dataclass(frozen=True)
class KIVI(Quantizer):
    """KIVI: per-channel keys, per-token values, asymmetric min/max, float16 residual block.

    Parameters
    ----------
    dim : int
        Head dimension (>= 1).
    bits : int
        1..8 bits per quantized element.
    role : {"key", "value"}
    group : int
        Group length: tokens per group (keys) or channels per group (values).
    residual : int
        Block length R: the newest ``n mod R`` tokens stay float16; a positive multiple of
        ``group`` for keys.

    Notes
    -----
    Idempotent: the uniform rule reproduces its own scales, minima and codes from the decoded
    values (see ``kvq_ref.uniform``), and float16 residual tokens decode exactly.
    """

    dim: int
    bits: int = 2
    role: str = "key"
    group: int = 32
    residual: int = 128
    name: ClassVar[str] = "kivi"
    idempotent: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        check_bits("bits", self.bits)
        if self.role not in ("key", "value"):
            raise ValueError(f"role must be 'key' or 'value', got {self.role!r}")
        check_group("group", self.group)
        check_group("residual", self.residual)
        if self.role == "key" and self.residual % self.group:
            raise ValueError(f"residual must be a positive multiple of group for keys, got residual="
                             f"{self.residual}, group={self.group}")

    def _split(self, n: int) -> tuple[int, int]:
        """(quantized tokens, float16 residual tokens) for n tokens."""
        nr = n % self.residual
        return n - nr, nr

    def layout(self, shape):
        if len(shape) < 2:
            raise ValueError(f"KIVI needs shape (..., n, dim), got {tuple(shape)}")
        lead, n = tuple(shape[:-2]), int(shape[-2])
        nq, nr = self._split(n)
        if self.role == "key":
            ng = nq // self.group
            codes = lead + (ng, self.dim, packed_size(self.group, self.bits))
            side = lead + (ng, self.dim)
        else:
            codes = lead + (nq, packed_size(self.dim, self.bits))
            side = lead + (nq, -(-self.dim // self.group))
        return {"codes": (codes, np.dtype(np.uint8)), "scales": (side, _F16), "minima": (side, _F16),
                "residual": (lead + (nr, self.dim), _F16)}

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., n, dim)."""
        x = as_array("x", x, dim=self.dim, min_ndim=2)
        nq, _ = self._split(x.shape[-2])
        xq = x[..., :nq, :]
        if self.role == "key":
            codes, scales, minima = quantize(xq, self.bits, self.group, axis=-2)
            rows = codes.reshape(x.shape[:-2] + (nq // self.group, self.group, self.dim)).swapaxes(-1, -2)
            packed = pack_codes(rows, self.bits)
        else:
            codes, scales, minima = quantize(xq, self.bits, self.group, axis=-1)
            packed = pack_codes(codes, self.bits)
        return self._make(x.shape, {"codes": packed, "scales": scales, "minima": minima,
                                    "residual": to_fp("residual", x[..., nq:, :], _F16)})

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        nq, _ = self._split(enc.shape[-2])
        a = enc.arrays
        if self.role == "key":
            rows = unpack_codes(a["codes"], self.bits, self.group).swapaxes(-1, -2)
            codes = rows.reshape(tuple(enc.shape[:-2]) + (nq, self.dim))
            xq = dequantize(codes, a["scales"], a["minima"], self.group, axis=-2)
        else:
            codes = unpack_codes(a["codes"], self.bits, self.dim)
            xq = dequantize(codes, a["scales"], a["minima"], self.group, axis=-1)
        return np.concatenate([xq, a["residual"].astype(np.float64)], axis=-2).astype(np.float32)
