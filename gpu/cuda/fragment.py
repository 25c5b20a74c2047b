"""The fragment layout of the CUDA decode kernel, its byte-permute (PRMT) lookups, and exact conversions.

The CUDA split kernel (``kvq_frag_attention.cu``) feeds ``mma.sync.m16n8k16`` straight from packed codes.
Its cache is kept in a *fragment layout* that the append kernel (``kvq_frag_append.cu``) writes: the
codes of 16 tokens (a tile) are stored so that the 32-bit words lane ``L`` of a warp loads are exactly
the codes of its MMA fragments, and a short list of integer instructions turns each word into fp16
pairs. This module is the specification both kernels follow, in numpy:

* ``tile_offsets`` / ``pack_tiles`` / ``unpack_tiles``: where every code bit and norm of a tile goes,
  and the exact conversion both ways to kvq_ref's bit stream (``kvq_ref.packing``) and float16 norms;
* ``prmt`` (PTX ``prmt.b32``, default mode) and ``decode_words``: the lookup instruction list of each
  bit width, operation for operation as the CUDA code issues it (``lop3`` = ``&``/``|``/``^``,
  ``imad`` = multiply-add mod 2^32, ``imad_hi`` = high word of the product plus an addend);
* ``pools``: the level tables as byte pools held in registers (2 or 4 words per bit width).

Tile of a (page, KV head): ``tile_bytes(d, kb, vb) = 2 d (kb + vb) + 64`` bytes::

    [K codes: planes of 32 lanes x w bytes, w in 16, 8, 4] [V codes: same] [norms: 8 lanes-groups x 8 B]

Lane ``L = 4 g + t`` holds ``d b / 2`` codes of K (and of V) as ``d b / 64`` words; the words are cut
into planes of 16, 8 and 4 bytes so that every load is a 16-byte (or 8/4-byte) vector load and a plane
is contiguous across lanes (coalesced). Norm group ``g`` is ``(kn[g], kn[g+8], vn[g], vn[g+8])``, fp16.

MMA fragments (PTX ISA, ``mma.m16n8k16`` with ``.f16`` A): register ``r`` of k-step (K) or m-tile (V)
``s`` holds two fp16 values. K (scores ``S^T = K Q^T``, A = 16 tokens x 16 coordinates): ``r = 0``
(token g, coords 16s+2t, +1), ``r = 1`` (token g+8, same), ``r = 2`` (token g, coords 16s+2t+8, +9),
``r = 3`` (token g+8, same). V (``O^T = V^T P^T``, A = 16 coordinates x 16 tokens): ``r = 0``
(coord 16s+g, tokens 2t, 2t+1), ``r = 1`` (coord 16s+g+8, same), ``r = 2`` (coord 16s+g, tokens
2t+8, 2t+9), ``r = 3`` (coord 16s+g+8, same). Half-register index ``i = 4 s + r`` runs over ``d/4``.

Lookup instruction lists (per decode group; ``w``: a loaded word, ``C2 = 0x4040``):

* 2 bits, 1 word -> 8 pairs. Codes at bit ``p`` (2 bits). For ``u = w >> 2k`` (k = 0..3, IMAD.HI),
  ``x = (u & 0x03030303) | Y16``; the selector ``imad(x, 17, 0x4040)`` has the nibbles ``(c0, c0 + 4,
  c1, c1 + 4)`` of the codes at ``2k`` and ``2k + 8``, and ``imad_hi(x, 17 << 16)`` those at ``2k + 16``
  and ``2k + 24`` (``Y16 = 0x7C40 << 16`` supplies its 0x4040: ``17 * 0x7C40 = 0x4040 mod 2^16``, and a
  high-word multiply-add would need a 64-bit addend). One PRMT over the pool ``(lo bytes of the 4
  levels, hi bytes)`` gives each fp16 pair. 4 LOP3 + 8 PRMT (ALU pipe), 11 IMAD (FMA pipe) per 16 codes.
* 3 bits, 3 words -> 16 pairs. 24 codes sit in nibbles (bits 0-2) of the three words, 8 more are
  spread over the nibbles' bit 3 (bit k of code n at bit 4n+3 of word k). Selector words
  ``w_k & 0x77777777`` and ``(m2 >> 1) | (m1 >> 2) | (m0 >> 3)`` with ``m_k = w_k & 0x88888888`` (IMAD.HI
  shifts); for the 4 nibbles of a selector (low half, or the high half shifted down by IMAD.HI):
  ``lo4 = prmt(lo bytes of the 8 levels, sel)``, ``hi4 = prmt(hi bytes, sel)``, pairs
  ``prmt(lo4, hi4, 0x5140)`` and ``prmt(lo4, hi4, 0x7362)``. 39 ALU + 7 IMAD per 32 codes.
* 4 bits, 1 word -> 4 pairs. Sign-magnitude over the symmetric table (``level[c] = -level[15-c]``):
  nibble n holds the magnitude index ``m`` (``c - 8`` or ``7 - c``) of code ``E_n`` in bits 0-2; bit 3 of
  the nibbles holds the negative flags, ordered so that ``w & 0x80808080`` are those of E0..E3 and
  ``(w << 4) & 0x80808080`` those of E4..E7 (the byte MSBs of the hi bytes they flip). 11 ALU + 2 IMAD
  per 8 codes.

No selector nibble ever has bit 3 set (PRMT's sign-replicate mode is never used; the tests check it).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvq_ref.packing import pack_codes, packed_size, unpack_codes

__all__ = ["TILE", "NORM_BYTES", "BITS", "DIMS", "lane_words", "plane_widths", "tile_bytes", "tile_offsets",
           "prmt", "pools", "decode_words", "fragment_slots", "pack_tiles", "unpack_tiles", "check_config"]

TILE = 16            # tokens per tile (the MMA's M for K, K for V)
NORM_BYTES = 64      # 16 tokens x (key norm, value norm) x float16
BITS = (2, 3, 4)
DIMS = (64, 128, 256)
_M32 = np.uint64(0xFFFFFFFF)


def check_config(d: int, bits: int) -> None:
    """ValueError unless (d, bits) is a fragment-layout configuration."""
    if d not in DIMS:
        raise ValueError(f"the fragment layout takes head_dim in {DIMS}, got {d}")
    if bits not in BITS:
        raise ValueError(f"the fragment layout takes 2, 3 or 4 bits, got {bits}")


def lane_words(d: int, bits: int) -> int:
    """32-bit words of one side (K or V) a lane holds per tile: ``d bits / 64``."""
    return d * bits // 64


def plane_widths(d: int, bits: int) -> tuple[int, ...]:
    """Bytes per lane of each plane of one side, largest first (16-byte planes, then 8, then 4)."""
    n = 4 * lane_words(d, bits)
    out = []
    for w in (16, 8, 4):
        while n >= w:
            out.append(w)
            n -= w
    return tuple(out)


def tile_bytes(d: int, kbits: int, vbits: int) -> int:
    """Bytes of one tile: K codes, V codes and the 16 x 2 float16 norms."""
    return 2 * d * (kbits + vbits) + NORM_BYTES


def _lane_byte_offsets(d: int, bits: int) -> np.ndarray:
    """(32, 4 * words) offsets inside one side's region of lane L's bytes, in word order."""
    out = np.zeros((32, 4 * lane_words(d, bits)), np.int64)
    base = start = 0
    for w in plane_widths(d, bits):
        for L in range(32):
            out[L, start:start + w] = base + L * w + np.arange(w)
        base += 32 * w
        start += w
    return out


# ---- the code positions of one decode group -----------------------------------------------------
_PAIRS2 = ((0, 8), (16, 24), (2, 10), (18, 26), (4, 12), (20, 28), (6, 14), (22, 30))
Y16 = 0x7C40 << 16   # 17 * 0x7C40 = 0x4040 (mod 2^16): the 2-bit high pairs' selector offset


@lru_cache(maxsize=None)
def _group(bits: int):
    """(words per group, pairs per group, fields): fields[j][h] = list of (word, bit) of the stored
    symbol of half h of pair j, least significant bit first. 2/3 bits store the code, 4 bits
    (magnitude index m: 3 bits, negative flag: 1 bit)."""
    if bits == 2:
        return 1, 8, tuple(tuple([(0, p), (0, p + 1)] for p in pair) for pair in _PAIRS2)
    if bits == 3:
        def nib(word, n):
            return [(word, 4 * n), (word, 4 * n + 1), (word, 4 * n + 2)]

        def spread(n):
            return [(0, 4 * n + 3), (1, 4 * n + 3), (2, 4 * n + 3)]
        codes = [nib(k, n) for k in range(3) for n in range(8)] + [spread(n) for n in range(8)]
        return 3, 16, tuple((codes[2 * j], codes[2 * j + 1]) for j in range(16))
    if bits == 4:
        neg_bit = {0: 7, 1: 15, 2: 23, 3: 31, 4: 3, 5: 11, 6: 19, 7: 27}  # E_n's negative flag
        codes = [[(0, 4 * n), (0, 4 * n + 1), (0, 4 * n + 2), (0, neg_bit[n])] for n in range(8)]
        return 1, 4, tuple((codes[2 * j], codes[2 * j + 1]) for j in range(4))
    raise ValueError(f"bits must be 2, 3 or 4, got {bits}")


def _to_symbol(codes: np.ndarray, bits: int) -> np.ndarray:
    """Stored symbol of each code: the code (2, 3 bits), or m | neg << 3 (4 bits)."""
    codes = codes.astype(np.int64)
    if bits != 4:
        return codes
    neg = codes < 8
    return np.where(neg, 7 - codes, codes - 8) | (neg.astype(np.int64) << 3)


def _from_symbol(sym: np.ndarray, bits: int) -> np.ndarray:
    if bits != 4:
        return sym.astype(np.uint8)
    m, neg = sym & 7, sym >> 3
    return np.where(neg == 1, 7 - m, 8 + m).astype(np.uint8)


@lru_cache(maxsize=None)
def fragment_slots(side: str, d: int) -> np.ndarray:
    """(32, d/4, 2, 2) int: for lane L, half-register i, half h: (token in tile, coordinate)."""
    out = np.zeros((32, d // 4, 2, 2), np.int64)
    for L in range(32):
        g, t = divmod(L, 4)
        for i in range(d // 4):
            s, r = divmod(i, 4)
            for h in range(2):
                if side == "k":
                    tok, coord = g + 8 * (r & 1), 16 * s + 2 * t + 8 * (r >> 1) + h
                elif side == "v":
                    coord, tok = 16 * s + g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + h
                else:
                    raise ValueError(f"side must be 'k' or 'v', got {side!r}")
                out[L, i, h] = tok, coord
    return out


@lru_cache(maxsize=None)
def tile_offsets(side: str, d: int, bits: int) -> np.ndarray:
    """(16, d, bits) int: bit address (8 * byte + bit, inside the side's region of a tile) of bit k of
    the stored symbol of (token, coordinate)."""
    check_config(d, bits)
    wpg, ppg, fields = _group(bits)
    lane_bytes = _lane_byte_offsets(d, bits)
    slots = fragment_slots(side, d)
    out = np.full((TILE, d, bits), -1, np.int64)
    for L in range(32):
        for i in range(d // 4):
            grp, j = divmod(i, ppg)
            for h in range(2):
                tok, coord = slots[L, i, h]
                for k, (word, bit) in enumerate(fields[j][h]):
                    wd = grp * wpg + word
                    out[tok, coord, k] = 8 * lane_bytes[L, 4 * wd + bit // 8] + bit % 8
    assert (out >= 0).all() and np.unique(out).size == out.size  # a bijection onto the region's bits
    return out


# ---- conversion from / to kvq_ref's bit stream ---------------------------------------------------
def _check_rows(name, rows, d, bits, n):
    rows = np.asarray(rows)
    if rows.dtype != np.uint8 or rows.shape != (n, packed_size(d, bits)):
        raise ValueError(f"{name} must be uint8 of shape ({n}, {packed_size(d, bits)}), got {rows.dtype} "
                         f"{rows.shape}")
    return rows


def pack_tiles(k_rows, k_norms, v_rows, v_norms, d: int, kbits: int, vbits: int) -> np.ndarray:
    """kvq_ref's packed rows and float16 norms of ``n`` tokens -> ``(ceil(n / 16), tile_bytes)`` uint8.

    Tokens past ``n`` in the last tile are zero (codes 0, norms +0).
    """
    check_config(d, kbits)
    check_config(d, vbits)
    k_norms, v_norms = np.asarray(k_norms), np.asarray(v_norms)
    if k_norms.dtype != np.float16 or v_norms.dtype != np.float16 or k_norms.ndim != 1 or k_norms.shape != v_norms.shape:
        raise ValueError("k_norms and v_norms must be float16 vectors of one length")
    n = k_norms.shape[0]
    ntiles = -(-n // TILE)
    out = np.zeros((ntiles, tile_bytes(d, kbits, vbits)), np.uint8)
    base = 0
    for name, rows, bits, side in (("k_rows", k_rows, kbits, "k"), ("v_rows", v_rows, vbits, "v")):
        codes = np.zeros((ntiles * TILE, d), np.int64)
        codes[:n] = unpack_codes(_check_rows(name, rows, d, bits, n), bits, d)
        sym = _to_symbol(codes, bits).reshape(ntiles, TILE, d)
        addr = tile_offsets(side, d, bits)                     # (16, d, bits)
        bitvals = (sym[..., None] >> np.arange(bits)) & 1      # (tiles, 16, d, bits)
        flat = np.zeros((ntiles, 16 * d * bits), np.uint8)
        flat[:, addr.reshape(-1)] = bitvals.reshape(ntiles, -1)
        region = np.packbits(flat, axis=1, bitorder="little")
        out[:, base:base + region.shape[1]] = region
        base += region.shape[1]
    norms = np.zeros((ntiles * TILE, 2), np.float16)
    norms[:n, 0], norms[:n, 1] = k_norms, v_norms
    nv = norms.view(np.uint16).reshape(ntiles, 2, 8, 2)        # (tile, half of tile, g, k/v)
    grouped = np.stack([nv[:, 0, :, 0], nv[:, 1, :, 0], nv[:, 0, :, 1], nv[:, 1, :, 1]], axis=-1)
    out[:, base:] = grouped.astype("<u2").view(np.uint8).reshape(ntiles, NORM_BYTES)
    return out


def unpack_tiles(tiles, n: int, d: int, kbits: int, vbits: int):
    """Inverse of ``pack_tiles``: (k_rows, k_norms, v_rows, v_norms) of the first ``n`` tokens, bit for bit."""
    tiles = np.asarray(tiles)
    if tiles.dtype != np.uint8 or tiles.ndim != 2 or tiles.shape[1] != tile_bytes(d, kbits, vbits):
        raise ValueError(f"tiles must be uint8 (ntiles, {tile_bytes(d, kbits, vbits)})")
    if not 0 <= n <= TILE * tiles.shape[0]:
        raise ValueError(f"n must be in 0..{TILE * tiles.shape[0]}, got {n}")
    ntiles = tiles.shape[0]
    out, base = [], 0
    for bits, side in ((kbits, "k"), (vbits, "v")):
        nbytes = 2 * d * bits
        flat = np.unpackbits(tiles[:, base:base + nbytes], axis=1, bitorder="little").astype(np.int64)
        addr = tile_offsets(side, d, bits)
        sym = (flat[:, addr] << np.arange(bits)).sum(-1)       # (tiles, 16, d)
        codes = _from_symbol(sym, bits).reshape(ntiles * TILE, d)[:n]
        out.append(pack_codes(codes, bits))
        base += nbytes
    nv = tiles[:, base:].copy().view("<u2").reshape(ntiles, 8, 4)
    kn = np.stack([nv[:, :, 0], nv[:, :, 1]], axis=1).reshape(-1)[:n].view(np.float16)
    vn = np.stack([nv[:, :, 2], nv[:, :, 3]], axis=1).reshape(-1)[:n].view(np.float16)
    return out[0], kn.copy(), out[1], vn.copy()


# ---- the lookup instruction lists (numpy model of the CUDA decoders) -----------------------------
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


def pools(levels, bits: int) -> np.ndarray:
    """The byte pools of a table as 4 uint32 (the kernel's register tables; unused words 0).

    2 bits: (lo bytes of fp16 level[0..3], hi bytes). 3 bits: (lo bytes of level[0..3], of [4..7],
    hi bytes of [0..3], of [4..7]). 4 bits: the same over the 8 magnitudes ``level[8..15]`` (the
    table must be symmetric in fp16: ``level[c] = -level[15 - c]``)."""
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
    m7, m8 = np.uint64(0x77777777), np.uint64(0x88888888)
    s3 = imad_hi(w0 & m8, 1 << 29) | imad_hi(w1 & m8, 1 << 30) | imad_hi(w2 & m8, 1 << 31)
    return [w0 & m7, w1 & m7, w2 & m7, s3]


def _lookup8(sel, pool):
    """3/4-bit: fp16 pairs of the 4 nibbles of ``sel`` (nibble n -> pair n // 2, half n % 2)."""
    lo4 = prmt(pool[0], pool[1], sel)
    hi4 = prmt(pool[2], pool[3], sel)
    return lo4, hi4


def decode_words(words, bits: int, pool) -> np.ndarray:
    """The lookup instruction list on a lane's words (..., n_words) uint32 -> fp16 pairs (..., 2 * n
    pairs... ) as uint32 (low half = first code), in half-register order ``i``."""
    w = _u32(words)
    pool = [np.uint64(p) for p in pool]
    out = []
    if bits == 2:
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


def selectors(words, bits: int) -> np.ndarray:
    """Every PRMT selector the lookup list forms from ``words`` (for checking that bit 3 of each used
    nibble is clear), (..., n) uint32; constant selectors (0x5140, 0x7362) are not included."""
    w = _u32(words)
    out = []
    for k in range(0, w.shape[-1], 3 if bits == 3 else 1):
        x = w[..., k]
        if bits == 2:
            out += _selectors2(x)
        elif bits == 3:
            out += [t for s in _selectors3(x, w[..., k + 1], w[..., k + 2]) for t in (s, imad_hi(s, 1 << 16))]
        else:
            sel = x & np.uint64(0x77777777)
            out += [sel, imad_hi(sel, 1 << 16)]
    return np.stack(out, axis=-1).astype(np.uint32)


def lane_words_of_tiles(tiles, side: str, d: int, kbits: int, vbits: int) -> np.ndarray:
    """The words lane L loads from each tile: (ntiles, 32, lane_words) uint32."""
    bits = kbits if side == "k" else vbits
    base = 0 if side == "k" else 2 * d * kbits
    offs = _lane_byte_offsets(d, bits) + base                   # (32, 4 words)
    b = np.asarray(tiles)[:, offs].astype(np.uint32)            # (tiles, 32, 4 words)
    b = b.reshape(b.shape[0], 32, -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
