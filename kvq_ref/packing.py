"""Bit packing of 1..8-bit codes into bytes (the layout kernels must match).

Bit order (little-endian bit stream): codes are laid end to end, code ``i`` of a row occupying
stream bits ``[i*w, (i+1)*w)`` with its least significant bit first; stream bit ``s`` is bit
``s % 8`` of byte ``s // 8``. For w in {1, 2, 4, 8} a code never straddles bytes (code i sits at
bits ``w*(i % (8//w))`` of byte ``i // (8//w)``); for w in {3, 5, 6, 7} it can. A row of ``k``
codes takes ``ceil(k*w/8)`` bytes; unused high bits of the last byte are zero, and unpacking
refuses a row whose padding bits are set (a corrupted buffer).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .threads import rows_parallel

__all__ = ["packed_size", "pack_codes", "unpack_codes", "pack_row", "unpack_row"]


def packed_size(k: int, bits: int) -> int:
    """Bytes for ``k`` codes of ``bits`` bits: ``ceil(k * bits / 8)``."""
    return (k * bits + 7) // 8


@njit(cache=True)
def pack_row(codes, bits, out):
    """Pack one row of codes into ``out`` (uint8, ceil(k*bits/8) bytes) in the documented order."""
    k = codes.shape[0]
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: whole codes per byte (same layout, no carry between bytes)
        per = 8 // bits
        for pos in range(out.shape[0]):
            byte = 0
            for j in range(per):
                i = pos * per + j
                if i < k:
                    byte |= int(codes[i]) << (j * bits)
            out[pos] = byte
        return
    acc = 0
    nacc = 0
    pos = 0
    for i in range(codes.shape[0]):
        acc |= int(codes[i]) << nacc
        nacc += bits
        while nacc >= 8:
            out[pos] = acc & 0xFF
            acc >>= 8
            nacc -= 8
            pos += 1
    if nacc > 0:
        out[pos] = acc & 0xFF


@njit(cache=True)
def unpack_row(packed, bits, out):
    """Unpack ``out.shape[0]`` codes from one row; returns True when the padding bits are clean."""
    mask = (1 << bits) - 1
    k = out.shape[0]
    acc = 0
    nacc = 0
    pos = 0
    for i in range(k):
        while nacc < bits:
            acc |= int(packed[pos]) << nacc
            nacc += 8
            pos += 1
        out[i] = acc & mask
        acc >>= bits
        nacc -= bits
    return acc == 0


@rows_parallel
@njit(parallel=True, cache=True)
def _pack(codes, bits, out):
    for r in prange(codes.shape[0]):
        pack_row(codes[r], bits, out[r])


@rows_parallel
@njit(parallel=True, cache=True)
def _unpack(packed, bits, out):
    bad = 0
    for r in prange(packed.shape[0]):
        if not unpack_row(packed[r], bits, out[r]):
            bad += 1
    return bad


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes along the last axis.

    Parameters
    ----------
    codes : ndarray of unsigned ints, shape (..., k)
        Values in ``0 .. 2**bits - 1``.
    bits : int
        1..8.

    Returns
    -------
    ndarray of uint8, shape (..., ceil(k * bits / 8))
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must be in 0..{(1 << bits) - 1} for {bits}-bit packing")
    k = codes.shape[-1]
    flat = np.ascontiguousarray(codes.reshape(-1, k), dtype=np.uint8)
    out = np.zeros((flat.shape[0], packed_size(k, bits)), dtype=np.uint8)
    _pack(flat, bits, out)
    return out.reshape(codes.shape[:-1] + (out.shape[-1],))


def unpack_codes(packed: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Inverse of ``pack_codes``: uint8 codes of shape ``(..., k)``.

    Raises
    ------
    ValueError
        If the last axis is not ``ceil(k * bits / 8)`` bytes or padding bits are set.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.shape[-1] != packed_size(k, bits):
        raise ValueError(f"packed codes must be uint8 with {packed_size(k, bits)} bytes per row, "
                         f"got {packed.dtype} with {packed.shape[-1]}")
    flat = np.ascontiguousarray(packed.reshape(-1, packed.shape[-1]))
    out = np.empty((flat.shape[0], k), dtype=np.uint8)
    if _unpack(flat, bits, out):
        raise ValueError("packed codes have non-zero padding bits: corrupted buffer")
    return out.reshape(packed.shape[:-1] + (k,))
