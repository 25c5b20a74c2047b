"""Byte-permute (PRMT) lookups of the fragment kernel, in numpy: the CUDA decoders' instruction lists.

``decode_words`` runs, operation for operation, what ``kvq_frag.cuh`` issues on a lane's loaded words
(``gpu.cuda.fragment`` says which code sits where): ``&``, ``|``, ``^`` are LOP3, ``imad`` a multiply-add
mod 2^32, ``imad_hi`` the high word of a product plus an addend (``__umulhi``), ``prmt`` PTX
``prmt.b32`` in its default mode. ``pools`` gives the level tables as the byte pools the kernel holds
in registers; ``int8_levels`` the integer key levels of the 2-bit int8 path.

Instruction lists (per decode group; ``w``: a loaded word):

* fp16, 2 bits (values), 1 word -> 8 pairs. For ``u = w >> 2k`` (k = 0..3, IMAD.HI), ``x = (u &
  0x03030303) | Y16``; the selector ``imad(x, 17, 0x4040)`` has the nibbles ``(c0, c0 + 4, c1, c1 + 4)``
  of the codes at ``2k`` and ``2k + 8``, and ``imad_hi(x, 17 << 16)`` those at ``2k + 16`` and ``2k + 24``
  (``Y16 = 0x7C40 << 16`` supplies its 0x4040: ``17 * 0x7C40 = 0x4040 mod 2^16``; a high-word
  multiply-add would need a 64-bit addend). One PRMT over the pool ``(lo bytes of the 4 levels, hi
  bytes)`` gives each fp16 pair. 4 LOP3 + 8 PRMT (ALU pipe), 11 IMAD (FMA pipe) per 16 codes.
* int8, 2 bits (keys), 1 word -> the 4 quads of a k-step. ``sa = w & 0x77777777`` holds a code in bits
  0-1 of each nibble (bit 2 is the next code's low bit), ``sb = (w >> 1) & 0x77777777`` the other codes in
  bits 1-2 (bit 0 is a neighbour's high bit); quads ``prmt(A, A, sa)``, ``prmt(A, A, sa >> 16)``,
  ``prmt(B0, B1, sb)``, ``prmt(B0, B1, sb >> 16)`` over the int8 levels duplicated so that the junk bit does
  not matter: ``A = (L0, L1, L2, L3)``, ``(B0, B1) = (L0, L0, L1, L1, L2, L2, L3, L3)``. 2 LOP3 + 4 PRMT,
  3 IMAD.HI per 16 codes.
* fp16, 3 bits, 3 words -> 16 pairs. 24 codes sit in nibbles (bits 0-2) of the three words, 8 more are
  spread over the nibbles' bit 3 (bit k of code n at bit 4n+3 of word k). Selector words
  ``w_k & 0x77777777`` and ``(m0 >> 3) | (m1 >> 2) | (m2 >> 1)`` with ``m_k = w_k & 0x88888888`` (IMAD.HI
  shifts); for the 4 nibbles of a selector (low half, or the high half shifted down by IMAD.HI):
  ``lo4 = prmt(lo bytes of the 8 levels, sel)``, ``hi4 = prmt(hi bytes, sel)``, pairs
  ``prmt(lo4, hi4, 0x5140)`` and ``prmt(lo4, hi4, 0x7362)``. 39 ALU + 7 IMAD per 32 codes.
* fp16, 4 bits, 1 word -> 4 pairs. Sign-magnitude over the symmetric table (``level[c] =
  -level[15-c]``): nibble n holds the magnitude index of code ``E_n`` in bits 0-2; bit 3 of the nibbles
  holds the negative flags, ordered so that ``w & 0x80808080`` are those of E0..E3 and ``(w << 4) &
  0x80808080`` those of E4..E7 (the byte MSBs of the hi bytes they flip). 11 ALU + 2 IMAD per 8 codes.

No selector nibble ever has bit 3 set (PRMT's sign-replicate mode is never used; the tests check it).
"""

from __future__ import annotations

import numpy as np

from .fragment import Y16

__all__ = ["imad", "imad_hi", "prmt", "pools", "int8_levels", "decode_words", "selectors"]

_M32 = np.uint64(0xFFFFFFFF)
_M7, _M8 = np.uint64(0x77777777), np.uint64(0x88888888)


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & _M32


def imad(a, b, c=0):
    """IMAD: a * b + c mod 2^32."""
    return (_u32(a) * np.uint64(b) + np.uint64(c)) & _M32


def imad_hi(a, b, c=0):
    """IMAD.HI: the high 32 bits of a * b, plus c, mod 2^32 (``__umulhi(a, b) + c``)."""
    return (((_u32(a) * np.uint64(b)) >> np.uint64(32)) + np.uint64(c)) & _M32


def prmt(a, b, c):
    """PTX ``prmt.b32 d, a, b, c`` (default mode): byte n of d is byte ``c[4n+2:4n]`` of {b, a} (a is
    bytes 0-3), or, when ``c`` bit 4n+3 is set, that byte's sign bit replicated (0x00 or 0xFF)."""
    a, b, c = _u32(a), _u32(b), _u32(c)
    pool = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
    for n in range(4):
        sel = (c >> np.uint64(4 * n)) & np.uint64(15)
        byte = (pool >> ((sel & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * n)
    return out


def int8_levels(levels) -> tuple[np.ndarray, float, float]:
    """The int8 key levels of a symmetric 2-bit table: ``(L, sigma, eps)``, ``L = (-A, -B, B, A)`` int8.

    ``level[c] ~ L[c] / sigma``. Rule (exactly reproducible): over A = 1..127 with ``B = round(A b / a)``
    (``a > b > 0`` the table's magnitudes), the pair minimising ``eps = |A/a - B/b| / (A/a + B/b)``, the
    first (smallest A) among equal ones; ``sigma = (A/a + B/b) / 2``, so that ``|L[c] / sigma - level[c]|
    <= eps |level[c]|``. On the shipped tables eps is 0.8e-4 to 3.7e-4, the size of rounding the levels to
    float16 (0.4e-4 to 3.4e-4)."""
    lev = np.asarray(levels, dtype=np.float64)
    if lev.shape != (4,) or not np.array_equal(lev, -lev[::-1]) or not 0 < lev[2] < lev[3]:
        raise ValueError("int8 key levels need a symmetric, increasing 2-bit table")
    a, b = lev[3], lev[2]
    best = None
    for A in range(1, 128):
        B = int(round(A * b / a))
        if B < 1:
            continue
        eps = abs(A / a - B / b) / (A / a + B / b)
        if best is None or eps < best[0]:
            best = (eps, A, B)
    eps, A, B = best
    return np.array([-A, -B, B, A], np.int8), (A / a + B / b) / 2, eps


def pools(levels, bits: int, int8: bool = False) -> np.ndarray:
    """The byte pools of a table as 4 uint32 (the kernel's register tables; unused words 0).

    2 bits: (lo bytes of fp16 level[0..3], hi bytes). 3 bits: (lo bytes of level[0..3], of [4..7],
    hi bytes of [0..3], of [4..7]). 4 bits: the same over the 8 magnitudes ``level[8..15]`` (the
    table must be symmetric in fp16: ``level[c] = -level[15 - c]``). int8 (2-bit keys): ``(A, A, B0,
    B1)`` over ``int8_levels``: ``A = L0..L3``, ``B0 = L0 L0 L1 L1``, ``B1 = L2 L2 L3 L3`` (bytes)."""
    if int8:
        L = int8_levels(levels)[0].view(np.uint8).astype(np.uint64)

        def word8(bs):
            return int(sum(int(v) << (8 * i) for i, v in enumerate(bs)))
        A = word8(L)
        return np.array([A, A, word8([L[0], L[0], L[1], L[1]]), word8([L[2], L[2], L[3], L[3]])], np.uint32)
    h = np.asarray(levels, dtype=np.float64).astype(np.float16)
    if h.size != 1 << bits:
        raise ValueError(f"{bits}-bit table must have {1 << bits} levels, got {h.size}")
    if bits == 4:
        if not np.array_equal(h, -h[::-1]):
            raise ValueError("the 4-bit fragment lookup needs a table symmetric in float16")
        h = h[8:]
    u = h.view(np.uint16).astype(np.uint64)
    lo, hi = u & np.uint64(0xFF), u >> np.uint64(8)

    def word(bs):
        return int(sum(int(v) << (8 * i) for i, v in enumerate(bs)))
    if bits == 2:
        return np.array([word(lo), word(hi), 0, 0], np.uint32)
    return np.array([word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])], np.uint32)


def _selectors2(w):
    """The 8 selectors of a 2-bit word: for u = w >> 2k, x = (u & 0x03030303) | Y16,
    ``imad(x, 17, 0x4040)`` (codes 2k, 2k + 8) and ``imad_hi(x, 17 << 16)`` (2k + 16, 2k + 24)."""
    out = []
    for k in range(4):
        u = w if k == 0 else imad_hi(w, 1 << (32 - 2 * k))
        x = (u & np.uint64(0x03030303)) | np.uint64(Y16)
        out += [imad(x, 17, 0x4040), imad_hi(x, 17 << 16)]
    return out


def _selectors3(w0, w1, w2):
    """The 4 selector words of a 3-bit group: the nibble-form codes of each word, and the spread codes
    ``(w0 & 0x88888888) >> 3 | (w1 & ..) >> 2 | (w2 & ..) >> 1`` (shifts as IMAD.HI)."""
    s3 = imad_hi(w0 & _M8, 1 << 29) | imad_hi(w1 & _M8, 1 << 30) | imad_hi(w2 & _M8, 1 << 31)
    return [w0 & _M7, w1 & _M7, w2 & _M7, s3]


def _lookup8(sel, pool):
    """3/4-bit: fp16 pairs of the 4 nibbles of ``sel`` (nibble n -> pair n // 2, half n % 2)."""
    lo4 = prmt(pool[0], pool[1], sel)
    hi4 = prmt(pool[2], pool[3], sel)
    return lo4, hi4


def _selectors8(w):
    """The 4 selectors of an int8 key word: ``sa``, ``sa >> 16``, ``sb``, ``sb >> 16``."""
    sa = w & _M7
    sb = imad_hi(w, 1 << 31) & _M7
    return [sa, imad_hi(sa, 1 << 16), sb, imad_hi(sb, 1 << 16)]


def decode_words(words, bits: int, pool, int8: bool = False) -> np.ndarray:
    """The lookup instruction list on a lane's words (..., n_words) uint32 -> its fragment registers
    (..., n_registers) uint32 in register order ``i``: fp16 pairs (low half = first code), or for the
    int8 keys quads (byte j = code j)."""
    w = _u32(words)
    pool = [np.uint64(p) for p in pool]
    out = []
    if int8:
        for k in range(w.shape[-1]):
            sa, sah, sb, sbh = _selectors8(w[..., k])
            out += [prmt(pool[0], pool[1], sa), prmt(pool[0], pool[1], sah), prmt(pool[2], pool[3], sb),
                    prmt(pool[2], pool[3], sbh)]
    elif bits == 2:
        for k in range(w.shape[-1]):
            out += [prmt(pool[0], pool[1], s) for s in _selectors2(w[..., k])]
    elif bits == 3:
        for k in range(0, w.shape[-1], 3):
            w0, w1, w2 = w[..., k], w[..., k + 1], w[..., k + 2]
            for s in _selectors3(w0, w1, w2):
                for sel in (s, imad_hi(s, 1 << 16)):
                    lo4, hi4 = _lookup8(sel, pool)
                    out += [prmt(lo4, hi4, 0x5140), prmt(lo4, hi4, 0x7362)]
    elif bits == 4:
        for k in range(w.shape[-1]):
            x = w[..., k]
            sel = x & np.uint64(0x77777777)
            lo_a, hi_a = _lookup8(sel, pool)
            lo_b, hi_b = _lookup8(imad_hi(sel, 1 << 16), pool)
            hi_a = hi_a ^ (x & np.uint64(0x80808080))
            hi_b = hi_b ^ (imad(x, 16) & np.uint64(0x80808080))
            out += [prmt(lo_a, hi_a, 0x5140), prmt(lo_a, hi_a, 0x7362),
                    prmt(lo_b, hi_b, 0x5140), prmt(lo_b, hi_b, 0x7362)]
    else:
        raise ValueError(f"bits must be 2, 3 or 4, got {bits}")
    return np.stack(out, axis=-1).astype(np.uint32)


def selectors(words, bits: int, int8: bool = False) -> np.ndarray:
    """Every PRMT selector the lookup list forms from ``words`` (for checking that bit 3 of each used
    nibble is clear), (..., n) uint32; constant selectors (0x5140, 0x7362) are not included."""
    w = _u32(words)
    out = []
    for k in range(0, w.shape[-1], 3 if bits == 3 and not int8 else 1):
        x = w[..., k]
        if int8:
            out += _selectors8(x)
        elif bits == 2:
            out += _selectors2(x)
        elif bits == 3:
            out += [t for s in _selectors3(x, w[..., k + 1], w[..., k + 2]) for t in (s, imad_hi(s, 1 << 16))]
        else:
            sel = x & np.uint64(0x77777777)
            out += [sel, imad_hi(sel, 1 << 16)]
    return np.stack(out, axis=-1).astype(np.uint32)


