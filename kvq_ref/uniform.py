"""Asymmetric min/max integer quantization over groups along one axis (KIVI, QuaRot, QJL values).

Notes
-----
The array is cut along ``axis`` into groups of ``group`` consecutive entries (the last group may
be shorter: ``ceil(n / group)`` groups). With ``L = 2^b - 1`` levels above zero and clip ratio
``c`` (QuaRot's ``clip_ratio``; 1 means no clipping), every group (independently of the others)
stores a float16 minimum ``m``, a float16 scale ``s`` and one b-bit code per entry. The rule, which
kernels must follow step by step (float16 rounding is round-to-nearest-even unless stated):

1. ``lo = c * min(x)``, ``hi = c * max(x)`` over the group.
2. ``m = fp16(lo)``.
3. ``s = fp16(max(hi - m, 0) / L)``; if ``s > 0`` and ``code(hi) < L`` (possible only when ``s``
   is subnormal) ``s`` is lowered to the next float16 toward zero.
4. ``flat(m, s)`` means ``L * s <= 2^-10 * max(|m|, |m + L * s|)``: the spread is within about
   one float16 step of the group's magnitude. If ``hi == lo`` or ``flat(m, s)``: ``s = 0``.
5. Otherwise, if ``code(lo) > 0`` (a spread finer than the float16 step of ``lo``): ``m`` is
   raised to the next float16 (then ``m > lo``), step 3 is redone with this ``m``, and ``s = 0``
   if ``flat(m, s)``.
6. ``code(x) = clip(floor((x - m) / s + 1/2), 0, L)`` when ``s > 0``, else 0 (``code`` in steps
   3-5 is the same expression, unclipped). Decoding is ``m + s * code``.

Only the stored (rounded) ``m`` and ``s`` enter the codes, so decoding is consistent with encoding.
Steps 3 and 5 make the range ends take codes 0 and L; with ``c = 1`` they are the group's minimum and
maximum, so re-quantizing the dequantized values, even after rounding them to float32, returns
exactly the same codes, scales and minima (``flat`` keeps float32 rounding below the margins that
guarantee it). Without steps 3-5 this fails for groups whose spread is comparable to the float16
step of their minimum. A constant group (``max == min``) gets ``s = 0``, codes 0, and decodes to
``fp16(min)``. Error per element (``c = 1``): at most ``s/2`` for codes 1..L-1, at most
``max(s/2, m - lo, hi - m - L*s)`` in general (the last two are float16 rounding terms).
Overflow of float16 (minima beyond 65504, or scales ``(max - min) / L`` beyond it) raises
ValueError.

Storage (callers): codes are uint8 of the input's shape (pack them with ``kvq_ref.packing``);
``scales`` and ``minima`` are float16 of the input's shape with ``axis`` of length
``ceil(n / group)``. The rate is ``b + 32 / group`` bits per element for full groups.
"""

from __future__ import annotations

import numpy as np

from .common import to_fp

__all__ = ["RESOLUTION", "check_bits", "check_group", "check_clip_ratio", "group_starts", "group_range",
           "group_quantile_range", "stored_params", "quantize", "quantize_range", "dequantize"]

#: Step 5: spreads below this fraction of the group's magnitude are stored as constants.
RESOLUTION = 2.0**-10
_F16 = np.dtype(np.float16)


def check_bits(name: str, bits) -> int:
    """``bits`` as an int in 1..8, else ValueError naming ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or not 1 <= bits <= 8:
        raise ValueError(f"{name} must be an integer in 1..8, got {bits!r}")
    return int(bits)


def check_group(name: str, group) -> int:
    """``group`` as a positive int, else ValueError naming ``name``."""
    if isinstance(group, bool) or not isinstance(group, int | np.integer) or group < 1:
        raise ValueError(f"{name} must be a positive integer, got {group!r}")
    return int(group)


def check_clip_ratio(clip_ratio) -> float:
    """``clip_ratio`` as a float in (0, 1], else ValueError."""
    if isinstance(clip_ratio, bool) or not isinstance(clip_ratio, int | float | np.floating) \
            or not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be a number in (0, 1], got {clip_ratio!r}")
    return float(clip_ratio)


def group_starts(n: int, group: int) -> np.ndarray:
    """First index of every group of ``group`` entries in an axis of length ``n`` (last may be short)."""
    return np.arange(0, n, check_group("group", group))


def _expand(per_group: np.ndarray, n: int, group: int, axis: int) -> np.ndarray:
    """Repeat each group's value over its entries along ``axis`` (length ``n``)."""
    counts = np.diff(np.append(group_starts(n, group), n))
    return np.repeat(per_group, counts, axis=axis)


def group_range(x: np.ndarray, group: int, axis: int = -1, clip_ratio: float = 1.0):
    """Clipped range ``(lo, hi) = (c * min, c * max)`` of each group, float64.

    Parameters
    ----------
    x : ndarray, float64, shape (..., n, ...)
    group : int
    axis : int
    clip_ratio : float in (0, 1]

    Returns
    -------
    lo, hi : ndarray, float64, shape of ``x`` with ``axis`` of length ``ceil(n / group)``
    """
    c = check_clip_ratio(clip_ratio)
    x = np.asarray(x, dtype=np.float64)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n == 0:
        shape = x.shape
        return np.zeros(shape), np.zeros(shape)
    starts = group_starts(n, group)
    return c * np.minimum.reduceat(x, starts, axis=axis), c * np.maximum.reduceat(x, starts, axis=axis)


def group_quantile_range(x: np.ndarray, group: int, q: float, axis: int = -1):
    """Clipped range ``(lo, hi) = (quantile(1 - q), quantile(q))`` of each group (OSCAR's clipping).

    Quantiles use numpy's default linear interpolation between order statistics (kernels must match).
    """
    if isinstance(q, bool) or not isinstance(q, int | float | np.floating) or not 0.5 < q <= 1.0:
        raise ValueError(f"clip quantile must be a number in (0.5, 1], got {q!r}")
    x = np.asarray(x, dtype=np.float64)
    axis = axis % x.ndim
    starts = list(group_starts(x.shape[axis], group)) + [x.shape[axis]]
    parts = [np.take(x, range(a, b), axis=axis) for a, b in zip(starts[:-1], starts[1:])]
    lo = np.stack([np.quantile(p, 1.0 - q, axis=axis) for p in parts], axis=axis)
    hi = np.stack([np.quantile(p, q, axis=axis) for p in parts], axis=axis)
    return lo, hi


def _code(x, m, s, levels, clip=True):
    """``floor((x - m)/s + 1/2)`` (clipped to 0..L), 0 where ``s == 0``; float64."""
    safe = np.where(s > 0, s, 1.0)
    t = np.where(s > 0, np.floor((x - m) / safe + 0.5), 0.0)
    return np.clip(t, 0, levels) if clip else t


def _scale_for(lo, hi, m, levels):
    """Step 3: the float16 scale for minimum ``m`` (float16 array), lowered so code(hi) == L."""
    m64 = m.astype(np.float64)
    s = to_fp("scales", np.maximum(hi - m64, 0.0) / levels, _F16)
    short = (s > 0) & (_code(hi, m64, s.astype(np.float64), levels, clip=False) < levels)
    s[short] = np.nextafter(s[short], _F16.type(0))
    return s


def _flat(m, s, levels):
    """Step 4's test: spread ``L*s`` within ``RESOLUTION`` of the group's magnitude."""
    m64, s64 = m.astype(np.float64), s.astype(np.float64)
    return levels * s64 <= RESOLUTION * np.maximum(np.abs(m64), np.abs(m64 + levels * s64))


def stored_params(lo: np.ndarray, hi: np.ndarray, bits: int):
    """Steps 2-5 of the rule: float16 ``(scales, minima)`` for group ranges ``lo <= hi``.

    Parameters
    ----------
    lo, hi : ndarray, float64, same shape
    bits : int, 1..8

    Returns
    -------
    scales, minima : ndarray, float16, shape of ``lo``

    Raises
    ------
    ValueError
        A minimum or scale overflows float16.
    """
    levels = (1 << check_bits("bits", bits)) - 1
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    m = to_fp("minima", lo, _F16) + _F16.type(0)  # + 0 turns -0 into +0
    s = _scale_for(lo, hi, m, levels)
    s[_flat(m, s, levels) | (hi == lo)] = 0
    raise_m = (s > 0) & (_code(lo, m.astype(np.float64), s.astype(np.float64), levels, clip=False) > 0)
    if np.any(raise_m):
        with np.errstate(over="ignore"):
            m[raise_m] = np.nextafter(m[raise_m], _F16.type(np.inf))
        if not np.all(np.isfinite(m)):
            raise ValueError(f"minima overflow {_F16} (max {np.finfo(_F16).max:g}); the input is too large")
        s[raise_m] = _scale_for(lo[raise_m], hi[raise_m], m[raise_m], levels)
        s[_flat(m, s, levels)] = 0
    return s, m


def quantize(x, bits: int, group: int, axis: int = -1, clip_ratio: float = 1.0):
    """Quantize ``x`` in groups of ``group`` entries along ``axis`` (the module's rule).

    Parameters
    ----------
    x : ndarray, float64, shape (..., n, ...)
        Finite values (check them with ``kvq_ref.common.as_array``).
    bits : int
        1..8.
    group : int
        Group length along ``axis`` (the last group holds ``n - group * (ceil(n/group) - 1)``).
    axis : int
    clip_ratio : float in (0, 1]

    Returns
    -------
    codes : ndarray, uint8, shape of ``x``
    scales, minima : ndarray, float16, shape of ``x`` with ``axis`` of length ``ceil(n / group)``
    """
    x = np.asarray(x, dtype=np.float64)
    return quantize_range(x, *group_range(x, check_group("group", group), axis, clip_ratio), bits, group, axis)


def quantize_range(x, lo, hi, bits: int, group: int, axis: int = -1):
    """Quantize ``x`` with given per-group ranges ``lo <= hi`` (shapes as ``group_range`` returns).

    Returns (codes uint8, scales float16, minima float16) like ``quantize``.
    """
    x = np.asarray(x, dtype=np.float64)
    bits = check_bits("bits", bits)
    group = check_group("group", group)
    axis = axis % x.ndim
    n = x.shape[axis]
    s, m = stored_params(lo, hi, bits)
    if n == 0:
        return np.zeros(x.shape, np.uint8), s, m
    codes = _code(x, _expand(m.astype(np.float64), n, group, axis), _expand(s.astype(np.float64), n, group, axis),
                  (1 << bits) - 1)
    return codes.astype(np.uint8), s, m


def dequantize(codes, scales, minima, group: int, axis: int = -1) -> np.ndarray:
    """``minima + scales * codes`` with each group's float16 parameters, float64.

    Parameters
    ----------
    codes : ndarray of unsigned ints, shape (..., n, ...)
    scales, minima : ndarray, float16, shape of ``codes`` with ``axis`` of length ``ceil(n / group)``
    group : int
    axis : int

    Returns
    -------
    ndarray, float64, shape of ``codes``
    """
    codes = np.asarray(codes)
    group = check_group("group", group)
    axis = axis % codes.ndim
    n = codes.shape[axis]
    want = codes.shape[:axis] + (-(-n // group),) + codes.shape[axis + 1:]
    if np.shape(scales) != want or np.shape(minima) != want:
        raise ValueError(f"scales and minima must have shape {want} for codes of shape {codes.shape} "
                         f"in groups of {group} along axis {axis}, got {np.shape(scales)} and {np.shape(minima)}")
    s = _expand(np.asarray(scales, dtype=np.float64), n, group, axis)
    m = _expand(np.asarray(minima, dtype=np.float64), n, group, axis)
    return m + s * codes.astype(np.float64)
