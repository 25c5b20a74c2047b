"""The llama.cpp TurboQuant fork's block formats turbo2/turbo3/turbo4, byte for byte, per profile.

Notes
-----
:ref:`ref-llama-cpp-blocks`. One block is one vector of ``block`` values (128: one attention head);
``dim == block``. The layout, sign vectors, tables and rules come from a profile
(``kvq_ref.turbo_profiles``; records in ``kvq_ref/data/turbo_profiles.json``). Shipped:

=====================  ===============================  ==========  ======================  ==================
profile                reproduces                       signs       tables                  rules
=====================  ===============================  ==========  ======================  ==================
fork@69d8e4be          the fork at 69d8e4be (default)   the fork's  the fork's (float32)    float32, tie high
fork@69d8e4be+exact    the fork at 69d8e4be rewritten   the fork's  Lloyd-Max (float32)     float32, tie high
                       by ``kvq-codebooks export
                       --apply-to``
kvq                    this toolkit's earlier blocks    seeded      Lloyd-Max (float64)     float64, tie low
=====================  ===============================  ==========  ======================  ==================

Encoding, every profile (norm correction: the decoded norm is the input norm)::

    n = ||x||,  u = x / n  (u = 0 if n <= tiny),  y = D(s2) (H / sqrt(block)) D(s1) u
    idx_j = cell of y_j,  c = levels[idx],  gamma = fp16(n / ||c||)  (n if ||c|| <= tiny)
    x_hat = gamma R^T c

Float32 rule (the fork's CPU reference; kernels must match it step for step). The input is
rounded to float32. ``n^2 = sum_j x_j * x_j`` left to right, every product and sum rounded to
float32 (no FMA); ``n = sqrtf(n^2)``; ``inv = 1/n`` (float32) if ``n > tiny`` (tiny = float32
1e-10) else 0; ``u_j = x_j * inv``; ``u_j *= s1_j``; butterflies for h = 1, 2, ..., block/2:
``(u_j, u_(j+h)) = (a + b, a - b)`` for j in [i, i+h), i = 0, 2h, ...; ``u_j *= (scale * s2_j)``
with the profile's float32 ``rotation_scale``. Index: the first i with ``y_j < t_i`` (strict),
else the last: a value on a threshold takes the HIGHER cell (y = 0 takes 2^(b-1)). Then
``r^2 = sum_j levels[idx_j]^2`` (float32, left to right), ``gamma = n / sqrtf(r^2)`` if
``sqrtf(r^2) > tiny`` else ``n``, rounded to fp16 (nearest even). Decoding in the rotated domain
(the fork's ``dequantize_row_*``; it rotates queries instead) is ``levels[idx_j] * float(gamma)``
in float32; the original domain is its inverse, in float32: ``y_j *= s2_j``, the same butterflies,
``y_j *= (scale * s1_j)``.

Float64 rule (profile ``kvq``): ``kvq_ref.turboquant.quantize_rotated`` (ties take the lower cell),
decoding ``R^T (levels[idx] * gamma)`` in float64 rounded to float32; the gpu/ kernels match it.

Byte layout (little-endian; blocks concatenated in C order), from the profile::

    fmt     block 128                                  block 32 (profile kvq only)
    turbo2  norm fp16 | qs[32]             34 B 2.125  norm | qs[8]            10 B  2.5
    turbo3  norm fp16 | qs[32] | signs[16] 50 B 3.125  norm | qs[8] | signs[4] 14 B  3.5
    turbo4  norm fp16 | zero fp16 | qs[64] 68 B 4.25   norm | qs[16]           18 B  4.5

``qs`` of turbo2/turbo3: 2-bit values, element j at bits ``2 (j % 4)`` of byte ``j / 4`` (turbo3
stores the low 2 bits of its 3-bit index there); ``signs``: the high bit of element j at bit
``j % 8`` of byte ``j / 8``; turbo4 ``qs``: element j at bits ``4 (j % 2)`` of byte ``j / 2``
(``kvq_ref.packing`` at 2, 1 and 4 bits). ``norm`` is gamma. A buffer whose norm is NaN/Inf or has
its sign bit set, or whose zero field is not zero, is refused with ``ValueError``.

Non-finite norms (float32 profiles; the fork's CPU reference, checked against it compiled in
``tests/interop/test_llama_cpp_rewrite.py``). gamma past the fp16 range (``n / ||c|| >= 65520``
rounds past 65504) is stored as +Inf (0x7C00) with the ordinary codes. ``n^2`` overflowing float32
(finite input, e.g. 1e20) gives n = +Inf, ``inv = 1/n = 0``, u = 0: every index 2^(b-1), norm +Inf.
Inf in the input: ``u = x * 0`` is NaN there and the butterflies spread it, so every index is the
last (NaN < t is false), norm +Inf. NaN in the input: n is NaN (its sign: the first NaN's), not
above tiny, so ``inv = 0``; turbo2/turbo3 compute ``u = x * 0`` (NaN everywhere: every index the
last), turbo4 sets u to 0 (the profile's ``zero_unit``: every index 2^(b-1)); the norm is NaN,
written 0x7E00 with that sign. Decoding multiplies as always: a +Inf norm gives +-Inf rotated
values, NaN gives NaN (``decode_rotated`` is the fork's dequantize bit for bit); the original
domain mixes them through the butterflies (Inf - Inf = NaN). ``from_bytes``/``decode`` read these
blocks under every float32 profile; a negative norm (-0, < 0, -Inf), which the fork never writes,
is refused. ``encode`` writes them only with ``overflow="fork"``.

Deviations from the fork's CPU reference at 69d8e4be, measured (``benchmarks/bench_turbo_profiles.py``
-> ``benchmarks/results/turbo_profiles.json``: relative MSE ``||x - x_hat||^2 / ||x||^2`` of 20,000
Gaussian vectors, "keys" = 20,000 vectors with offset, unequally scaled channels):

* ``fork@69d8e4be`` (default): byte-identical on all 1,200 golden rows (400 inputs x 3 formats,
  733 blocks per format; ``tests/interop/test_llama_cpp_turboquant.py``). Kept deviations, none of
  which changes a byte the fork writes for finite input and scale: (1) where the fork writes a
  non-finite norm (below) ``encode`` raises ``ValueError`` unless ``overflow="fork"``; such
  blocks are always read and decoded as the fork does. (2) Inputs of any float dtype are accepted
  and rounded to float32 first, as the fork's float32 caller does. (3) ``decode`` returns the
  original domain (the inverse rule above; the fork applies it in its graph); ``decode_rotated``
  is the fork's dequantize. (4) The fork's 32-value storage blocks (QK_TURBO = 32 in other
  revisions: one 128-value rotation and norm, the norm copied into four 32-value blocks) are not
  offered: at 69d8e4be every block holds 128 values and no golden data pins the other layout.
* ``fork@69d8e4be+exact``: the tables only. The fork's tables are +0.004 %, +0.14 % and +109 %
  above the Lloyd-Max optimum of SphereMarginal(128) (exact audit); relative MSE turbo2 / turbo3 /
  turbo4 0.1189 / 0.0338 / 0.0092 against the fork's 0.1189 / 0.0338 / 0.0181, i.e. x1.000,
  x0.999, x0.508 (+-0.002) of the fork's on the same vectors (keys: x1.000, x0.992, x0.573).
  Indices agree with the fork's on 99.9 % / 99.1 % / 19 % of values; blocks are byte-identical on
  0 % / 4.9 % / 0 % (the norm field follows the table).
* ``kvq``: seeded signs, exact float64 tables, float64 arithmetic, ties to the lower cell: 0 % of
  blocks byte-identical with the fork; relative MSE at 128 values x1.001, x1.002, x0.508 of the
  fork's (Gaussian; the same as the exact profile within 2 SE). Its 32-value blocks (own rotation
  and norm per 32 values; 2.5 / 3.5 / 4.5 bits per value) reach 0.1119 / 0.0308 / 0.0082.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from codebooks import Codebook, SphereMarginal

from .common import Encoded, RotatedQuantizer, as_array, check_shape, codebook
from .rotations import STREAM_MISC, HadamardRotation, rng
from .turbo_profiles import DEFAULT_PROFILE, FORMATS, TurboProfile, get_profile
from .turboquant import quantize_rotated, rotated_unit

__all__ = ["TurboBlock", "FORMATS", "DEFAULT_PROFILE"]

_F32 = np.float32


def _butterflies32(u: np.ndarray) -> np.ndarray:
    """Unnormalized Walsh-Hadamard butterflies of rows (N, block) in float32, the fork's order."""
    n, d = u.shape
    h = 1
    while h < d:
        v = u.reshape(n, d // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        u = np.stack((a + b, a - b), axis=2).reshape(n, d)
        h *= 2
    return u


def _sum_squares32(v: np.ndarray) -> np.ndarray:
    """``sum_j v_j * v_j`` of rows (N, k) in float32, left to right, every step rounded."""
    s = np.zeros(v.shape[0], dtype=_F32)
    for j in range(v.shape[1]):
        s = s + v[:, j] * v[:, j]
    return s


@dataclass(frozen=True)
class TurboBlock(RotatedQuantizer):
    """A turbo2/turbo3/turbo4 block quantizer with a profile's byte layout and rules.

    Parameters
    ----------
    fmt : {"turbo2", "turbo3", "turbo4"}
        2, 3 or 4 bits per value.
    block : int
        Values per block (= vector dimension): 128; also 32 under profile ``"kvq"``.
    seed : int
        Seed of the two sign vectors; only profiles with seeded signs (``"kvq"``) take one other
        than 0.
    profile : str or TurboProfile
        ``"fork@69d8e4be"`` (default: the fork's bytes), ``"fork@69d8e4be+exact"``, ``"kvq"``, or
        a profile record of one's own (``TurboProfile.from_dict``).
    overflow : {"raise", "fork"}
        What ``encode`` does where the fork writes a non-finite norm. ``"raise"`` (default): a
        ``ValueError`` for NaN/Inf input and for a scale past the fp16 range. ``"fork"`` (float32
        profiles only): the fork's bytes for every input (module Notes, "Non-finite norms").

    Notes
    -----
    Not idempotent for every input. Re-encoding ``x_hat = gamma R^T c`` sees the rotated unit
    vector ``c / ||c||`` and the norm ``gamma ||c||``. When ``||c||`` lies in ``fixed_point_band``
    (from the table's invariant scales) every code is kept and the new scale is ``gamma`` again,
    so ``encode(decode(e)) == e``; ``||c||^2`` concentrates near ``1 - block * D`` (D the table's
    distortion) and Gaussian blocks of 128 stay inside, except 2 in 20,000 with the fork's turbo4
    table, whose band is the narrowest; very spiky rotated vectors leave it, and at 32 values
    (profile ``kvq``) ordinary Gaussian vectors do too (0.015 % for turbo3, 0.15 % for turbo4).
    Under float32 arithmetic the decoded values carry float32 rounding, so a block whose ``||c||``
    lies within about 1e-5 (relative) of the band's ends may also move. The law that always holds:
    decoded norms equal input norms to fp16 precision.
    """

    fmt: str = "turbo3"
    block: int = 128
    seed: int = 0
    profile: str | TurboProfile = DEFAULT_PROFILE
    overflow: str = "raise"
    name: ClassVar[str] = "turbo_block"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {self.fmt!r}")
        if not isinstance(self.profile, str | TurboProfile):
            raise TypeError(f"profile must be a profile name or a TurboProfile, got {type(self.profile).__name__}")
        spec = self.spec
        if isinstance(self.block, bool) or not isinstance(self.block, int | np.integer) or self.block not in spec.blocks:
            raise ValueError(f"block must be one of {list(spec.blocks)} under profile {spec.name!r}, got {self.block!r}")
        object.__setattr__(self, "block", int(self.block))
        spec.layout(self.fmt, self.block)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if spec.signs is not None and self.seed != 0:
            raise ValueError(f"seed must be 0 under profile {spec.name!r} (its sign vectors are fixed), got {self.seed!r}")
        if self.overflow not in ("raise", "fork"):
            raise ValueError(f"overflow must be 'raise' or 'fork', got {self.overflow!r}")
        if self.overflow == "fork" and spec.arithmetic != "float32":
            raise ValueError(f"overflow='fork' writes a fork's non-finite norms: profile {spec.name!r} has "
                             f"{spec.arithmetic} arithmetic, not the fork's float32 rule")

    @cached_property
    def spec(self) -> TurboProfile:
        """The resolved profile record."""
        return self.profile if isinstance(self.profile, TurboProfile) else get_profile(self.profile)

    @property
    def dim(self) -> int:
        return self.block

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt]

    @cached_property
    def block_layout(self):
        """The profile's ``BlockLayout`` of this format and block size."""
        return self.spec.layout(self.fmt, self.block)

    @property
    def bytes_per_block(self) -> int:
        """Stored bytes per block (34/50/68 at 128 values, 10/14/18 at 32 under ``kvq``)."""
        return self.block_layout.nbytes

    @property
    def _has_unused(self) -> bool:  # the gpu/ kernels' view of the kvq layouts
        return any(f[0] == "zero" for f in self.block_layout.fields)

    @property
    def _qs_offset(self) -> int:
        return 2 + sum(f[1] for f in self.block_layout.fields if f[0] == "zero")

    @cached_property
    def rot(self) -> HadamardRotation:
        """``D(s2) (H / sqrt(block)) D(s1)``: the profile's signs, or both from ``rng(seed, STREAM_MISC)``."""
        if self.spec.signs is not None:
            return HadamardRotation.from_signs(*(np.array(s, dtype=np.float64) for s in self.spec.signs))
        g = rng(self.seed, STREAM_MISC)
        s1 = g.choice(np.array([-1.0, 1.0]), size=self.block)
        s2 = g.choice(np.array([-1.0, 1.0]), size=self.block)
        return HadamardRotation.from_signs(s1, s2)

    @cached_property
    def codebook(self) -> Codebook | None:
        """The Lloyd-Max ``Codebook`` of SphereMarginal(block) when the profile uses it, else None."""
        return codebook(SphereMarginal(self.block), self.bits) if self.spec.tables is None else None

    @cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        fixed = self.spec.table(self.bits)
        if fixed is not None:
            return fixed
        dtype = _F32 if self.spec.arithmetic == "float32" else np.float64
        return self.codebook.levels.astype(dtype), self.codebook.thresholds.astype(dtype)

    @property
    def levels(self) -> np.ndarray:
        """The 2^bits levels, float32 (float64 under float64 arithmetic)."""
        return self._tables[0]

    @property
    def thresholds(self) -> np.ndarray:
        """The 2^bits - 1 thresholds, in the levels' dtype."""
        return self._tables[1]

    @property
    def fixed_point_band(self) -> tuple[float, float]:
        """Interval of ``||c||`` (norm of a block's levels) whose re-encode keeps every code.

        The reciprocal of the table's invariant scales (``Codebook.invariant_scales``, applied to
        this profile's levels and thresholds): re-encoding multiplies every level by ``1 / ||c||``.
        """
        tab = SimpleNamespace(levels=self.levels.astype(np.float64), thresholds=self.thresholds.astype(np.float64))
        lo, hi = Codebook.invariant_scales(tab)
        return 1.0 / hi, 1.0 / lo

    def cells(self, y) -> np.ndarray:
        """Indices (uint8) of rotated-domain values ``y`` under the profile's table and tie rule.

        Tie "high": the first i with ``y < t_i``, else the last (``searchsorted`` right); tie
        "low": ``#{t_i < y}``. Under float32 arithmetic ``y`` is compared as float32.
        """
        y = np.asarray(y, dtype=self.thresholds.dtype)
        side = "right" if self.spec.tie == "high" else "left"
        return np.searchsorted(self.thresholds, y, side=side).astype(np.uint8)

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
        if idx.size and (idx.min() < 0 or idx.max() >= 1 << self.bits):
            raise ValueError(f"indices must be in 0..{(1 << self.bits) - 1}")
        scales = np.asarray(scales)
        if scales.dtype != np.float16 or scales.shape != idx.shape[:1]:
            raise ValueError(f"scales must be float16 of shape ({idx.shape[0]},)")
        return self.block_layout.pack(idx.astype(np.uint8), scales)

    def unpack(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices (N, block) uint8 and scales (N,) float16 of blocks (N, bytes_per_block).

        Under float32 (fork) profiles a norm of +Inf or NaN is read: the fork writes them (module
        Notes, "Non-finite norms").

        Raises
        ------
        ValueError
            Wrong size, a norm no profile's encoder writes (negative, -0, -Inf; NaN/Inf under the
            float64 profile), or a non-zero zero field.
        """
        blocks = np.asarray(blocks)
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != self.bytes_per_block:
            raise ValueError(f"blocks must be uint8 of shape (N, {self.bytes_per_block}): corrupted buffer")
        idx, scales, zeros_ok = self.block_layout.unpack(blocks)
        if self.spec.arithmetic == "float32":
            if np.any(np.signbit(scales) & ~np.isnan(scales)):
                raise ValueError(f"{self.fmt} block norm is negative (-0, < 0 or -Inf), which the fork never "
                                 "writes: corrupted buffer")
        elif not np.all(np.isfinite(scales)) or np.any(np.signbit(scales)):
            raise ValueError(f"{self.fmt} block norm is NaN/Inf or negative (profile {self.spec.name!r} never "
                             "writes one): corrupted buffer")
        if not zeros_ok:
            raise ValueError(f"{self.fmt} block unused field is not zero: corrupted buffer")
        return idx, scales

    def to_bytes(self, enc: Encoded) -> bytes:
        """All blocks of ``enc`` concatenated (C order), ``bytes_per_block`` bytes each."""
        self._check(enc)
        return np.ascontiguousarray(enc.arrays["blocks"]).tobytes()

    def from_bytes(self, raw, shape) -> Encoded:
        """The ``Encoded`` of a tensor of ``shape`` (..., block) from its raw blocks (e.g. the fork's).

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
    def _rotated32(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The float32 rule's (norm (N,), rotated unit rows u (N, block)), float32."""
        x = flat.astype(_F32)
        s1, s2 = (np.array(s, dtype=_F32) for s in self.spec.signs or (self.rot.signs1, self.rot.signs2))
        norm = np.sqrt(_sum_squares32(x))
        big = norm > _F32(self.spec.tiny_norm)
        inv = np.divide(_F32(1), norm, out=np.zeros_like(norm), where=big)
        unit = x * inv[:, None]
        if self.fmt in self.spec.zero_unit:
            unit[~big] = 0  # memset (differs from x * 0 only for NaN input)
        return norm, _butterflies32(unit * s1) * (_F32(self.spec.rotation_scale) * s2)

    def compared(self, x) -> tuple[np.ndarray, np.ndarray]:
        """``(u, thresholds)``: the rotated unit coordinates (N, block) that ``encode`` compares with
        the thresholds, in the profile's arithmetic (float32 or float64), for tie tests."""
        flat = np.ascontiguousarray(as_array("x", x, dim=self.block).reshape(-1, self.block))
        if self.spec.arithmetic == "float32":
            return self._rotated32(flat)[1], self.thresholds
        return rotated_unit(flat, self.rot)[1], self.thresholds

    def _encode32(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The float32 rule (module Notes) on rows (N, block): indices uint8, gamma float32."""
        tiny = _F32(self.spec.tiny_norm)
        norm, u = self._rotated32(flat)
        idx = self.cells(u)
        recon = np.sqrt(_sum_squares32(self.levels[idx]))
        gamma = np.where(recon > tiny, norm / np.where(recon > tiny, recon, _F32(1)), norm)
        return idx, gamma

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., block) into blocks uint8 (..., bytes_per_block).

        Raises
        ------
        ValueError
            NaN/Inf in ``x``, or a block's scale ``||x|| / ||c||`` past the fp16 range (the fork
            would write +Inf), unless ``overflow="fork"``.
        """
        fork = self.overflow == "fork"
        x = as_array("x", x, dim=self.block, finite=not fork)
        flat = np.ascontiguousarray(x.reshape(-1, self.block))
        with np.errstate(over="ignore", invalid="ignore" if fork else "warn"):  # an overflow is reported below
            if self.spec.arithmetic == "float32":
                idx, gamma = self._encode32(flat)
            else:  # TurboQuant's rule with norm correction, shared with TurboQuantMSE and the gpu/ kernels
                idx, gamma = quantize_rotated(flat, self.rot, SimpleNamespace(levels=self.levels,
                                                                             thresholds=self.thresholds), True)
        with np.errstate(over="ignore", invalid="ignore"):
            scales = gamma.astype(np.float16)
        if fork:  # a NaN is written as the quiet NaN 0x7E00 with its sign (ggml's fp32 -> fp16)
            bits = scales.view(np.uint16)
            scales = np.where(np.isnan(scales), (bits & 0x8000) | 0x7E00, bits).astype(np.uint16).view(np.float16)
        elif not np.all(np.isfinite(scales)):
            rows = np.flatnonzero(~np.isfinite(scales))
            raise ValueError(f"x: the {self.fmt} block scale ||x|| / ||c|| of {rows.size} vector(s) (first: "
                             f"row {rows[0]}, {float(gamma[rows[0]]):.6g}) overflows float16 (max 65504), "
                             "where the fork would store +Inf; scale the input down")
        blocks = self.block_layout.pack(idx, scales)
        return self._make(x.shape, {"blocks": blocks.reshape(x.shape[:-1] + (self.bytes_per_block,))})

    def _parts(self, enc: Encoded):
        """(indices (N, block) uint8, scales (N,) float16) after validation."""
        self._check(enc)
        return self.unpack(enc.arrays["blocks"].reshape(-1, self.bytes_per_block))

    def _rotated(self, enc: Encoded) -> np.ndarray:
        idx, scales = self._parts(enc)
        if self.spec.arithmetic == "float32":  # +Inf/NaN norms give +-Inf/NaN rows, as the fork's dequantize
            return (self.levels[idx] * scales.astype(_F32)[:, None]).astype(np.float64)
        return self.levels[idx] * scales.astype(np.float64)[:, None]

    def nonfinite_rows(self, enc: Encoded) -> np.ndarray:
        """Rows (N,) bool whose stored norm is +Inf or NaN: the fork's overflow and NaN blocks, whose
        decode is non-finite by definition (module Notes); every other row decodes finite."""
        return ~np.isfinite(self._parts(enc)[1])

    def decode_rotated(self, enc: Encoded) -> np.ndarray:
        """``levels[idx] * gamma`` in the rotated domain (the fork's dequantize), float32, shape ``enc.shape``.

        Float32 products under float32 arithmetic (bit-exact with the fork); float64 rounded to
        float32 otherwise.
        """
        return self._rotated(enc).astype(_F32).reshape(enc.shape)

    def decode(self, enc: Encoded) -> np.ndarray:
        """``x_hat = gamma R^T c``, float32, shape ``enc.shape`` (the inverse rule of the module Notes)."""
        if self.spec.arithmetic == "float64":
            return super().decode(enc)
        y = self.decode_rotated(enc).reshape(-1, self.block)
        s1, s2 = (np.array(s, dtype=_F32) for s in self.spec.signs or (self.rot.signs1, self.rot.signs2))
        with np.errstate(invalid="ignore"):  # Inf - Inf = NaN in a block with a +Inf norm
            return (_butterflies32(y * s2) * (_F32(self.spec.rotation_scale) * s1)).reshape(enc.shape)
