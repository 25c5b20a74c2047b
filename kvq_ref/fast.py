"""Fused Numba CPU kernels for TurboQuantMSE with the Hadamard rotation.

``encode_fast(q, x)`` and ``decode_fast(q, enc)`` produce exactly what ``q.encode``/``q.decode``
produce (same ``Encoded`` bytes, same float32 output) but do the whole pipeline per vector in one
pass: norm, ``(x/||x||) * D1`` gathered by the permutation, the block Walsh-Hadamard butterflies,
``1/sqrt(b)`` and ``D2``, the threshold search and the bit packing (encode); unpacking, the level
lookup and the inverse rotation (decode). They own no math of their own: the row norm, the
butterflies and the packing are the shared ``kvq_ref`` row functions, and the tests compare them
with the spec path byte for byte. This is the CPU counterpart of the ``gpu/`` kernels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .common import Encoded, as_array, fp_dtype, row_norm, to_fp
from .packing import pack_row, unpack_row
from .rotations import HadamardRotation, fwht_row
from .threads import rows_parallel
from .turboquant import TurboQuantMSE

__all__ = ["encode_fast", "decode_fast"]

_CHUNK = 256  # rows per task: one scratch buffer per task


def _buckets(t: np.ndarray, levels: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
    """Lookup grid for ``_count_below``: ``(lo, 1/width, first, padded thresholds)``.

    Uniform buckets over three times the levels' range, each narrower than 2/5 of the smallest
    threshold gap, with ``first[b] = #{t < edge_b}``. Then at most one threshold lies between a
    bucket's edge and any input in it (or in its neighbour, should the bucket index round), so one
    branch-free step in each direction gives the exact count. ``padded`` is ``t`` with -inf
    in front and +inf behind, so both steps index safely.
    """
    span = levels[-1] - levels[0]
    gap = np.min(np.diff(t)) if t.size > 1 else span
    lo = levels[0] - span
    nb = int(math.ceil(3.0 * span / (0.4 * gap))) + 1
    width = 3.0 * span / (nb - 1)
    first = np.searchsorted(t, lo + width * np.arange(nb), side="left").astype(np.int32)
    padded = np.concatenate([[-np.inf], t, [np.inf]])
    return lo, 1.0 / width, first, padded


@njit(cache=True)
def _count_below(padded, y, lo, inv_width, first):
    """#{t_i < y} (= searchsorted(t, y, 'left')): a bucket lookup and one branch-free step each way."""
    f = max((y - lo) * inv_width, 0.0)
    c = first[min(int(f), first.shape[0] - 1)]
    c += padded[c + 1] < y
    c -= padded[c] >= y
    return c


@rows_parallel
@njit(parallel=True, cache=True)
def _encode(x, signs1, perm, signs2, block, padded, lo, inv_width, first, levels, bits, norm_correction,
            codes_out, scale_out):
    n, d = x.shape
    inv_sqrt = 1.0 / math.sqrt(block)
    identity = block == d  # no permutation for a power-of-two d
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        buf = np.empty(d)
        idx = np.empty(d, dtype=np.uint8)
        for r in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
            row = x[r]
            norm = row_norm(row)
            inv = 1.0 / norm if norm > 0.0 else 0.0
            if identity:
                for j in range(d):
                    buf[j] = (np.float64(row[j]) * inv) * signs1[j]
            else:
                for j in range(d):
                    k = perm[j]
                    buf[j] = (np.float64(row[k]) * inv) * signs1[k]
            fwht_row(buf, block)
            for j in range(d):
                idx[j] = _count_below(padded, (buf[j] * inv_sqrt) * signs2[j], lo, inv_width, first)
            pack_row(idx, bits, codes_out[r])
            if norm_correction:
                cn = 0.0
                for j in range(d):
                    cn += levels[idx[j]] * levels[idx[j]]
                scale_out[r] = norm / math.sqrt(cn)
            else:
                scale_out[r] = norm


@rows_parallel
@njit(parallel=True, cache=True)
def _decode(packed, scale, levels, bits, signs1, inv_perm, signs2, block, out):
    n, d = out.shape
    inv_sqrt = 1.0 / math.sqrt(block)
    bad = 0
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        buf = np.empty(d)
        idx = np.empty(d, dtype=np.uint8)
        for r in range(c * _CHUNK, min(n, (c + 1) * _CHUNK)):
            if not unpack_row(packed[r], bits, idx):
                bad += 1
            s = scale[r]
            for j in range(d):
                buf[j] = (levels[idx[j]] * s) * signs2[j]
            fwht_row(buf, block)
            for j in range(d):
                out[r, j] = (buf[inv_perm[j]] * inv_sqrt) * signs1[j]
    return bad


def _rotation(q: TurboQuantMSE) -> HadamardRotation:
    if not isinstance(q, TurboQuantMSE) or q.rotation != "hadamard":
        raise ValueError("the fused kernels implement TurboQuantMSE with rotation='hadamard'")
    return q.rot


def encode_fast(q: TurboQuantMSE, x) -> Encoded:
    """``q.encode(x)`` in one fused pass per vector (identical Encoded).

    Parameters
    ----------
    q : TurboQuantMSE
        With ``rotation="hadamard"``.
    x : array_like, shape (..., q.dim), float32 or float64
    """
    rot = _rotation(q)
    arr = np.asarray(x)
    if arr.dtype not in (np.float32, np.float64):
        arr = as_array("x", arr, dim=q.dim)
    if arr.ndim < 1 or arr.shape[-1] != q.dim:
        raise ValueError(f"x must have last dimension {q.dim}, got shape {arr.shape}")
    flat = np.ascontiguousarray(arr.reshape(-1, q.dim))
    if not np.all(np.isfinite(flat)):
        raise ValueError("x contains NaN or Inf")
    codes = np.empty((flat.shape[0], (q.dim * q.bits + 7) // 8), dtype=np.uint8)
    scale = np.empty(flat.shape[0])
    lo, inv_width, first, padded = _buckets(q.table.thresholds, q.table.levels)
    _encode(flat, rot.signs1, rot.perm, rot.signs2, rot.block, padded, lo, inv_width, first,
            q.table.levels, q.bits, q.norm_correction, codes, scale)
    lead = arr.shape[:-1]
    return q._make(arr.shape, {"codes": codes.reshape(lead + codes.shape[1:]),  # (-1,) fails on zero rows
                               "norms": to_fp("norms", scale, fp_dtype(q.norm_dtype)).reshape(lead)})


def decode_fast(q: TurboQuantMSE, enc: Encoded) -> np.ndarray:
    """``q.decode(enc)`` in one fused pass per vector (identical float32 output)."""
    rot = _rotation(q)
    q._check(enc)
    packed = np.ascontiguousarray(enc.arrays["codes"].reshape(-1, enc.arrays["codes"].shape[-1]))
    scale = enc.arrays["norms"].reshape(-1).astype(np.float64)
    out = np.empty((packed.shape[0], q.dim), dtype=np.float32)
    if _decode(packed, scale, q.table.levels, q.bits, rot.signs1, rot.inv_perm, rot.signs2, rot.block, out):
        raise ValueError("packed codes have non-zero padding bits: corrupted buffer")
    return out.reshape(enc.shape)
