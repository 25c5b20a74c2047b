"""The fragment layout and its byte-permute lookups (gpu.cuda.fragment, gpu.cuda.lookup), and the CUDA
sources that write and read it, run through the host emulation.

Numpy (no compiler): the layout is a bijection and converts to and from kvq_ref's bit stream bit for
bit; the PRMT model agrees with an independent, byte-by-byte reading of the PTX definition; every code
in every slot of every word decodes to the shipped table's level (fp16 bits, or the int8 key levels
of the documented rule), and so do 1e5 random words and kvq_ref's own encodings; no selector ever sets
PRMT's sign-replicate bit.

Host emulation (g++, ``KVQ_CUDA_HOST_EMULATION=1``): ``kvq_frag_decode_tiles`` (the kernel's own loads
and lookups) equals the numpy model bit for bit; ``append_fragment`` writes codes and norms that read
back as ``TurboQuantMSE.encode``'s, across tiles, pages in shuffled order, float16 and float32 inputs.
Five configurations are compiled (about 5 s each, cached per source hash).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from gpu.cuda import fragment as F
from gpu.cuda import lookup as LK
from gpu.cuda.binding import HOST_EMULATION_ENV
from gpu.tables import load_device_table
from kvq_ref import TurboQuantMSE
from kvq_ref.packing import pack_codes, unpack_codes

CONFIGS = [(d, kb, vb) for d in F.DIMS for kb in F.BITS for vb in F.BITS]
EMU_CONFIGS = [(128, 2, 2), (128, 3, 3), (128, 4, 4), (64, 2, 4), (256, 3, 2)]
KINDS = [(2, False), (2, True), (3, False), (4, False)]  # (bits, int8 keys)


def _levels(d, bits):
    return load_device_table(d, bits).codebook.levels


def _expected(levels, bits, int8, codes):
    """What a register holds for codes: fp16 bits (uint16) or int8 levels."""
    if int8:
        return LK.int8_levels(levels)[0][codes]
    return np.asarray(levels).astype(np.float16)[codes].view(np.uint16)


def _values(regs, int8):
    """Registers (..., n) uint32 -> (..., n, codes per register): uint16 halves or int8 bytes."""
    if int8:
        return regs.astype(np.uint32).view(np.uint8).view(np.int8).reshape(regs.shape + (4,))
    return np.stack([regs & 0xFFFF, regs >> 16], -1).astype(np.uint16)


# ---- layout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", F.DIMS)
@pytest.mark.parametrize("bits", F.BITS)
def test_tile_offsets_are_a_bijection(d, bits):
    for side in ("k", "v"):
        addr = F.tile_offsets(side, d, bits)  # asserts its own bijectivity
        assert addr.shape == (16, d, bits) and addr.min() == 0 and addr.max() == 16 * d * bits - 1
        slots = F.fragment_slots(side, d, bits)
        pairs = slots.reshape(-1, 2)
        assert len({tuple(p) for p in pairs}) == 16 * d  # every (token, coordinate) exactly once
    assert sum(F.plane_widths(d, bits)) == 4 * F.lane_words(d, bits) == d * bits // 16


@pytest.mark.parametrize("d,kb,vb", CONFIGS)
def test_rows_round_trip_bit_for_bit(d, kb, vb):
    """Any codes (all values, awkward token counts) and float16 norms (zero, subnormal, the largest)."""
    rng = np.random.default_rng(d * 100 + kb * 10 + vb)
    for n in (1, 17, 54):
        kc, vc = rng.integers(0, 1 << kb, (n, d)), rng.integers(0, 1 << vb, (n, d))
        kn = rng.uniform(0, 10, n).astype(np.float16)
        vn = rng.uniform(0, 10, n).astype(np.float16)
        kn[0], vn[-1] = np.float16(65504), np.float16(6e-8)
        if n > 2:
            kn[1] = 0
        rows = (pack_codes(kc, kb), kn, pack_codes(vc, vb), vn)
        tiles = F.pack_tiles(*rows, d, kb, vb)
        assert tiles.shape == (-(-n // 16), F.tile_bytes(d, kb, vb))
        back = F.unpack_tiles(tiles, n, d, kb, vb)
        for got, want in zip(back, rows):
            np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


def test_layout_refuses_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        F.tile_offsets("k", 96, 2)
    with pytest.raises(ValueError, match="2, 3 or 4 bits"):
        F.pack_tiles(np.zeros((1, 16), np.uint8), np.zeros(1, np.float16), np.zeros((1, 16), np.uint8),
                     np.zeros(1, np.float16), 64, 1, 2)
    with pytest.raises(ValueError, match="k_rows"):
        F.pack_tiles(np.zeros((2, 16), np.uint8), np.zeros(1, np.float16), np.zeros((1, 16), np.uint8),
                     np.zeros(1, np.float16), 64, 2, 2)
    with pytest.raises(ValueError, match="n must be"):
        F.unpack_tiles(np.zeros((1, F.tile_bytes(64, 2, 2)), np.uint8), 17, 64, 2, 2)


# ---- the PRMT model ---------------------------------------------------------------------------------
def test_prmt_model_is_the_ptx_definition():
    """Against a byte-by-byte reading of prmt.b32's default mode (including the sign-replicate bit)."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 2**32, 2000, dtype=np.uint64) for _ in range(3))
    got = LK.prmt(a, b, c)
    for i in range(200):
        pool = [(int(a[i]) >> (8 * k)) & 0xFF for k in range(4)] + [(int(b[i]) >> (8 * k)) & 0xFF for k in range(4)]
        want = 0
        for n in range(4):
            sel = (int(c[i]) >> (4 * n)) & 0xF
            byte = pool[sel & 7]
            if sel & 8:
                byte = 0xFF if byte & 0x80 else 0
            want |= byte << (8 * n)
        assert int(got[i]) == want


@pytest.mark.parametrize("bits,int8", KINDS)
@pytest.mark.parametrize("d", F.DIMS)
def test_every_code_in_every_slot(bits, int8, d):
    """Each stored symbol position of a decode group, each code: the decoded value is the table's,
    whatever the other codes of the words are (64 random backgrounds)."""
    levels = _levels(d, bits)
    pool = LK.pools(levels, bits, int8)
    wpg, upg, fields = F._group(bits, int8)
    rng = np.random.default_rng(bits + 10 * int8 + d)
    background = rng.integers(0, 2**32, (64, wpg), dtype=np.uint64)
    symbol = F._to_symbol(np.arange(1 << bits), bits)
    for j, unit in enumerate(fields):
        for h, field in enumerate(unit):
            words = np.repeat(background[None], 1 << bits, axis=0)            # (codes, 64, wpg)
            for k, (word, bit) in enumerate(field):
                bitval = ((symbol >> k) & 1).astype(np.uint64)[:, None]
                words[:, :, word] = (words[:, :, word] & ~np.uint64(1 << bit)) | (bitval << np.uint64(bit))
            got = _values(LK.decode_words(words, bits, pool, int8), int8)[:, :, j, h]
            want = _expected(levels, bits, int8, np.arange(1 << bits))[:, None]
            np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


@pytest.mark.parametrize("bits,int8", KINDS)
def test_random_words_decode_as_the_layout_says(bits, int8):
    """1e5 random words: the lookup list equals reading each symbol's bits where _group puts them."""
    levels = _levels(128, bits)
    wpg, upg, fields = F._group(bits, int8)
    words = np.random.default_rng(bits * 7 + int8).integers(0, 2**32, (100_000 // (8 * upg) + 1, wpg), dtype=np.uint64)
    got = _values(LK.decode_words(words, bits, LK.pools(levels, bits, int8), int8), int8)
    for j, unit in enumerate(fields):
        for h, field in enumerate(unit):
            sym = sum(((words[:, w] >> np.uint64(b)) & np.uint64(1)).astype(np.int64) << k for k, (w, b) in enumerate(field))
            codes = F._from_symbol(sym, bits).astype(np.int64)
            np.testing.assert_array_equal(got[:, j, h], _expected(levels, bits, int8, codes))
    sel = LK.selectors(words, bits, int8)
    assert not (sel & 0x8888).any()  # used nibbles never select PRMT's sign-replicate mode


def test_int8_key_levels_follow_the_rule_and_stay_close():
    for d in F.DIMS:
        lev = _levels(d, 2)
        L, sigma, eps = LK.int8_levels(lev)
        assert L.dtype == np.int8 and L[3] == -L[0] and L[2] == -L[1] and 0 < L[2] < L[3] <= 127
        np.testing.assert_array_less(np.abs(L / sigma - lev), eps * np.abs(lev) + 1e-15)
        assert eps <= 4e-4, (d, eps)  # the size of rounding the levels to float16 (fp16: <= 3.4e-4 here)
        A, B = int(L[3]), int(L[2])   # the rule: no pair A' <= 127 fits the ratio better
        best = min(abs(a / lev[3] - round(a * lev[2] / lev[3]) / lev[2]) / (a / lev[3] + round(a * lev[2] / lev[3]) / lev[2])
                   for a in range(1, 128) if round(a * lev[2] / lev[3]) >= 1)
        assert eps == pytest.approx(best) and B == round(A * lev[2] / lev[3])
    with pytest.raises(ValueError, match="symmetric"):
        LK.int8_levels([-1.0, -0.2, 0.3, 1.0])
    with pytest.raises(ValueError, match="symmetric in float16"):
        LK.pools(np.linspace(-1, 1.5, 16), 4)


@pytest.mark.parametrize("d,kb,vb", [(64, 2, 3), (128, 3, 4), (128, 4, 2), (256, 2, 4)])
def test_kvq_ref_stream_to_fragments_gives_its_levels(d, kb, vb):
    """TurboQuantMSE.encode -> pack_tiles -> each lane's words -> lookup list = level[code] at the
    (token, coordinate) the register belongs to, for keys and values."""
    rng = np.random.default_rng(d + kb + vb)
    n = 37
    enc = [TurboQuantMSE(d, b, seed=s).encode(rng.standard_normal((n, d))) for b, s in ((kb, 1), (vb, 2))]
    tiles = F.pack_tiles(enc[0].arrays["codes"], enc[0].arrays["norms"], enc[1].arrays["codes"], enc[1].arrays["norms"],
                         d, kb, vb)
    for side, bits, e in (("k", kb, enc[0]), ("v", vb, enc[1])):
        int8 = F.is_int8(side, bits)
        levels = _levels(d, bits)
        regs = LK.decode_words(F.lane_words_of_tiles(tiles, side, d, kb, vb), bits, LK.pools(levels, bits, int8), int8)
        codes = np.zeros((tiles.shape[0] * 16, d), np.int64)
        codes[:n] = unpack_codes(e.arrays["codes"], bits, d)
        codes = codes.reshape(tiles.shape[0], 16, d)
        slots = F.fragment_slots(side, d, bits)
        np.testing.assert_array_equal(_values(regs, int8),
                                      _expected(levels, bits, int8, codes[:, slots[..., 0], slots[..., 1]]))


# ---- the CUDA sources on the host emulation -----------------------------------------------------------
@pytest.fixture
def emulation(monkeypatch):
    if not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("the host emulation needs g++ (>= 12)")
    monkeypatch.setenv(HOST_EMULATION_ENV, "1")


@pytest.mark.parametrize("d,kb,vb", EMU_CONFIGS)
def test_cuda_decode_is_the_numpy_model(emulation, d, kb, vb):
    from gpu.cuda.fragment_cache import decode_tiles

    tiles = np.random.default_rng(d + kb).integers(0, 256, (5, F.tile_bytes(d, kb, vb)), dtype=np.uint8)
    hk, hv = decode_tiles(torch.from_numpy(tiles), d, kb, vb)
    for side, bits, got in (("k", kb, hk), ("v", vb, hv)):
        int8 = F.is_int8(side, bits)
        want = LK.decode_words(F.lane_words_of_tiles(tiles, side, d, kb, vb), bits,
                               LK.pools(_levels(d, bits), bits, int8), int8)
        np.testing.assert_array_equal(got.numpy().view(np.uint32)[..., :want.shape[-1]], want)


@pytest.mark.parametrize("d,kb,vb", EMU_CONFIGS)
def test_append_writes_what_kvq_ref_encodes(emulation, d, kb, vb):
    """Four appends (21, 1, 1, 13 tokens) into pages of 32 in shuffled order, float16 and float32 rows,
    norm correction on the values: read back, every code and norm is TurboQuantMSE.encode's."""
    from gpu.cuda.fragment_cache import FragmentKVCache, append_fragment, read_rows

    B, H = 2, 3
    km, vm = TurboQuantMSE(d, kb, seed=3), TurboQuantMSE(d, vb, seed=4, norm_correction=True)
    cache = FragmentKVCache.allocate(km, vm, B, H, num_pages=8, page_size=32, pages_per_seq=4)
    cache.block_table.copy_(torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]], dtype=torch.int32))
    rng = np.random.default_rng(d + kb + vb)
    ks, vs = [], []
    for step, t in enumerate((21, 1, 1, 13)):
        dt = np.float16 if step % 2 == 0 else np.float32
        k, v = (rng.standard_normal((B, t, H, d)).astype(dt) * 3 for _ in range(2))
        append_fragment(cache, torch.from_numpy(k), torch.from_numpy(v))
        ks.append(k.astype(np.float32))
        vs.append(v.astype(np.float32))
    assert cache.seq_lens.tolist() == [36, 36]
    K, V = np.concatenate(ks, 1), np.concatenate(vs, 1)
    for b in range(B):
        for h in range(H):
            kr, kn, vr, vn = read_rows(cache, b, h)
            # each step's rows were encoded from their stored dtype (float16 rows are exact in float32)
            ek, ev = km.encode(K[b, :, h]), vm.encode(V[b, :, h])
            np.testing.assert_array_equal(kr, ek.arrays["codes"])
            np.testing.assert_array_equal(vr, ev.arrays["codes"])
            np.testing.assert_array_equal(kn.view(np.uint16), ek.arrays["norms"].view(np.uint16))
            np.testing.assert_array_equal(vn.view(np.uint16), ev.arrays["norms"].view(np.uint16))
