"""The fragment layout of the CUDA decode kernel, and its exact conversions to kvq_ref's bit stream.

The CUDA split kernel (``kvq_frag_attention.cu``) feeds ``mma.sync`` straight from packed codes. Its
cache is kept in a *fragment layout* that the append kernel (``kvq_frag_append.cu``) writes: the codes
of 16 tokens (a tile) are stored so that the 32-bit words lane ``L`` of a warp loads are exactly the
codes of its MMA fragments, and a short list of integer instructions (``gpu.cuda.lookup``) turns each
word into fp16 pairs or int8 quads. This module is the specification of where everything goes:

* ``tile_offsets`` / ``pack_tiles`` / ``unpack_tiles``: every code bit and norm of a tile, and the
  exact conversion both ways to kvq_ref's bit stream (``kvq_ref.packing``) and float16 norms;
* ``fragment_slots``: which (token, coordinate) each fragment register of each lane holds.

Tile of a (page, KV head): ``tile_bytes(d, kb, vb) = 2 d (kb + vb) + 64`` bytes::

    [K codes: planes of 32 lanes x w bytes, w in 16, 8, 4] [V codes: same] [norms: 8 lanes-groups x 8 B]

Lane ``L = 4 g + t`` holds ``d b / 2`` codes of K (and of V) as ``d b / 64`` words; the words are cut
into planes of 16, 8 and 4 bytes so that every load is a 16-byte (or 8/4-byte) vector load and a plane
is contiguous across lanes (coalesced). Norm group ``g`` is ``(kn[g], kn[g+8], vn[g], vn[g+8])``, fp16.

MMA fragments (PTX ISA). ``mma.m16n8k16`` with ``.f16`` A: register ``r`` of k-step (K) or m-tile (V)
``s`` holds two fp16 values. K (scores ``S^T = K Q^T``, A = 16 tokens x 16 coordinates): ``r = 0``
(token g, coords 16s+2t, +1), ``r = 1`` (token g+8, same), ``r = 2`` (token g, coords 16s+2t+8, +9),
``r = 3`` (token g+8, same). V (``O^T = V^T P^T``, A = 16 coordinates x 16 tokens): ``r = 0``
(coord 16s+g, tokens 2t, 2t+1), ``r = 1`` (coord 16s+g+8, same), ``r = 2`` (coord 16s+g, tokens
2t+8, 2t+9), ``r = 3`` (coord 16s+g+8, same). Keys at 2 bits use ``mma.m16n8k32.s8`` instead
(``is_int8``): register ``r`` of k-step ``s`` holds four int8 values, token g + 8 (r & 1), coordinates
32 s + 16 (r >> 1) + 4 t + [0, 4).

Stored symbols: the code at 2 and 3 bits; at 4 bits (sign-magnitude over the symmetric table)
the magnitude index ``m`` (``c - 8`` or ``7 - c``) and a negative flag. Where each symbol bit sits in a
lane's words is ``_group`` (the lookup lists of ``gpu.cuda.lookup`` define it).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvq_ref.packing import pack_codes, packed_size, unpack_codes

__all__ = ["TILE", "NORM_BYTES", "BITS", "DIMS", "Y16", "lane_words", "plane_widths", "tile_bytes", "tile_offsets",
           "is_int8", "fragment_slots", "pack_tiles", "unpack_tiles", "lane_words_of_tiles", "check_config"]

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


def is_int8(side: str, bits: int) -> bool:
    """True for the keys at 2 bits: int8 fragments of ``mma.m16n8k32.s8`` (the ``k8`` kind)."""
    return side == "k" and bits == 2


@lru_cache(maxsize=None)
def _group(bits: int, int8: bool = False):
    """(words per group, units per group, fields): fields[j][h] = list of (word, bit) of the stored
    symbol of code h of unit j (an fp16 pair, or an int8 quad), least significant bit first. 2/3 bits
    store the code, 4 bits (magnitude index m: 3 bits, negative flag: 1 bit)."""
    if int8:  # one word = the 4 quads of a k-step: quad r, byte j at bit 4 j + 16 (r & 1) + 2 (r >> 1)
        return 1, 4, tuple(tuple([(0, 4 * j + 16 * (r & 1) + 2 * (r >> 1)), (0, 4 * j + 16 * (r & 1) + 2 * (r >> 1) + 1)]
                                 for j in range(4)) for r in range(4))
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
def fragment_slots(side: str, d: int, bits: int = 3) -> np.ndarray:
    """(32, units, codes per unit, 2) int: (token in tile, coordinate) of code h of register i of lane L.

    fp16 pairs (d/4 registers of 2 codes), or for the int8 keys (``is_int8``) quads (d/8 registers of 4
    codes): register ``i = 4 s + r`` of k-step s holds token g + 8 (r & 1), coordinates 32 s + 16 (r >> 1)
    + 4 t + [0, 4) (``mma.m16n8k32`` A fragment)."""
    int8 = is_int8(side, bits)
    units, per = (d // 8, 4) if int8 else (d // 4, 2)
    out = np.zeros((32, units, per, 2), np.int64)
    for L in range(32):
        g, t = divmod(L, 4)
        for i in range(units):
            s, r = divmod(i, 4)
            for h in range(per):
                if int8:
                    tok, coord = g + 8 * (r & 1), 32 * s + 16 * (r >> 1) + 4 * t + h
                elif side == "k":
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
    wpg, upg, fields = _group(bits, is_int8(side, bits))
    lane_bytes = _lane_byte_offsets(d, bits)
    slots = fragment_slots(side, d, bits)
    out = np.full((TILE, d, bits), -1, np.int64)
    for L in range(32):
        for i in range(slots.shape[1]):
            grp, j = divmod(i, upg)
            for h in range(slots.shape[2]):
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


def lane_words_of_tiles(tiles, side: str, d: int, kbits: int, vbits: int) -> np.ndarray:
    """The words lane L loads from each tile: (ntiles, 32, lane_words) uint32."""
    bits = kbits if side == "k" else vbits
    base = 0 if side == "k" else 2 * d * kbits
    offs = _lane_byte_offsets(d, bits) + base                   # (32, 4 words)
    b = np.asarray(tiles)[:, offs].astype(np.uint32)            # (tiles, 32, 4 words)
    b = b.reshape(b.shape[0], 32, -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
