"""The integer rules of the official KIVI, QuaRot and OSCAR implementations, step by step.

Notes
-----
Each function reproduces one official code path bit for bit (the rules and their sources: :ref:`ref-kivi`,
:ref:`ref-quarot`, :ref:`ref-oscar`; ``tests/interop`` checks every golden case). Notation:
``f16(v)``, ``f32(v)``, ``bf16(v)`` round to the nearest float16 / float32 / bfloat16, ties to even;
``rhe`` is round half to even (``np.rint``, torch.round). numpy evaluates one float16 operation in
float32 and rounds once to float16, which equals the correctly rounded float16 result (float32 has
more than ``2 * 11 + 2`` significand bits), i.e. what torch does for half tensors; float32 arrays
are computed in IEEE single precision. Kernels reproducing these rules must keep the order of the
operations below (no fused multiply-add).

* ``minmax_f16`` (KIVI's quantizer, QuaRot's INT kernel): per group, in float16 arithmetic,
  ``mn = min``, ``r = f16(max - mn)`` (QuaRot: ``r = max(r, f16(1e-5))``), ``scale = f16(r / L)``
  with ``L = 2^b - 1``, ``code = clamp(rhe(f16(f16(x - mn) / scale)), 0, L)``. Float16 ``scale`` and
  ``mn`` are stored (QuaRot stores ``zero = -mn``). A group with ``scale == 0`` (constant, KIVI: the
  official code divides 0/0 and the cast is undefined) gets codes 0: our defined result.
  ``dequant_kernel`` is what the attention kernels read, ``f32(scale * code + mn)`` (the product is
  exact, one rounding); ``dequant_f16`` the python references ``f16(f16(code * scale) + mn)``.
* ``bf16_matmul`` (OSCAR's row rotation ``y = x R`` in bfloat16): ``bf16(sum_k f32 x_k R_kj)`` with
  bfloat16 ``x`` and ``R``; every product is exact in float32 (8 x 8 significand bits), the sum is
  accumulated in float32 in index order k = 0, 1, ..., d - 1 (one rounding per addition; what
  OpenBLAS's sgemm does, and what reproduces all 24,576 public and hidden golden values: the float64
  product rounded once to bfloat16 misses one by one ulp), then rounded to bfloat16.
* ``oscar_threshold`` / ``oscar_quantize`` (OSCAR's set kernels and decode flush): symmetric clip of
  each row at the order statistic of ``|y|`` at index ``c = int(ratio * d)`` (sort) or at the
  float32 bisection of the flush kernel, then an asymmetric float32 quantizer with a float zero
  point and round half up: ``scale = f32(max(f32(mx - mn), f32(1e-8)) / L)``, ``zero = f32(-mn /
  scale)``, ``code = trunc(clamp(f32(f32(f32(y / scale) + zero) + 0.5), 0, L))``; decode
  ``f32(f32(code - zero) * scale)``. ``pack_strided`` is the kernels' byte layout.
* ``quarot_fakequant_k`` / ``quarot_fakequant_v``: QuaRot's fake-quantization path (``--k_asym
  --v_asym``, groups of head_dim, clip ratio ``k_clip_ratio``/``v_clip_ratio``), float32 keys with
  the range forced to contain 0, float16 values without; integer zero points.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .threads import rows_parallel
from .uniform import check_bits, check_group

__all__ = ["to_bf16", "bf16_matmul", "minmax_f16", "dequant_kernel", "dequant_f16", "clip_index", "oscar_threshold",
           "oscar_quantize", "oscar_dequantize", "pack_strided", "unpack_strided", "quarot_fakequant_k",
           "quarot_fakequant_v", "QUAROT_RANGE_FLOOR"]

F16, F32 = np.float16, np.float32
#: QuaRot's kernel floor on a group's float16 range: ``f16(1e-5)`` (= 1.0013580322265625e-05).
QUAROT_RANGE_FLOOR = float(np.float16(1e-5))


def to_bf16(x) -> np.ndarray:
    """``bf16(f32(x))``: round to bfloat16 (ties to even), returned as float32 values.

    x : array_like, finite. The float32 step is exact for bfloat16 inputs and for the rows the
    rules here round (float32 products); a float64 value within 2^-24 relative of a bfloat16 tie
    can round differently from a direct float64 -> bfloat16 rounding.
    """
    u = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _groups(x, group: int, axis: int):
    """``x`` with ``axis`` moved last and cut into (..., n/group, group); group must divide n."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    n = x.shape[-1]
    if n % check_group("group", group):
        raise ValueError(f"group {group} must divide the axis length {n}")
    return x.reshape(x.shape[:-1] + (n // group, group))


def _ungroup(x, axis: int):
    return np.moveaxis(x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],)), -1, axis)


@rows_parallel
@njit(parallel=True, cache=True)
def _matmul_f32_in_order(xb, rb, out):
    """``out[i, j] = sum_k xb[i, k] * rb[k, j]`` in float32, k in order (SIMD across j only)."""
    for i in prange(xb.shape[0]):
        acc = out[i]
        acc[:] = 0
        for k in range(xb.shape[1]):
            a = xb[i, k]
            for j in range(rb.shape[1]):
                acc[j] += a * rb[k, j]


def bf16_matmul(x, R) -> np.ndarray:
    """``y = bf16(x_bf16 @ R_bf16)`` as a bfloat16 GEMM with in-order float32 accumulation (module Notes).

    Parameters
    ----------
    x : array_like (N, d), rounded to bfloat16 first; R : array_like (d, m), rounded to bfloat16.

    Returns
    -------
    ndarray (N, m) float32 holding bfloat16 values.

    Notes
    -----
    Every product of two bfloat16 values is exact in float32 (unless it underflows below 2^-126), so
    a fused multiply-add gives the same sums; only the order of the additions matters.
    """
    xb = np.ascontiguousarray(to_bf16(x))
    rb = np.ascontiguousarray(to_bf16(R))
    if xb.ndim != 2 or rb.ndim != 2 or xb.shape[1] != rb.shape[0]:
        raise ValueError(f"x (N, d) and R (d, m) must have matching inner dimensions, got {xb.shape} and {rb.shape}")
    out = np.empty((xb.shape[0], rb.shape[1]), np.float32)
    _matmul_f32_in_order(xb, rb, out)
    return to_bf16(out)


def minmax_f16(x, bits: int, group: int, axis: int = -1, range_floor: float = 0.0):
    """KIVI's / QuaRot's asymmetric min/max rule in float16 arithmetic (module Notes).

    Parameters
    ----------
    x : array_like, float16 (other dtypes are rounded to float16 first)
    bits : int, 1..8
    group : int
        Entries per group along ``axis`` (must divide its length).
    axis : int
    range_floor : float
        Lower bound on ``f16(max - min)`` (QuaRot: ``QUAROT_RANGE_FLOOR``; KIVI: 0).

    Returns
    -------
    codes : ndarray, uint8, shape of ``x``
    scale, mn : ndarray, float16, shape of ``x`` with ``axis`` of length ``n / group``
    """
    levels = F16((1 << check_bits("bits", bits)) - 1)
    with np.errstate(over="ignore"):
        xg = _groups(np.asarray(x).astype(F16), group, axis)
    if not np.all(np.isfinite(xg)):
        raise ValueError("x must be finite in float16 (|x| <= 65504)")
    mn, mx = xg.min(axis=-1), xg.max(axis=-1)
    with np.errstate(over="ignore"):
        r = np.maximum(mx - mn, F16(range_floor))
        if not np.all(np.isfinite(r)):
            raise ValueError("a group's range max - min overflows float16")
        scale = r / levels
        safe = np.where(scale > 0, scale, F16(1))
        u = (xg - mn[..., None]) / safe[..., None]
    codes = np.where(scale[..., None] > 0, np.clip(np.rint(u), 0, levels), 0)
    return _ungroup(codes.astype(np.uint8), axis), np.moveaxis(scale, -1, axis), np.moveaxis(mn, -1, axis)


def _expand(per_group, group: int, axis: int):
    return np.repeat(np.asarray(per_group), group, axis=axis)


def dequant_kernel(codes, scale, mn, group: int, axis: int = -1) -> np.ndarray:
    """``f32(scale * code + mn)``, what KIVI's and QuaRot's attention kernels read (float32).

    The float64 evaluation is exact (float16 operands, codes < 256), so one rounding to float32
    gives the kernels' result.
    """
    s = _expand(np.asarray(scale, np.float64), group, axis)
    m = _expand(np.asarray(mn, np.float64), group, axis)
    return (s * np.asarray(codes, np.float64) + m).astype(F32)


def dequant_f16(codes, scale, mn, group: int, axis: int = -1) -> np.ndarray:
    """``f16(f16(code * scale) + mn)``: KIVI's and QuaRot's python dequantization references."""
    s = _expand(np.asarray(scale, F16), group, axis)
    m = _expand(np.asarray(mn, F16), group, axis)
    with np.errstate(over="ignore"):
        return np.asarray(codes).astype(F16) * s + m


# --- OSCAR ------------------------------------------------------------------------------------------
def clip_index(ratio: float, d: int) -> int:
    """OSCAR's ``c = int(ratio * d)`` (double precision, truncated), limited to [0, d - 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float | np.floating) or not 0 < ratio <= 1:
        raise ValueError(f"clip ratio must be a number in (0, 1], got {ratio!r}")
    return min(max(int(float(ratio) * d), 0), d - 1)


def oscar_threshold(y, c: int, method: str = "sort") -> np.ndarray:
    """Per-row clip threshold of rows ``y`` (N, d), float32.

    ``"sort"``: the element at 0-based position ``c`` of ``sort(|y|)`` (the set kernels). ``"bisect"``:
    the decode-flush kernel's ``ceil(log2 d)`` float32 bisection steps, ``mid = f32(f32(lo + hi) *
    0.5)``, ``lo = mid`` while more than ``d - c`` entries exceed ``mid``, else ``hi = mid``; ``hi``.
    """
    a = np.abs(np.asarray(y, dtype=F32))
    d = a.shape[-1]
    if not 0 <= c < d:
        raise ValueError(f"clip index must be in 0..{d - 1}, got {c}")
    if method == "sort":
        return np.sort(a, axis=-1)[..., c]
    if method != "bisect":
        raise ValueError(f"threshold method must be 'sort' or 'bisect', got {method!r}")
    lo, hi = np.zeros(a.shape[:-1], F32), a.max(axis=-1)
    for _ in range(max(1, math.ceil(math.log2(d)))):
        mid = (lo + hi) * F32(0.5)
        above = np.count_nonzero(a > mid[..., None], axis=-1) > d - c
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return hi


def oscar_quantize(y, bits: int, group: int, threshold=None):
    """Clip rows ``y`` (N, d) at ``+-threshold`` (None: no clip) and quantize (module Notes).

    Returns
    -------
    codes : ndarray, uint8, (N, d)
    scale, zero : ndarray, float32, (N, d / group)
    """
    levels = F32((1 << check_bits("bits", bits)) - 1)
    y = np.asarray(y, dtype=F32)
    if threshold is not None:
        t = np.asarray(threshold, dtype=F32)[..., None]
        y = np.minimum(np.maximum(y, -t), t)
    yg = _groups(y, group, -1)
    mn, mx = yg.min(axis=-1), yg.max(axis=-1)
    scale = np.maximum(mx - mn, F32(1e-8)) / levels
    zero = -mn / scale
    u = (yg / scale[..., None] + zero[..., None]) + F32(0.5)
    codes = np.trunc(np.clip(u, 0, levels)).astype(np.uint8)
    return _ungroup(codes, -1), scale, zero


def oscar_dequantize(codes, scale, zero, group: int) -> np.ndarray:
    """``f32(f32(code - zero) * scale)`` per group, float32 (N, d)."""
    c = _groups(np.asarray(codes).astype(F32), group, -1)
    return _ungroup((c - np.asarray(zero, F32)[..., None]) * np.asarray(scale, F32)[..., None], -1)


def pack_strided(codes, bits: int) -> np.ndarray:
    """OSCAR's byte layout: with ``p = 8 / bits`` codes per byte and rows of d codes, byte ``i`` holds
    ``code[j * d/p + i]`` at bits ``[j * bits, (j + 1) * bits)``; shape (..., d / p), uint8."""
    codes = np.asarray(codes, dtype=np.uint8)
    per = 8 // check_bits("bits", bits)
    if 8 % bits or codes.shape[-1] % per:
        raise ValueError(f"strided packing needs bits in {{1, 2, 4, 8}} and d divisible by {per}")
    parts = codes.reshape(codes.shape[:-1] + (per, codes.shape[-1] // per)).astype(np.uint16)
    out = np.zeros(parts.shape[:-2] + parts.shape[-1:], np.uint16)
    for j in range(per):
        out |= parts[..., j, :] << (j * bits)
    return out.astype(np.uint8)


def unpack_strided(packed, bits: int) -> np.ndarray:
    """Inverse of ``pack_strided``: codes (..., d) uint8."""
    packed = np.asarray(packed, dtype=np.uint8)
    per = 8 // check_bits("bits", bits)
    mask = (1 << bits) - 1
    return np.concatenate([(packed >> (j * bits)) & mask for j in range(per)], axis=-1).astype(np.uint8)


# --- QuaRot fake quantization -----------------------------------------------------------------------------
def quarot_fakequant_k(y, bits: int, clip_ratio: float = 1.0):
    """QuaRot's fake-quant keys: rows ``y`` (N, d) quantized per row in float32 (module Notes).

    ``xmin = f32(min(row_min, 0) * c)``, ``xmax = f32(max(row_max, 0) * c)`` (both 0: -1, +1),
    ``scale = f32(f32(xmax - xmin) / L)``, ``zero = rhe(f32(-xmin / scale))``,
    ``code = clamp(rhe(f32(y / scale)) + zero, 0, L)``, output ``f16(f32(scale * (code - zero)))``.

    Returns codes uint8 (N, d), scale float32 (N,), zero float32 (N,), out float16 (N, d).
    """
    L = F32((1 << check_bits("bits", bits)) - 1)
    y = np.asarray(y, dtype=F32)
    c = F32(clip_ratio)
    xmin = np.minimum(y.min(axis=-1), F32(0)) * c
    xmax = np.maximum(y.max(axis=-1), F32(0)) * c
    both = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(both, F32(-1), xmin), np.where(both, F32(1), xmax)
    scale = (xmax - xmin) / L
    zero = np.rint(-xmin / scale)
    q = np.clip(np.rint(y / scale[:, None]) + zero[:, None], 0, L)
    return q.astype(np.uint8), scale, zero, (scale[:, None] * (q - zero[:, None])).astype(F16)


def quarot_fakequant_v(y, bits: int, clip_ratio: float = 1.0):
    """QuaRot's fake-quant values: rows (N, d), float16 arithmetic, range not forced to contain 0.

    ``xmax = f16(f32(row_max * f32(c)))``, ``xmin`` likewise (both 0: -1, +1), ``scale = f16(f16(xmax -
    xmin) / L)``, ``zero = rhe(f16(-xmin / scale))``, ``code = clamp(f16(rhe(f16(y / scale)) + zero), 0,
    L)``, output ``f16(scale * f16(code - zero))``. A constant non-zero row has scale 0 (the official
    output is NaN); it raises ValueError here.

    Returns codes uint8 (N, d), scale float16 (N,), zero float16 (N,), out float16 (N, d).
    """
    L = F16((1 << check_bits("bits", bits)) - 1)
    y = np.asarray(y).astype(F16)
    c = F32(clip_ratio)
    xmax = (y.max(axis=-1).astype(F32) * c).astype(F16)
    xmin = (y.min(axis=-1).astype(F32) * c).astype(F16)
    both = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(both, F16(-1), xmin), np.where(both, F16(1), xmax)
    scale = (xmax - xmin) / L
    if np.any(scale == 0):
        raise ValueError("a constant non-zero row has scale 0 on QuaRot's fake-quant value path (NaN officially)")
    zero = np.rint(-xmin / scale)
    q = np.clip(np.rint(y / scale[:, None]) + zero[:, None], F16(0), L)
    return q.astype(np.uint8), scale, zero, scale[:, None] * (q - zero[:, None])
