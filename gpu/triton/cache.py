"""A serving-shaped paged TurboQuantMSE KV cache: allocation, fused quantize-and-append, ring band, attention.

``PagedKVCache`` holds, for ``B`` sequences and ``H`` KV heads (layout of ``gpu.triton.paged``):

* encoded tokens in pages of ``page_size`` slots: ``k_codes/v_codes (num_pages, H, P, row_bytes)``
  uint8 (kvq_ref's bit stream, zero-padded rows), ``k_norms/v_norms (num_pages, H, P)``; sequence
  ``b`` owns ``block_table[b, :]`` (int32 page ids, any order, chosen by the caller's allocator) and
  ``seq_lens[b]`` encoded tokens, at positions ``enc_pos0[b] + t``;
* a 16-bit band ``band_k/band_v (B, H, C, d)`` (float16 or bfloat16) with ``band_lens[b]`` valid slots
  at positions ``band_pos[b, slot]``: sink tokens in fixed slots, recent tokens in a ring.

Everything a step changes (codes, norms, lengths, ring slots) is written by device kernels or device
tensor ops, never read back to the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvq_ref.packing import packed_size
from kvq_ref.turboquant import TurboQuantMSE

from .attention import _check_tensor, check_method, kernel_params, resolve_precision
from .codes import pack_store
from .paged import default_blocks, interpreting, launch_paged, plan_splits, row_bytes_for, rows_pad
from .quantize import _corrected, _rot_operands, _rotated_codes

__all__ = ["PagedKVCache", "append_encoded", "append_band", "paged_decode_attention"]


@triton.jit
def _append_kernel(x_ptr, codes_ptr, norms_ptr, bt_ptr, bt_stride, lens_ptr, T, H, P,
                   perm_ptr, s1_ptr, s2_ptr, c_ptr, thr_ptr, lev_ptr,
                   D: tl.constexpr, DP: tl.constexpr, LOG_B: tl.constexpr, W: tl.constexpr, NB: tl.constexpr,
                   ROW: tl.constexpr, NORM_CORR: tl.constexpr, BN: tl.constexpr):
    """Quantize BN rows of ``x (B, T, H, D)`` of sequence ``program_id(0)`` (TurboQuantMSE, bit-exact
    with kvq_ref as ``gpu.triton.quantize``) and store codes and norms in the page slots
    ``lens[b] + t`` of head ``h`` (row r = t H + h)."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = r < T * H
    t = r // H
    h = (r % H).to(tl.int64)
    slot = tl.load(lens_ptr + b) + t
    page = tl.load(bt_ptr + b * bt_stride + slot // P, mask=rmask, other=0).to(tl.int64)
    dst = (page * H + h) * P + slot % P
    xrow = x_ptr + ((b * T + t) * H + h) * D
    perm = tl.load(perm_ptr + tl.arange(0, DP))
    norm, codes = _rotated_codes(xrow, rmask, perm, s1_ptr, s2_ptr, c_ptr, thr_ptr, D, DP, LOG_B, W, BN)
    prow = codes_ptr + dst * ROW
    pack_store(prow, codes, rmask, W, NB, BN, DP)
    scale = norm
    if NORM_CORR:
        scale = _corrected(norm, prow, rmask, lev_ptr, D, W, NB, 0, 0, BN)
    tl.store(norms_ptr + dst, scale.to(norms_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _band_kernel(k_ptr, v_ptr, pos_ptr, bk_ptr, bv_ptr, bpos_ptr, blens_ptr, T, H, C, sink, window,
                 D: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr, RING: tl.constexpr):
    """Program (b, t): rows ``k[b, t], v[b, t]`` (H, D) to band slot ``s`` of sequence b, every KV head;
    ``band_pos[b, s] = p``; ``band_lens[b] = max(band_lens[b], min(sink + window, p + 1))``. Slot: ``p``
    if ``p < sink``, else ``sink + (p - sink) % window``; without a ring (RING false: ``window == 0``)
    a position past the sink has no slot and is not stored."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    one = tl.arange(0, 1)
    p = tl.load(pos_ptr + b * T + t + one)  # (1,): masks stay tensors under the interpreter too
    if RING:
        slot = tl.where(p < sink, p, sink + (p - sink) % window)
        keep = p >= 0
    else:
        slot = p
        keep = p < sink
    hh = tl.arange(0, H_PAD)
    cc = tl.arange(0, D_PAD)
    m = (hh < H)[:, None, None] & (cc < D)[None, :, None] & keep[None, None, :]
    src = ((b * T + t) * H + hh)[:, None, None] * D + cc[None, :, None]
    dst = ((b * H + hh)[:, None, None] * C + slot[None, None, :]) * D + cc[None, :, None]
    tl.store(bk_ptr + dst, tl.load(k_ptr + src, mask=m, other=0.0).to(bk_ptr.dtype.element_ty), mask=m)
    tl.store(bv_ptr + dst, tl.load(v_ptr + src, mask=m, other=0.0).to(bv_ptr.dtype.element_ty), mask=m)
    tl.store(bpos_ptr + b * C + slot, p.to(tl.int32), mask=keep)
    tl.atomic_max(blens_ptr + b + one * 0, tl.minimum(p + 1, sink + window).to(tl.int32))


@dataclass(frozen=True)
class PagedKVCache:
    """Device tensors of a paged cache (see the module docstring for the layout).

    Create with ``PagedKVCache.allocate``; the tensors are mutable state, the dataclass is not.
    """

    key_method: TurboQuantMSE
    value_method: TurboQuantMSE
    k_codes: torch.Tensor
    k_norms: torch.Tensor
    v_codes: torch.Tensor
    v_norms: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    enc_pos0: torch.Tensor
    band_k: torch.Tensor
    band_v: torch.Tensor
    band_lens: torch.Tensor
    band_pos: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.k_codes.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def d(self) -> int:
        return self.key_method.dim

    @classmethod
    def allocate(cls, key_method, value_method, batch, kv_heads, num_pages, page_size, pages_per_seq,
                 band_capacity=0, band_dtype=torch.float16, device="cpu"):
        """Zeroed cache; ``block_table[b] = b * pages_per_seq + arange(pages_per_seq)`` (replace it
        with an allocator's pages as needed), lengths 0.

        Parameters
        ----------
        key_method, value_method : TurboQuantMSE
            Hadamard rotation, 1..4 bits, same dim.
        page_size : int
            Tokens per page: a power of two >= 16 (a decode tile never crosses a page).
        band_capacity : int
            Band slots per sequence (sink + window).
        band_dtype : torch.float16 or torch.bfloat16
        """
        for name, m in (("key_method", key_method), ("value_method", value_method)):
            if not isinstance(m, TurboQuantMSE) or m.rotation != "hadamard" or not 1 <= m.bits <= 4:
                raise ValueError(f"{name} must be a Hadamard TurboQuantMSE with 1..4 bits")
        if key_method.dim != value_method.dim:
            raise ValueError(f"key and value dims differ: {key_method.dim} != {value_method.dim}")
        for name, v in (("batch", batch), ("kv_heads", kv_heads), ("num_pages", num_pages),
                        ("pages_per_seq", pages_per_seq)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(page_size, int) or page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size!r}")
        if not isinstance(band_capacity, int) or band_capacity < 0:
            raise ValueError(f"band_capacity must be a non-negative int, got {band_capacity!r}")
        if band_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"band_dtype must be torch.float16 or torch.bfloat16, got {band_dtype}")
        d = key_method.dim
        kw = dict(device=device)

        def codes(m):
            return torch.zeros((num_pages, kv_heads, page_size, row_bytes_for(d, m.bits)), dtype=torch.uint8, **kw)

        def norms(m):
            return torch.zeros((num_pages, kv_heads, page_size), dtype=getattr(torch, m.norm_dtype), **kw)

        table = (torch.arange(batch * pages_per_seq, dtype=torch.int32, **kw) % num_pages).reshape(batch, -1)
        zeros = torch.zeros(batch, dtype=torch.int32, **kw)
        cap = max(band_capacity, 1)
        return cls(key_method, value_method, codes(key_method), norms(key_method), codes(value_method),
                   norms(value_method), table, zeros.clone(), zeros.clone(),
                   torch.zeros((batch, kv_heads, cap, d), dtype=band_dtype, **kw),
                   torch.zeros((batch, kv_heads, cap, d), dtype=band_dtype, **kw), zeros.clone(),
                   torch.zeros((batch, cap), dtype=torch.int32, **kw))


def _check_rows(name, x, cache):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be a float16/bfloat16/float32 torch.Tensor")
    if x.ndim != 4 or x.shape[0] != cache.batch or x.shape[2] != cache.kv_heads or x.shape[3] != cache.d:
        raise ValueError(f"{name} must have shape ({cache.batch}, T, {cache.kv_heads}, {cache.d}), "
                         f"got {tuple(x.shape)}")
    if x.device != cache.k_codes.device:
        raise ValueError(f"{name} is on {x.device}, the cache is on {cache.k_codes.device}")


def append_encoded(cache: PagedKVCache, k, v, ktable, vtable, block_rows=None):
    """Quantize ``k, v (B, T, H, d)`` and write them into page slots ``seq_lens[b] .. + T - 1``, then
    ``seq_lens += T`` (device op): codes and norms bit-identical to ``TurboQuantMSE.encode``.

    The caller's block table must already own the pages those slots fall in. No host sync: the
    inputs are not checked for NaN here (a server cannot raise mid-step); ``quantize_mse`` does.
    """
    _check_rows("k", k, cache)
    _check_rows("v", v, cache)
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} != {tuple(v.shape)}")
    check_method("key_method", cache.key_method, ktable, cache.d)
    check_method("value_method", cache.value_method, vtable, cache.d)
    B, T, H, d = k.shape
    if T == 0:
        return cache
    for x, m, table, codes, norms in ((k, cache.key_method, ktable, cache.k_codes, cache.k_norms),
                                      (v, cache.value_method, vtable, cache.v_codes, cache.v_norms)):
        r = _rot_operands(m, str(x.device))
        bn = block_rows or (64 if interpreting() else max(1, 2048 // r.dp))
        _append_kernel[(B, triton.cdiv(T * H, bn))](
            x.contiguous(), codes, norms, cache.block_table, cache.block_table.stride(0), cache.seq_lens, T, H,
            cache.page_size, r.perm, r.s1, r.s2, r.c, table.thresholds, table.levels,
            D=d, DP=r.dp, LOG_B=r.log_b, W=m.bits, NB=packed_size(d, m.bits), ROW=codes.shape[3],
            NORM_CORR=bool(m.norm_correction), BN=bn, enable_fp_fusion=False)
    cache.seq_lens.add_(T)
    return cache


def append_band(cache: PagedKVCache, k, v, positions, sink: int, window: int):
    """Write 16-bit rows ``k, v (B, T, H, d)`` at token ``positions (B, T)`` (int, >= 0) into the band: a
    position ``p < sink`` goes to slot ``p``, a later one to ring slot ``sink + (p - sink) % window``
    (overwriting the token ``window`` positions older; with ``window = 0`` it is not stored).
    ``band_lens`` becomes ``max(band_lens, min(sink + window, max position + 1))``. One fused kernel
    (``_band_kernel``, grid (B, T)), no host sync. The positions of one call must take distinct
    slots (at most ``window`` of them past the sink), as in a decode step or a prefill chunk.
    """
    _check_rows("k", k, cache)
    _check_rows("v", v, cache)
    if sink < 0 or window < 0 or sink + window > cache.band_k.shape[2] or sink + window == 0:
        raise ValueError(f"sink + window must be in 1..{cache.band_k.shape[2]} (band capacity), got {sink}+{window}")
    if not isinstance(positions, torch.Tensor) or positions.shape != k.shape[:2]:
        raise ValueError(f"positions must be a tensor of shape {tuple(k.shape[:2])}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    B, T, H, d = k.shape
    if B * T:
        pos = positions.to(device=k.device, dtype=torch.int64).contiguous()
        _band_kernel[(B, T)](k.contiguous(), v.contiguous(), pos, cache.band_k, cache.band_v, cache.band_pos,
                             cache.band_lens, T, H, cache.band_k.shape[2], sink, window, D=d,
                             D_PAD=triton.next_power_of_2(d), H_PAD=triton.next_power_of_2(H), RING=window > 0)
    return cache


def paged_decode_attention(q, cache: PagedKVCache, ktable, vtable, *, q_pos=None, max_seq_len=None, scale=None,
                           splits=None, precision=None, block_n=None, workspace=None):
    """Attention of queries ``q (B, T, H, G, d)`` over a paged cache, split over the sequence.

    Parameters
    ----------
    q : torch.Tensor, float16/bfloat16/float32, shape (B, T, H, G, d)
        ``T`` query tokens (1 for decode) of ``G`` query heads per KV head.
    cache : PagedKVCache
    ktable, vtable : gpu.tables.DeviceTable
    q_pos : torch.Tensor, int32, shape (B, T), optional
        Query positions: token ``i`` sees cache positions ``<= q_pos[b, i]`` (causal tail for
        speculative verification or chunked prefill). None: every cached token is visible.
    max_seq_len : int, optional
        Upper bound on ``seq_lens`` for the split plan (default: ``pages_per_seq * page_size``, known
        on the host without a sync; pass a tighter one for shorter batches).
    splits : int, optional
        Force the split count (``gpu.triton.paged.plan_splits``).
    precision : str, optional
        ``tl.dot`` operands: "fp16" (default with float16 norms: tensor cores, operands rounded to
        float16, float32 accumulation), "tf32x3" (default with float32 norms) or "ieee" (float32).
    workspace : torch.Tensor, float32, optional
        Preallocated split workspace (a CUDA graph keeps one); allocated when None or too small.

    Returns
    -------
    torch.Tensor, q's dtype, shape (B, T, H, G, d). A query that sees no token gets 0.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError("q must be a float16/bfloat16/float32 torch.Tensor")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    B, H, d = cache.batch, cache.kv_heads, cache.d
    if q.ndim != 5 or q.shape[0] != B or q.shape[2] != H or q.shape[4] != d or q.shape[1] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must have shape ({B}, T, {H}, G, {d}), got {tuple(q.shape)}")
    T, G = q.shape[1], q.shape[3]
    if T * G > 64:
        raise ValueError(f"T * G must be <= 64 query rows per KV head, got {T * G}")
    dev = q.device
    if dev.type == "cpu" and not interpreting():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    if cache.k_codes.device != dev:
        raise ValueError(f"q is on {dev}, the cache on {cache.k_codes.device}")
    kq, vq = cache.key_method, cache.value_method
    check_method("key_method", kq, ktable, d)
    check_method("value_method", vq, vtable, d)
    if q_pos is not None:
        _check_tensor("q_pos", q_pos, (torch.int32,), (B, T), dev)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    precision = resolve_precision(kq, vq, precision)
    m_pad = rows_pad(T * G)
    bn_auto, bb_auto, warps = default_blocks(d, m_pad, max(kq.bits, vq.bits))
    if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    block_n = min(block_n or bn_auto, cache.page_size)  # a tile never crosses a page
    cap = cache.block_table.shape[1] * cache.page_size
    max_seq_len = cap if max_seq_len is None else int(max_seq_len)
    if not 0 <= max_seq_len <= cap:
        raise ValueError(f"max_seq_len must be in 0..{cap}, got {max_seq_len}")
    plan = plan_splits(B, H, max_seq_len, block_n, splits=splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    causal = q_pos is not None
    return launch_paged(q.contiguous(), cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms,
                        cache.block_table, cache.seq_lens, cache.band_k, cache.band_v, cache.band_lens,
                        kernel_params(kq, ktable, dev), kernel_params(vq, vtable, dev), out=out, scale=scale,
                        plan=plan, q_pos=q_pos, enc_pos0=cache.enc_pos0 if causal else None,
                        band_pos=cache.band_pos if causal else None, block_band=bb_auto, num_warps=warps,
                        prec=precision, workspace=workspace)
