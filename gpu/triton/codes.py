"""Triton device functions shared by the kernels: code streams and Walsh-Hadamard butterflies.

Layouts are kvq_ref's: the little-endian bit stream of ``kvq_ref.packing`` (code ``i`` of ``w``
bits at stream bits ``[i w, (i + 1) w)``, stream bit ``s`` = bit ``s % 8`` of byte ``s // 8``) and
the butterflies of ``kvq_ref.rotations.fwht_row`` (``(a, b) -> (a + b, a - b)`` for h = 1, 2, 4,
... within blocks, Sylvester order).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fwht_tile", "pack_store", "code_at"]


@triton.jit
def fwht_tile(y, BN: tl.constexpr, DP: tl.constexpr, LOG_B: tl.constexpr):
    """Unnormalized butterflies of every row of ``y`` (BN, DP) within blocks of ``2^LOG_B``.

    Stage by stage ``(a, b) -> (a + b, a - b)`` for h = 1, 2, ..., 2^(LOG_B - 1) (``fwht_row``'s
    operations in its order); DP is a power of two, a multiple of the block.
    """
    for s in tl.static_range(LOG_B):
        t = tl.reshape(y, (BN, DP // (2 << s), 2, 1 << s))
        t = tl.permute(t, (0, 1, 3, 2))
        a, b = tl.split(t)
        t = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        y = tl.reshape(t, (BN, DP))
    return y


@triton.jit
def pack_store(row_ptrs, codes, rmask, W: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr):
    """Store ``codes`` (BN, DP) of ``W`` bits as the rows' bit streams of ``NB`` bytes.

    ``row_ptrs`` (BN,) point at each row's first byte, ``rmask`` (BN,) marks real rows. Codes past
    a row's end must be zero (they become the padding bits of its last byte). Every 8 codes form
    one ``8 W``-bit word whose ``W`` little-endian bytes are stored; DP is a multiple of 8.
    """
    G: tl.constexpr = DP // 8
    c3 = tl.reshape(codes.to(tl.uint64), (BN, G, 8))
    shifts = (tl.arange(0, 8) * W).to(tl.uint64)
    words = tl.sum(c3 << shifts[None, None, :], axis=2)  # disjoint bit fields: sum == or
    g = tl.arange(0, G)
    for t in tl.static_range(W):
        byte = ((words >> (8 * t)) & 0xFF).to(tl.uint8)
        off = g * W + t
        tl.store(row_ptrs[:, None] + off[None, :], byte, mask=rmask[:, None] & (off < NB)[None, :])


@triton.jit
def code_at(ptrs, j, W: tl.constexpr, NB: tl.constexpr, mask):
    """Code ``j`` (int32) of the ``W``-bit streams of ``NB`` bytes at ``ptrs``.

    ``j`` is a scalar or a tensor broadcasting with ``ptrs`` and ``mask``; masked-off lanes read 0.
    """
    bit = j * W
    lo = bit // 8
    sh = bit % 8
    b = tl.load(ptrs + lo, mask=mask, other=0).to(tl.int32)
    if 8 % W != 0:  # the code may straddle into the next byte (read it when the row has one)
        nxt = (b * 0 + lo + 1) < NB  # a tensor even for a scalar j
        b = b | (tl.load(ptrs + lo + 1, mask=mask & nxt, other=0).to(tl.int32) << 8)
    return (b >> sh) & ((1 << W) - 1)
