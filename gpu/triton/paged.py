"""Split-sequence (flash-decoding) attention over a paged TurboQuantMSE cache (Triton).

Layout (``gpu.triton.cache.PagedKVCache``): encoded tokens live in pages of ``P`` token slots; page
``p`` holds, per KV head ``h``, the rows ``codes[p, h, 0:P, 0:row_bytes]`` (uint8, kvq_ref's
little-endian bit stream of ``kvq_ref.packing``, zero-padded to ``row_bytes``: a multiple of 16 in a
PagedKVCache, of 4 at least) and ``norms[p, h, 0:P]``.
A sequence ``b`` owns the pages ``block_table[b, 0:ceil(seq_lens[b] / P)]`` in token order; its
encoded token ``t`` is slot ``t % P`` of page ``block_table[b, t // P]`` (page offsets in int64).
The 16-bit band (sink and recent-window tokens) is kept apart, ``band_k/band_v (B, H, C, d)``
float16 or bfloat16, of which the first ``band_lens[b]`` slots are valid in any order (a ring
buffer: softmax attention does not depend on token order).

Schedule:

1. ``_split_kernel``, grid ``(B, H, S + 1)``: program ``(b, h, s < S)`` attends the ``G`` queries of
   KV head ``h`` (times ``T`` query tokens) to the encoded tokens ``[s C, (s + 1) C)`` of sequence
   ``b`` (``C`` = chunk, a multiple of the tile ``BLOCK_N``) in the key rotation's domain, and writes
   its running max ``m``, sum ``l`` and value sum (value rotation's domain) to a workspace; program
   ``(b, h, S)`` does the same for the band (original domain). Per tile of ``BLOCK_N`` tokens it
   loads each row's packed codes as 32-bit words (16-byte vector loads when ``row_bytes`` is a
   multiple of 16 and the code width is 2 or 4), unpacks them in registers, maps codes to levels by
   a select tree over levels held in registers (kernel arguments), computes the scores and the value
   sums with ``tl.dot`` (queries padded to ``MIN_ROWS`` = 8 rows, or 16 on an older Triton), and folds the value norm into the softmax weight.
2. ``_merge_kernel``, grid ``(B, H)``: combines the ``S`` encoded partials by log-sum-exp, applies the
   inverse value rotation ``R_v^T`` once, merges the band partial the same way, divides, and stores
   in the query's dtype.

Empty splits, tiles past a sequence's end and fully masked (causal) tiles leave ``m = -inf``,
``l = 0``; every exponent is taken against a finite reference (0 when the max is ``-inf``), so they
merge as nothing. A query row that sees no token at all gets output 0 (never NaN).

Math is kvq_ref's (``kvq_ref.attention.attention_decode``): levels from the exported tables, the
rotation's signs and permutation from ``kvq_ref.rotations``, packing from ``kvq_ref.packing``; this
module owns only the schedule. Precision: float32 levels, norms, products, exp and sums; ``tl.dot``
uses ``input_precision`` (``"ieee"``: float32 FMA, or ``"tf32x3"`` on tensor cores, relative error
about 2^-21 per product).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu.schedule import H200_SMS, MAX_SPLITS, MIN_CHUNK, TARGET_WAVES, SplitPlan, interpreting, plan_splits

from .codes import fwht_tile

__all__ = ["H200_SMS", "SplitPlan", "plan_splits", "row_words", "row_bytes_for", "launch_paged",
           "default_blocks", "rows_pad", "MIN_ROWS"]



# ---- device helpers ------------------------------------------------------------------------------
@triton.jit
def _select(c, sh, W: tl.constexpr, l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15):
    """levels of the W-bit codes at bit offsets ``sh`` of ``c`` (other bits ignored) by a select tree
    over register-held levels (no memory gather): one masked bit test per code bit (no shifts) and
    2^W - 1 selects."""
    b0 = (c & (1 << sh)) != 0
    a0 = tl.where(b0, l1, l0)
    if W == 1:
        return a0
    a1 = tl.where(b0, l3, l2)
    b1 = (c & (2 << sh)) != 0
    x0 = tl.where(b1, a1, a0)
    if W == 2:
        return x0
    a2 = tl.where(b0, l5, l4)
    a3 = tl.where(b0, l7, l6)
    x1 = tl.where(b1, a3, a2)
    b2 = (c & (4 << sh)) != 0
    y0 = tl.where(b2, x1, x0)
    if W == 3:
        return y0
    a4 = tl.where(b0, l9, l8)
    a5 = tl.where(b0, l11, l10)
    a6 = tl.where(b0, l13, l12)
    a7 = tl.where(b0, l15, l14)
    x2 = tl.where(b1, a5, a4)
    x3 = tl.where(b1, a7, a6)
    y1 = tl.where(b2, x3, x2)
    return tl.where((c & (8 << sh)) != 0, y1, y0)


@triton.jit
def _level(c, sh, W: tl.constexpr, SYM: tl.constexpr, l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12,
           l13, l14, l15):
    """Levels of codes from ``_codes_tile``: the full select tree, or (SYM) the tree over the
    magnitudes ``l0..`` (the upper half of the table) and the sign from the top bit. (Selecting
    among float16 levels instead, to skip the conversion to the MMA operand type, compiled to more
    instructions on sm_90: 16-bit selects are packed with PRMT.)"""
    if SYM:
        mag = _select(c, sh, W - 1, l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15)
        return tl.where((c & ((1 << (W - 1)) << sh)) != 0, mag, -mag)
    else:
        return _select(c, sh, W, l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15)


@triton.jit
def _load_words(words_ptr, row, tmask, W: tl.constexpr, ROW_WORDS: tl.constexpr, NWORDS: tl.constexpr,
                DP: tl.constexpr):
    """The packed words of the rows ``row`` (BN,) int64 of a word array with ROW_WORDS words a row,
    as three tiles for ``_unpack`` (words at index >= NWORDS, past the row's stream, and masked rows
    read as 0). W in (2, 4): the first ``DP W / 32`` words of each row in one 2-D load (contiguous,
    vectorizable), and two unused zeros. W == 3: word ``3 g + i`` of each 3-word group ``g`` as tile
    ``i`` (BN, DP / 32)."""
    if W == 3:
        NG: tl.constexpr = DP // 32
        g = tl.arange(0, NG)
        base = words_ptr + row[:, None] * ROW_WORDS + 3 * g[None, :]
        m = tmask[:, None] & (3 * g < NWORDS)[None, :]
        w0 = tl.load(base, mask=m, other=0)
        w1 = tl.load(base + 1, mask=m & (3 * g + 1 < NWORDS)[None, :], other=0)
        w2 = tl.load(base + 2, mask=m & (3 * g + 2 < NWORDS)[None, :], other=0)
        return w0, w1, w2
    else:
        NW: tl.constexpr = DP * W // 32
        k = tl.arange(0, NW)
        words = tl.load(words_ptr + row[:, None] * ROW_WORDS + k[None, :],
                        mask=tmask[:, None] & (k < NWORDS)[None, :], other=0)
        return words, 0, 0


@triton.jit
def _unpack(w0, w1, w2, W: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, SYM: tl.constexpr):
    """Codes of ``_load_words``'s tiles as ``(x, sh)``: code ``j`` of a row is bits ``sh[j] .. sh[j] + W
    - 1`` of ``x[:, j]`` (uint32, (BN, DP) and (1, DP); ``_select`` tests those bits in place).

    W in (2, 4): each word broadcast to its ``32 / W`` codes at bit offsets ``sh`` (no shifts).
    W == 3: groups of 3 words hold 32 codes (96 bits); code ``c`` of a group sits in the 64-bit pair
    (w0, w1) for ``c < 11`` and (w1, w2) after.

    SYM (W in 2, 4; symmetric tables ``level[c] = -level[2^W - 1 - c]``): each code ``c`` comes back
    as ``c`` if its top bit is set, else with its low ``W - 1`` bits flipped, i.e. the top bit is the
    sign and the low bits index the magnitudes ``level[2^(W-1) + i]`` (``_level``).
    """
    if W == 3:
        w0 = w0.to(tl.uint32, bitcast=True).to(tl.uint64)
        w1 = w1.to(tl.uint32, bitcast=True).to(tl.uint64)
        w2 = w2.to(tl.uint32, bitcast=True).to(tl.uint64)
        lo = w0 | (w1 << 32)
        hi = w1 | (w2 << 32)
        c = tl.arange(0, 32)
        first = (c < 11)[None, None, :]
        sh = tl.where(c < 11, 3 * c, 3 * c - 32).to(tl.uint64)[None, None, :]
        x = tl.where(first, lo[:, :, None], hi[:, :, None]) >> sh
        return tl.reshape(x.to(tl.uint32), (BN, DP)), tl.zeros((1, DP), tl.uint32)
    else:
        NW: tl.constexpr = DP * W // 32
        PER: tl.constexpr = 32 // W
        words = w0.to(tl.uint32, bitcast=True)
        sh = (tl.arange(0, PER) * W).to(tl.uint32)
        if SYM:  # per code: keep c when its top bit is set, else flip the low W-1 bits (5 ops a word)
            REP: tl.constexpr = 0x55555555 if W == 2 else 0x11111111
            words = words ^ ((((~words) >> (W - 1)) & REP) * ((1 << (W - 1)) - 1))
        x = tl.broadcast_to(words[:, :, None], (BN, NW, PER))
        return tl.reshape(x, (BN, DP)), tl.reshape(tl.broadcast_to(sh[None, :], (NW, PER)), (1, DP))


@triton.jit
def _tile_rows(bt_ptr, b, bt_stride, t0, end, H, h, P, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """Slot rows (BLOCK_N,) int64 and validity (BLOCK_N,) of the encoded tokens ``t0 + [0, BLOCK_N)``
    of sequence ``b``, KV head ``h`` (a tile never crosses a page: P is a multiple of BLOCK_N, or the
    sequence has one page). A tile at or past ``end`` is all invalid (its page entry is not read)."""
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(bt_ptr + b * bt_stride + t0 // P, mask=t0 < end, other=0).to(tl.int64)
    row0 = (page * H + h) * P + t0 % P
    if ALIGNED:
        row0 = tl.multiple_of(row0, BLOCK_N)
    return row0 + tl.arange(0, BLOCK_N), tmask


@triton.jit
def _load_tile(kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, b, bt_stride, t0, end, H, h, P,
               KBITS: tl.constexpr, VBITS: tl.constexpr, KROW_WORDS: tl.constexpr, VROW_WORDS: tl.constexpr,
               K_NWORDS: tl.constexpr, V_NWORDS: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               ALIGNED: tl.constexpr):
    """Validity, norms and packed words (``_load_words``) of the tile of tokens ``t0 + [0, BLOCK_N)``."""
    row, tmask = _tile_rows(bt_ptr, b, bt_stride, t0, end, H, h, P, BLOCK_N, ALIGNED)
    kn = tl.load(kn_ptr + row, mask=tmask, other=0.0)
    vn = tl.load(vn_ptr + row, mask=tmask, other=0.0)
    kw0, kw1, kw2 = _load_words(kc_ptr, row, tmask, KBITS, KROW_WORDS, K_NWORDS, D_PAD)
    vw0, vw1, vw2 = _load_words(vc_ptr, row, tmask, VBITS, VROW_WORDS, V_NWORDS, D_PAD)
    return tmask, kn, vn, kw0, kw1, kw2, vw0, vw1, vw2


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with float32 accumulation: float16 operands for PREC "fp16", else float32 ones at PREC."""
    if PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _online(m_i, l_i, acc, s, v, vs, PREC: tl.constexpr):
    """One online-softmax step, transposed (the dequantized tiles are the MMA's A operand): scores
    ``s`` (BN, M) (-inf where masked), values ``v`` (BN, D) with per-token scales ``vs`` (BN,) folded
    into the weights: ``acc (D, M) += v^T @ (p * vs)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite reference: masked rows stay at 0
    alpha = tl.exp(m_i - ref)
    p = tl.exp(s - ref[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[None, :] + _dot(tl.trans(v), p * vs[:, None], PREC)
    return m_new, l_i, acc


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _split_kernel(q_ptr, q_sb, q_st, q_sh, qpos_ptr,
                  kc_ptr, kn_ptr, vc_ptr, vn_ptr, bt_ptr, bt_stride, lens_ptr, encpos_ptr, H, P,
                  bk_ptr, bv_ptr, blens_ptr, bpos_ptr, BC,
                  kperm_ptr, ksign_ptr, ws_ptr, S, CHUNK, scale, k_inv_sqrt_b,
                  k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11, k12, k13, k14, k15,
                  v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
                  T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  KBITS: tl.constexpr, VBITS: tl.constexpr, KROW_WORDS: tl.constexpr, VROW_WORDS: tl.constexpr,
                  K_NWORDS: tl.constexpr, V_NWORDS: tl.constexpr, K_LOG_B: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                  ALIGNED: tl.constexpr, KSYM: tl.constexpr, VSYM: tl.constexpr, PREFETCH: tl.constexpr):
    """Partial attention of one (sequence, KV head, split); split S is the band. Workspace (fp32):
    ``ws[b, h, s] = (m (M_PAD,), l (M_PAD,), acc (M_PAD, D_PAD))``."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    rmask = rows < T * G
    qmask = rmask[:, None] & cmask[None, :]
    q_base = q_ptr + b * q_sb + (rows // G)[:, None] * q_st + h * q_sh + (rows % G)[:, None] * D
    if CAUSAL:
        qpos = tl.load(qpos_ptr + b * T + rows // G, mask=rmask, other=0)
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    acc = tl.zeros((D_PAD, M_PAD), tl.float32)  # transposed: (d, query rows)
    if s < S:
        # rotate the queries once: pre[j] = q[perm[j]] signs1[perm[j]], butterflies, 1/sqrt(b) scale signs2
        kperm = tl.load(kperm_ptr + cols, mask=cmask, other=0)
        pre = tl.load(q_base + kperm[None, :], mask=qmask, other=0.0).to(tl.float32) \
            * tl.load(ksign_ptr + kperm, mask=cmask, other=0.0)[None, :]
        ks2 = tl.load(ksign_ptr + D + cols, mask=cmask, other=0.0)
        q_rot = fwht_tile(pre, M_PAD, D_PAD, K_LOG_B) * (ks2 * (k_inv_sqrt_b * scale))[None, :]
        n = tl.load(lens_ptr + b)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, n)
        if CAUSAL:
            pos0 = tl.load(encpos_ptr + b)
        # tile loads are carried across iterations: with PREFETCH the next tile's page entry, norms
        # and code words are issued before the current tile is dequantized (their memory latency
        # overlaps the arithmetic, at the cost of the registers holding them); without, after it
        tmask, kn, vn, kw0, kw1, kw2, vw0, vw1, vw2 = _load_tile(
            kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, b, bt_stride, start, end, H, h, P, KBITS, VBITS, KROW_WORDS,
            VROW_WORDS, K_NWORDS, V_NWORDS, D_PAD, BLOCK_N, ALIGNED)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            cur_mask = tmask
            cur_kn = kn.to(tl.float32)
            cur_vn = vn.to(tl.float32)
            kc, ksh = _unpack(kw0, kw1, kw2, KBITS, BLOCK_N, D_PAD, KSYM)
            vc, vsh = _unpack(vw0, vw1, vw2, VBITS, BLOCK_N, D_PAD, VSYM)
            if PREFETCH:
                tmask, kn, vn, kw0, kw1, kw2, vw0, vw1, vw2 = _load_tile(
                    kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, b, bt_stride, t0 + BLOCK_N, end, H, h, P, KBITS, VBITS,
                    KROW_WORDS, VROW_WORDS, K_NWORDS, V_NWORDS, D_PAD, BLOCK_N, ALIGNED)
            klev = _level(kc, ksh, KBITS, KSYM, k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11, k12, k13, k14,
                          k15)
            sc = _dot(klev, tl.trans(q_rot), PREC) * cur_kn[:, None]
            valid = cur_mask[:, None]
            if CAUSAL:
                valid = valid & ((pos0 + t)[:, None] <= qpos[None, :])
            sc = tl.where(valid, sc, float("-inf"))
            vlev = _level(vc, vsh, VBITS, VSYM, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14,
                          v15)
            m_i, l_i, acc = _online(m_i, l_i, acc, sc, vlev, cur_vn, PREC)
            if not PREFETCH:
                tmask, kn, vn, kw0, kw1, kw2, vw0, vw1, vw2 = _load_tile(
                    kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, b, bt_stride, t0 + BLOCK_N, end, H, h, P, KBITS, VBITS,
                    KROW_WORDS, VROW_WORDS, K_NWORDS, V_NWORDS, D_PAD, BLOCK_N, ALIGNED)
    else:
        q = tl.load(q_base + cols[None, :], mask=qmask, other=0.0).to(tl.float32) * scale
        nb = tl.load(blens_ptr + b)
        for t0 in range(0, nb, BLOCK_B):
            t = t0 + tl.arange(0, BLOCK_B)
            tmask = t < nb
            off = ((b * H + h) * BC + t)[:, None] * D + cols[None, :]
            lm = tmask[:, None] & cmask[None, :]
            kb = tl.load(bk_ptr + off, mask=lm, other=0.0).to(tl.float32)
            sc = _dot(kb, tl.trans(q), PREC)
            valid = tmask[:, None]
            if CAUSAL:
                bpos = tl.load(bpos_ptr + b * BC + t, mask=tmask, other=0)
                valid = valid & (bpos[:, None] <= qpos[None, :])
            sc = tl.where(valid, sc, float("-inf"))
            vb = tl.load(bv_ptr + off, mask=lm, other=0.0).to(tl.float32)
            m_i, l_i, acc = _online(m_i, l_i, acc, sc, vb, tl.full((BLOCK_B,), 1.0, tl.float32), PREC)
    w = ws_ptr + ((b * H + h) * (S + 1) + s) * (M_PAD * (D_PAD + 2))
    tl.store(w + rows, m_i)
    tl.store(w + M_PAD + rows, l_i)
    tl.store(w + 2 * M_PAD + rows[None, :] * D_PAD + cols[:, None], acc)


@triton.jit
def _merge_kernel(ws_ptr, out_ptr, o_sb, o_st, o_sh, vperm_ptr, vsign_ptr, H, S, v_inv_sqrt_b,
                  T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
                  D_PAD: tl.constexpr, V_LOG_B: tl.constexpr):
    """Log-sum-exp merge of the S encoded partials, one inverse value rotation, the band partial,
    the division; output in out's dtype at ``out[b, t, h, g, :]``."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    SZ: tl.constexpr = M_PAD * (D_PAD + 2)
    base = ws_ptr + (b * H + h) * (S + 1) * SZ
    m_e = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_e = tl.zeros((M_PAD,), tl.float32)
    acc = tl.zeros((M_PAD, D_PAD), tl.float32)
    for s in range(0, S):
        w = base + s * SZ
        m_s = tl.load(w + rows)
        m_new = tl.maximum(m_e, m_s)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_e - ref)
        c = tl.exp(m_s - ref)
        l_e = l_e * a + tl.load(w + M_PAD + rows) * c
        acc = acc * a[:, None] + tl.load(w + 2 * M_PAD + rows[:, None] * D_PAD + cols[None, :]) * c[:, None]
        m_e = m_new
    # one inverse value rotation: x[perm[j]] = signs1[perm[j]] (H (signs2 y))[j] / sqrt(b)
    vperm = tl.load(vperm_ptr + cols, mask=cmask, other=0)
    vs2 = tl.load(vsign_ptr + D + cols, mask=cmask, other=0.0)
    vs1 = tl.load(vsign_ptr + vperm, mask=cmask, other=0.0)
    z = fwht_tile(acc * vs2[None, :], M_PAD, D_PAD, V_LOG_B) * (vs1 * v_inv_sqrt_b)[None, :]
    wb = base + S * SZ  # the band partial, original domain: read at vperm order to line up with z
    m_b = tl.load(wb + rows)
    m = tl.maximum(m_e, m_b)
    ref = tl.where(m == float("-inf"), 0.0, m)
    a = tl.exp(m_e - ref)
    c = tl.exp(m_b - ref)
    band = tl.load(wb + 2 * M_PAD + rows[:, None] * D_PAD + vperm[None, :], mask=cmask[None, :], other=0.0)
    num = z * a[:, None] + band * c[:, None]
    den = l_e * a + tl.load(wb + M_PAD + rows) * c
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    rmask = rows < T * G
    optr = out_ptr + b * o_sb + (rows // G)[:, None] * o_st + h * o_sh + (rows % G)[:, None] * D + vperm[None, :]
    tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# ---- planning ------------------------------------------------------------------------------------
def _min_rows() -> int:
    """Fewest query rows a tile is padded to: 8 where Triton's NVIDIA backend takes a 16-bit ``tl.dot``
    with N = 8 (``min_dot_size`` (1, 1, 16) since Triton 3.x: it pads to the instruction itself; Triton
    3.9 compiles the split kernel's N = 8 dots to HGMMA.64x8x16 on sm_90), else 16. The GQA group of 4
    then wastes half the MMA and softmax work instead of three quarters."""
    try:
        from triton.backends.nvidia.compiler import min_dot_size

        class _T:
            class scalar:
                primitive_bitwidth = 16
        _, n, _ = min_dot_size(None)(_T, _T)
        return 8 if n <= 8 else 16
    except Exception:  # an older backend without the hook: the old padding
        return 16


MIN_ROWS = _min_rows()


def rows_pad(rows: int) -> int:
    """Query rows of a tile: the next power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, triton.next_power_of_2(rows))


def row_words(d: int, bits: int) -> int:
    """32-bit words the kernel reads per row: ``ceil(d bits / 32)``, whole 3-word groups at 3 bits."""
    if bits == 3:
        return 3 * -(-d // 32)
    return -(-d * bits // 32)


def row_bytes_for(d: int, bits: int) -> int:
    """Row stride of the paged layout: the words the kernel reads, rounded up to 16 bytes."""
    return -(-4 * row_words(d, bits) // 16) * 16


def default_blocks(d: int, m_pad: int, bits: int = 4) -> tuple[int, int, int]:
    """(block_n, block_band, num_warps) for a GPU: 4 warps and a tile of block_n x d_pad dequantized
    codes: 16384 codes at <= 2 bits, 4096 at 3 bits (its 64-bit unpacking needs more registers), 8192
    at 4 bits; halved for more than 16 query rows and for head_dim > 128; at most 128 tokens.
    ``bits`` is the wider of K and V.

    Measured on an H200 with Triton 3.6 (``gpu/sweep.py``; results/gpu/sweep_nvidia_h200*.json;
    head_dim 128, GQA 4, 32K tokens, batch 1 and 16): the earlier 8-warp programs were latency-bound
    (one program per SM at 180 registers a thread: 12.5 % occupancy, 36 % of issue slots busy under
    ncu, results/gpu/ncu_split_kernel_h200.txt); 4 warps took 0.67-0.73x their time at 4 bits (64-token
    tiles) and, with prefetching (``launch_paged``), 0.61-0.79x at 2 bits (128-token tiles; 64-token
    tiles took 1.6x longer, 32-token ones 1.9x). At 3 bits 4-warp 32-token tiles took 0.87-0.90x the
    time of the 8-warp 64-token ones (4-warp 64-token tiles spill and took 1.1x). Spills: none under Triton 3.6 except 24 B at 4 bits, head_dim
    128; Triton 3.9 (the CI toolchain of ``tests/gpu/test_static_report.py``) spills up to 228 B in
    the 2-bit, head_dim-128 prefetching tile and nowhere else.

    Interpreter: one large tile (few Python-level steps)."""
    if interpreting():
        return 256, 128, 4
    dp = triton.next_power_of_2(d)
    codes = 16384 if bits <= 2 else 4096 if bits == 3 else 8192
    codes = codes // (1 if m_pad <= 16 else 2) // (2 if dp >= 256 else 1)
    bn = max(16, min(128, codes // dp))
    return bn, min(bn, 64), 4


def launch_paged(q, kc, kn, vc, vn, block_table, seq_lens, band_k, band_v, band_lens, kparams, vparams,
                 *, out, scale, plan, q_pos=None, enc_pos0=None, band_pos=None, block_band, num_warps, prec,
                 workspace=None, prefetch=None, num_stages=None):
    """Launch split + merge (checked inputs; see ``gpu.triton.attention.paged_decode_attention``).

    ``prefetch`` (tuning): load tile i + 1's page entry, norms and words before dequantizing tile i,
    or (False) after it, right before their use. Default (None): prefetch when K and V have at most
    2 bits. On an H200 (results/gpu/sweep_nvidia_h200.json, 4 warps) prefetching took 0.77x (batch
    16) and 0.88x (batch 1) the time at 2 bits, 0.97-1.0x at 3 bits and 1.2-1.33x at 4 bits, whose
    prefetched words hold twice the registers. ``num_stages``: Triton's pipelining depth for the
    split kernel's loop (None: Triton's default). Neither changes a result."""
    B, T, H, G, D = q.shape
    m_pad = rows_pad(T * G)
    d_pad = max(32 if 3 in (kparams.bits, vparams.bits) else 16, triton.next_power_of_2(D))
    S = plan.splits
    size = B * H * (S + 1) * m_pad * (d_pad + 2)
    if workspace is None or workspace.numel() < size:
        workspace = torch.empty(size, dtype=torch.float32, device=q.device)
    causal = q_pos is not None
    dummy = seq_lens  # never read when CAUSAL is off
    _split_kernel[(B, H, S + 1)](
        q, q.stride(0), q.stride(1), q.stride(2), q_pos if causal else dummy,
        kc.view(torch.int32), kn, vc.view(torch.int32), vn, block_table, block_table.stride(0), seq_lens,
        enc_pos0 if causal else dummy, H,
        kc.shape[2], band_k, band_v, band_lens, band_pos if causal else dummy, band_k.shape[2],
        kparams.perm, kparams.signs, workspace, S, plan.chunk, scale, kparams.inv_sqrt_b,
        *kparams.levels, *vparams.levels,
        T=T, G=G, D=D, M_PAD=m_pad, D_PAD=d_pad, KBITS=kparams.bits, VBITS=vparams.bits,
        KROW_WORDS=kc.shape[3] // 4, VROW_WORDS=vc.shape[3] // 4, K_NWORDS=row_words(D, kparams.bits),
        V_NWORDS=row_words(D, vparams.bits), K_LOG_B=kparams.log_b, BLOCK_N=plan.block_n, BLOCK_B=block_band,
        CAUSAL=causal, PREC=prec, ALIGNED=kc.shape[2] % plan.block_n == 0, KSYM=kparams.sym, VSYM=vparams.sym,
        PREFETCH=max(kparams.bits, vparams.bits) <= 2 if prefetch is None else bool(prefetch),
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
    _merge_kernel[(B, H)](workspace, out, out.stride(0), out.stride(1), out.stride(2), vparams.perm,
                          vparams.signs, H, S, vparams.inv_sqrt_b, T=T, G=G, D=D, M_PAD=m_pad, D_PAD=d_pad,
                          V_LOG_B=vparams.log_b, num_warps=4)
    return out
