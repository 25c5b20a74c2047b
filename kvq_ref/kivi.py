"""KIVI (ICML 2024): asymmetric 2-bit KV cache, keys per channel, values per token.

Notes
-----
:ref:`ref-kivi`; the official behaviour is in that section and ``tests/interop/data/kivi/`` (KIVI commit
876b4d2), which the defaults reproduce bit for bit (``tests/interop/test_kivi.py``). Input
``(..., n, dim)`` with tokens on the second-to-last axis.

* ``role="key"``: per channel, over groups of ``group`` consecutive tokens aligned at token 0
  (keys have outlier channels, so each channel gets its own range); the newest ``n mod residual``
  keys stay float16 (KIVI quantizes a block of ``residual`` keys once it has gathered), the first
  ``n - n mod residual`` are quantized; ``residual`` is a multiple of ``group``.
* ``role="value"``: per token, over groups of ``group`` consecutive channels. ``value_window=
  "sliding"`` (official): the newest ``min(n, residual)`` values stay float16 and the first
  ``max(0, n - residual)`` are quantized (KIVI's value window slides by one token per decode
  step). ``"block"`` (our earlier rule, kept as an option): like the keys, the newest ``n mod
  residual`` stay float16. At n = 300, R = 128: 172 quantized values (sliding) against 256 (block);
  measured at 2 bits: 8.55 against 4.91 stored bits per element and relative MSE 0.089 against 0.130
  (the quantized tokens alone: 0.153 either way).

Rules (``rule``):

* ``"official"`` (default): KIVI's quantizer in float16 arithmetic (``kvq_ref.official.minmax_f16``):
  the input is rounded to float16 (KIVI runs float16 models), ``scale = f16(f16(max - min) / L)``,
  ``code = rhe(clamp(f16(f16(x - min) / scale), 0, L))`` with round half to even, float16 scale and
  minimum; decode ``f32(scale * code + min)`` (the gemv kernel's dequantization). A constant group
  (official: 0/0, undefined) gets scale 0, codes 0 and decodes to its value. Values need ``group``
  to divide ``dim``. Not idempotent: decoding to float32 and rounding to float16 again can move a
  group's range by a float16 step; re-encoding changes each code by at most one (tested).
* ``"exact"``: the float64 min/max rule of ``kvq_ref.uniform`` (round half up with the float16
  margin steps that make re-quantization exact; short last value groups allowed). Idempotent.
  Measured against ``"official"`` (``benchmarks/fidelity.py``, ``benchmarks/results/fidelity.json``;
  d = 128, 300 synthetic tokens with offset and outlier channels): 99.95 % (keys) and 99.92 %
  (values) of the 2-bit codes agree, 99.7 % and 99.6 % at 4 bits; the relative MSE is the same to 3
  digits (0.0703 keys, 0.0889 values at 2 bits).

Storage, for shape ``(..., n, dim)`` (``kvq_ref.packing`` little-endian bit streams; for 2 and 4
bits these are KIVI's int32 words read as little-endian bytes):

* key: ``codes`` uint8 ``(..., n_q/group, dim, ceil(group*bits/8))`` (row ``[g, j]`` holds the
  codes of tokens ``g*group .. g*group+group-1`` of channel j, i.e. packed along tokens as KIVI's
  kernel does), ``scales``/``minima`` float16 ``(..., n_q/group, dim)``;
* value: ``codes`` uint8 ``(..., n_q, ceil(dim*bits/8))``, ``scales``/``minima`` float16
  ``(..., n_q, ceil(dim/group))``;
* ``residual`` float16 ``(..., n - n_q, dim)``.

Rate of the quantized part: ``bits + 32/group`` bits/element (3.0 at 2 bits, G=32) when the packed
rows have no padding (``group*bits`` resp. ``dim*bits`` a multiple of 8) and, for values, ``group``
divides ``dim``; the residual tokens cost 16 bits/element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .common import Encoded, Quantizer, as_array, to_fp
from .official import dequant_kernel, minmax_f16
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
        Full-precision length R (128 in KIVI's LongBench setting): keys keep the newest ``n mod R``
        tokens in float16 (a positive multiple of ``group``), values the newest ``min(n, R)``
        (``value_window="sliding"``) or ``n mod R`` (``"block"``).
    rule : {"official", "exact"}
        Quantization rule (module Notes).
    value_window : {"sliding", "block"}
        Which values stay float16 (module Notes); ignored for keys.

    Notes
    -----
    Idempotent with ``rule="exact"``: the uniform rule reproduces its own scales, minima and codes
    from the decoded values (see ``kvq_ref.uniform``), and float16 residual tokens decode exactly.
    """

    dim: int
    bits: int = 2
    role: str = "key"
    group: int = 32
    residual: int = 128
    rule: str = "official"
    value_window: str = "sliding"
    name: ClassVar[str] = "kivi"

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
        if self.rule not in ("official", "exact"):
            raise ValueError(f"rule must be 'official' or 'exact', got {self.rule!r}")
        if self.value_window not in ("sliding", "block"):
            raise ValueError(f"value_window must be 'sliding' or 'block', got {self.value_window!r}")
        if self.rule == "official" and self.role == "value" and self.dim % self.group:
            raise ValueError(f"rule='official' needs group to divide dim for values, got group={self.group}, "
                             f"dim={self.dim}")

    @property
    def idempotent(self) -> bool:  # type: ignore[override]
        return self.rule == "exact"

    def split(self, n: int) -> tuple[int, int]:
        """(quantized tokens, float16 tokens) once n tokens have been processed (module Notes)."""
        if self.role == "value" and self.value_window == "sliding":
            nq = max(0, n - self.residual)
            return nq, n - nq
        nr = n % self.residual
        return n - nr, nr

    def _quantize(self, x, axis):
        if self.rule == "exact":
            return quantize(x, self.bits, self.group, axis=axis)
        return minmax_f16(x, self.bits, self.group, axis=axis)

    def _dequantize(self, codes, scales, minima, axis):
        if self.rule == "exact":
            return dequantize(codes, scales, minima, self.group, axis=axis)
        return dequant_kernel(codes, scales, minima, self.group, axis=axis)

    def layout(self, shape):
        if len(shape) < 2:
            raise ValueError(f"KIVI needs shape (..., n, dim), got {tuple(shape)}")
        lead, n = tuple(shape[:-2]), int(shape[-2])
        nq, nr = self.split(n)
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
        nq, _ = self.split(x.shape[-2])
        xq = x[..., :nq, :]
        if self.role == "key":
            codes, scales, minima = self._quantize(xq, -2)
            rows = codes.reshape(x.shape[:-2] + (nq // self.group, self.group, self.dim)).swapaxes(-1, -2)
            packed = pack_codes(rows, self.bits)
        else:
            codes, scales, minima = self._quantize(xq, -1)
            packed = pack_codes(codes, self.bits)
        return self._make(x.shape, {"codes": packed, "scales": scales, "minima": minima,
                                    "residual": to_fp("residual", x[..., nq:, :], _F16)})

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        nq, _ = self.split(enc.shape[-2])
        a = enc.arrays
        if self.role == "key":
            rows = unpack_codes(a["codes"], self.bits, self.group).swapaxes(-1, -2)
            codes = rows.reshape(tuple(enc.shape[:-2]) + (nq, self.dim))
            xq = self._dequantize(codes, a["scales"], a["minima"], -2)
        else:
            codes = unpack_codes(a["codes"], self.bits, self.dim)
            xq = self._dequantize(codes, a["scales"], a["minima"], -1)
        return np.concatenate([np.asarray(xq, np.float64), a["residual"].astype(np.float64)],
                              axis=-2).astype(np.float32)
