"""Triton quantize-and-pack and dequantize kernels for TurboQuantMSE and the turbo2/3/4 blocks.

Bit-exactness contract
----------------------
The quantize kernels compute in float64 from the stored input dtype and repeat the rule of
``kvq_ref.turboquant.quantize_rotated`` (shared by TurboQuantMSE and TurboBlock, and here by both
kernels through ``_rotated_codes`` and ``_corrected``) in its order, each step an IEEE correctly
rounded float64 op (the PTX holds ``sqrt.rn.f64``, ``div.rn.f64``, ``cvt.rn.f16.f64``; fp fusion
is disabled, so no FMA):

* ``||x||``: the sequential float64 sum of squares of ``common.row_norm`` (a loop over the
  columns), then ``sqrt``.
* ``x * (1/||x||)`` (the reciprocal rounded once, then a product; zero for a zero vector); ``D1``
  and the permutation (the tile is loaded as ``x[perm] * signs1[perm]``; the turbo blocks have
  none), the butterflies ``(a, b) -> (a + b, a - b)`` stage by stage within blocks of ``b``,
  ``* (1/sqrt(b))``, ``D2``.
* ``idx = #{thresholds < y}`` against the table's float64 thresholds (ties go low).
* Norm correction ``||x|| / ||levels[idx]||``, the squared levels summed sequentially like
  ``row_norm`` (the codes are read back from the packed bytes just written, after a CTA barrier).
* The scale is rounded once from float64 to the norm dtype (float16 by default).

For float16/bfloat16 inputs every step is exact or correctly rounded in kvq_ref's order, so codes,
packed bytes, block bytes and norms are bit-identical to kvq_ref. Float32 inputs square exactly in
float64 too and the summation order is kvq_ref's, so they match as well; the spec only promises
codes away from thresholds (relative 1e-12) for them, and the tests check that and count the
near-ties (zero).

Dequantize kernels work in float32: float32 levels (``DeviceTable.levels32``), the stored scale
times a float32 ``1/sqrt(b)``, ``log2(b)`` float32 butterfly stages, then ``D1`` and the inverse
permutation as a scatter store. Their error bound is stated in ``tests/gpu/test_triton_quantize.py``.

Packing follows ``kvq_ref.packing``: every 8 codes of ``w`` bits form one ``8w``-bit word whose
``w`` little-endian bytes are stored, which is the documented bit stream for every ``w`` in 1..8.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from gpu.tables import DeviceTable, check_device_table
from gpu.triton.codes import code_at, fwht_tile, pack_store
from kvq_ref.packing import packed_size
from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turboquant import TurboQuantMSE

__all__ = ["quantize_mse", "dequantize_mse", "quantize_turbo_block", "dequantize_turbo_block",
           "hopper_compile"]

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- device helpers ------------------------------------------------------------------------------
@triton.jit
def _turbo_code_at(ptrs, j, TB: tl.constexpr, QOFF: tl.constexpr, BLOCK: tl.constexpr, mask):
    """Index ``j`` of a turbo block (turbo4: 4-bit qs; turbo2/3: 2-bit qs | sign bit << 2)."""
    if TB == 4:
        code = code_at(ptrs + QOFF, j, 4, BLOCK // 2, mask)
    else:
        code = code_at(ptrs + QOFF, j, 2, BLOCK // 4, mask)
        if TB == 3:
            code = code | (code_at(ptrs + QOFF + BLOCK // 4, j, 1, BLOCK // 8, mask) << 2)
    return code


@triton.jit
def _rotated_codes(xrow, rmask, src, s1_ptr, s2_ptr, c_ptr, thr_ptr, D: tl.constexpr, DP: tl.constexpr,
                   LOG_B: tl.constexpr, W: tl.constexpr, BN: tl.constexpr):
    """``quantize_rotated`` up to the codes for BN rows: (||x|| (BN,), codes (BN, DP) int32).

    ``||x||`` is ``common.row_norm`` (a sequential float64 sum of squares over the columns), the
    unit vector ``x * (1/||x||)`` (zero for a zero row), loaded as ``x[src]`` (``src`` = the
    permutation, or ``arange`` without one), then D1, the butterflies, ``1/sqrt(b)``, D2 and
    ``#{thresholds < y}``. Codes of padding columns and masked rows are 0.
    """
    s = tl.zeros((BN,), tl.float64)
    for j in range(D):
        v = tl.load(xrow + j, mask=rmask, other=0.0).to(tl.float64)
        s += v * v
    norm = tl.sqrt(s)
    inv = tl.where(norm > 0, 1.0 / tl.where(norm > 0, norm, 1.0), 0.0)
    cols = tl.arange(0, DP)
    m2 = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(xrow[:, None] + src[None, :], mask=m2, other=0.0).to(tl.float64)
    y = (x * inv[:, None]) * tl.load(s1_ptr + cols)[None, :]
    y = fwht_tile(y, BN, DP, LOG_B)
    y = (y * tl.load(c_ptr)) * tl.load(s2_ptr + cols)[None, :]
    codes = tl.zeros(y.shape, tl.int32)
    for t in range((1 << W) - 1):
        codes += (y > tl.load(thr_ptr + t)).to(tl.int32)
    return norm, tl.where(m2, codes, 0)


@triton.jit
def _corrected(norm, ptrs, rmask, lev_ptr, D: tl.constexpr, W: tl.constexpr, NB: tl.constexpr,
               TB: tl.constexpr, QOFF: tl.constexpr, BN: tl.constexpr):
    """``||x|| / ||levels[idx]||`` per row, the squared levels summed sequentially like ``row_norm``.

    The indices are read back from the bytes this CTA just stored at ``ptrs``: a ``W``-bit stream
    of ``NB`` bytes (``TB == 0``, TurboQuantMSE) or a turbo block (``TB`` = 2, 3, 4).
    """
    tl.debug_barrier()  # the packed bytes of this CTA are visible to all its threads
    q = tl.zeros((BN,), tl.float64)
    for j in range(D):
        if TB == 0:
            code = code_at(ptrs, j, W, NB, rmask)
        else:
            code = _turbo_code_at(ptrs, j, TB, QOFF, D, rmask)
        lv = tl.load(lev_ptr + code)
        q += lv * lv
    return norm / tl.sqrt(q)


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _mse_quantize_kernel(x_ptr, packed_ptr, norms_ptr, perm_ptr, s1_ptr, s2_ptr, c_ptr, thr_ptr, lev_ptr,
                         N, stride_x, D: tl.constexpr, DP: tl.constexpr, LOG_B: tl.constexpr,
                         W: tl.constexpr, NB: tl.constexpr, NORM_CORR: tl.constexpr, BN: tl.constexpr):
    """TurboQuantMSE (hadamard) encode of BN rows: packed codes (N, NB) and scales (N,)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    xrow = x_ptr + rows.to(tl.int64) * stride_x
    perm = tl.load(perm_ptr + tl.arange(0, DP))
    norm, codes = _rotated_codes(xrow, rmask, perm, s1_ptr, s2_ptr, c_ptr, thr_ptr, D, DP, LOG_B, W, BN)
    prow = packed_ptr + rows.to(tl.int64) * NB
    pack_store(prow, codes, rmask, W, NB, BN, DP)
    scale = norm
    if NORM_CORR:
        scale = _corrected(norm, prow, rmask, lev_ptr, D, W, NB, 0, 0, BN)
    tl.store(norms_ptr + rows, scale.to(norms_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _turbo_quantize_kernel(x_ptr, blocks_ptr, s1_ptr, s2_ptr, c_ptr, thr_ptr, lev_ptr, N, stride_x,
                           BLOCK: tl.constexpr, LOG_B: tl.constexpr, TB: tl.constexpr, QOFF: tl.constexpr,
                           BPB: tl.constexpr, BN: tl.constexpr):
    """TurboBlock encode of BN rows into raw blocks (N, BPB) in the fork's byte layout."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    xrow = x_ptr + rows.to(tl.int64) * stride_x
    norm, codes = _rotated_codes(xrow, rmask, tl.arange(0, BLOCK), s1_ptr, s2_ptr, c_ptr, thr_ptr, BLOCK, BLOCK,
                                 LOG_B, TB, BN)  # no permutation
    brow = blocks_ptr + rows.to(tl.int64) * BPB
    if TB == 4:
        pack_store(brow + QOFF, codes, rmask, 4, BLOCK // 2, BN, BLOCK)
        if QOFF == 4:  # the unused fp16 field of the 128-value turbo4 block
            tl.store(brow[:, None] + 2 + tl.arange(0, 2)[None, :], tl.zeros((BN, 2), tl.uint8), mask=rmask[:, None])
    else:
        pack_store(brow + QOFF, codes & 3, rmask, 2, BLOCK // 4, BN, BLOCK)
        if TB == 3:
            pack_store(brow + QOFF + BLOCK // 4, codes >> 2, rmask, 1, BLOCK // 8, BN, BLOCK)
    gamma = _corrected(norm, brow, rmask, lev_ptr, BLOCK, TB, BPB, TB, QOFF, BN)
    bits = gamma.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(brow, (bits & 0xFF).to(tl.uint8), mask=rmask)
    tl.store(brow + 1, (bits >> 8).to(tl.uint8), mask=rmask)


@triton.jit
def _mse_dequantize_kernel(packed_ptr, norms_ptr, out_ptr, perm_ptr, s1_ptr, s2_ptr, lev_ptr, N, inv_sqrt_b,
                           D: tl.constexpr, DP: tl.constexpr, LOG_B: tl.constexpr, W: tl.constexpr,
                           NB: tl.constexpr, BN: tl.constexpr):
    """TurboQuantMSE decode in float32: out (N, D) = R^T (levels[codes] * scale)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    cols = tl.arange(0, DP)
    m2 = rmask[:, None] & (cols < D)[None, :]
    prow = packed_ptr + rows.to(tl.int64) * NB
    code = code_at(prow[:, None], cols[None, :], W, NB, m2)
    lev = tl.load(lev_ptr + code, mask=m2, other=0.0)
    sc = tl.load(norms_ptr + rows, mask=rmask, other=0.0).to(tl.float32) * inv_sqrt_b
    v = (lev * sc[:, None]) * tl.load(s2_ptr + cols)[None, :]
    v = fwht_tile(v, BN, DP, LOG_B) * tl.load(s1_ptr + cols)[None, :]
    perm = tl.load(perm_ptr + cols)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + perm[None, :], v, mask=m2)


@triton.jit
def _turbo_dequantize_kernel(blocks_ptr, out_ptr, s1_ptr, s2_ptr, lev_ptr, N, inv_sqrt_b,
                             BLOCK: tl.constexpr, LOG_B: tl.constexpr, TB: tl.constexpr, QOFF: tl.constexpr,
                             BPB: tl.constexpr, BN: tl.constexpr):
    """TurboBlock decode in float32: out (N, BLOCK) = gamma R^T levels[idx]."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    cols = tl.arange(0, BLOCK)
    m2 = rmask[:, None] & (cols < BLOCK)[None, :]
    brow = blocks_ptr + rows.to(tl.int64) * BPB
    lo = tl.load(brow, mask=rmask, other=0).to(tl.int32)
    hi = tl.load(brow + 1, mask=rmask, other=0).to(tl.int32)
    gamma = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    code = _turbo_code_at(brow[:, None], cols[None, :], TB, QOFF, BLOCK, m2)
    lev = tl.load(lev_ptr + code, mask=m2, other=0.0)
    v = (lev * (gamma * inv_sqrt_b)[:, None]) * tl.load(s2_ptr + cols)[None, :]
    v = fwht_tile(v, BN, BLOCK, LOG_B) * tl.load(s1_ptr + cols)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * BLOCK + cols[None, :], v, mask=m2)


# ---- host side: rotation operands, validation, launch --------------------------------------------
def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


# a rotation's operands padded to DP columns: perm (int32), s1 = signs1[perm] and s2 = signs2 (float64,
# and float32 for the dequantize kernels), c = [1/sqrt(b)] (float64)
_Rot = namedtuple("_Rot", "dp log_b inv_sqrt_b perm s1 s2 s1_32 s2_32 c")


@lru_cache(maxsize=64)
def _rot_operands(q, device: str) -> _Rot:
    rot, d = q.rot, q.dim
    dp = max(8, 1 << (d - 1).bit_length())
    perm, s1, s2 = np.zeros(dp, dtype=np.int32), np.zeros(dp), np.zeros(dp)
    perm[:d], s1[:d], s2[:d] = rot.perm, rot.signs1[rot.perm], rot.signs2
    inv = 1.0 / math.sqrt(rot.block)  # the constant fwht multiplies by

    def t(a, dtype):
        return torch.tensor(a, dtype=dtype, device=device)

    return _Rot(dp, rot.block.bit_length() - 1, inv, t(perm, torch.int32), t(s1, torch.float64),
                t(s2, torch.float64), t(s1, torch.float32), t(s2, torch.float32), t([inv], torch.float64))


def _plan(kernel: str, q, table, bn: int, *tensors):
    """``(fn, args, constexprs, options)`` of one launch over ``tensors`` (the first holds the rows).

    Used by the wrappers and by the Hopper compile check, so both see the same specialization.
    Quantize kernels run with fp fusion off (no FMA: the contract above).
    """
    r = _rot_operands(q, str(tensors[0].device))
    n = tensors[0].shape[0]
    quant = kernel == "quantize"
    tail = (r.s1, r.s2, r.c, table.thresholds, table.levels, n, tensors[0].stride(0)) if quant else \
        (r.s1_32, r.s2_32, table.levels32, n, r.inv_sqrt_b)
    opts = {"enable_fp_fusion": False} if quant else {}
    if isinstance(q, TurboBlock):
        consts = {"BLOCK": q.block, "LOG_B": r.log_b, "TB": q.bits, "QOFF": q._qs_offset, "BPB": q.bytes_per_block,
                  "BN": bn}
        return (_turbo_quantize_kernel if quant else _turbo_dequantize_kernel), (*tensors, *tail), consts, opts
    consts = {"D": q.dim, "DP": r.dp, "LOG_B": r.log_b, "W": q.bits, "NB": packed_size(q.dim, q.bits), "BN": bn}
    if quant:
        consts["NORM_CORR"] = bool(q.norm_correction)
    return (_mse_quantize_kernel if quant else _mse_dequantize_kernel), (*tensors, r.perm, *tail), consts, opts


def _launch(kernel: str, q, table, block_rows: int | None, *tensors) -> None:
    n = tensors[0].shape[0]
    if n:
        bn = _block_rows(n, _rot_operands(q, str(tensors[0].device)).dp, block_rows)
        fn, args, consts, opts = _plan(kernel, q, table, bn, *tensors)
        fn[(triton.cdiv(n, bn),)](*args, **consts, **opts)


def _check_table(q, table, kind: type) -> None:
    if not isinstance(q, kind):
        raise TypeError(f"q must be a {kind.__name__}, got {type(q).__name__}")
    if kind is TurboBlock and (q.spec.arithmetic != "float64" or q.spec.tables is not None):
        raise ValueError(f"the kernels implement TurboBlock profile 'kvq' (float64 rule, Lloyd-Max tables), "
                         f"not profile {q.spec.name!r}")
    if kind is TurboQuantMSE and q.rotation != "hadamard":
        raise ValueError(f"the Triton kernels implement rotation='hadamard', q has {q.rotation!r}")
    check_device_table(table, q.dim, q.bits)  # types, sizes, device and values: what the kernels index


def _check_device(name: str, t: torch.Tensor, table: DeviceTable) -> None:
    if t.device != table.levels.device:
        raise ValueError(f"{name} is on {t.device}, the table on {table.levels.device}")
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name} is a CPU tensor: run on a GPU or set TRITON_INTERPRET=1 before importing triton")


def _check_bytes(name: str, t, nbytes: int, unit: str, table: DeviceTable) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.ndim < 1 or t.shape[-1] != nbytes:
        raise ValueError(f"{name} must be a uint8 tensor with {nbytes} bytes per {unit}: corrupted buffer")
    _check_device(name, t, table)
    return t.reshape(-1, nbytes).contiguous()


def _check_input(x, dim: int, table: DeviceTable) -> tuple[torch.Tensor, tuple]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != dim:
        raise ValueError(f"x must have last dimension {dim}, got shape {tuple(x.shape)}")
    _check_device("x", x, table)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf")
    return x.reshape(-1, dim).contiguous(), tuple(x.shape[:-1])


def _block_rows(n: int, dp: int, block_rows: int | None) -> int:
    if block_rows is not None:
        if block_rows < 1 or block_rows & (block_rows - 1):
            raise ValueError(f"block_rows must be a power of two, got {block_rows}")
        return block_rows
    cap = 128 if _interpreting() else max(1, 2048 // dp)  # interpreter: few large programs
    return max(1, min(cap, triton.next_power_of_2(max(n, 1))))


def quantize_mse(x: torch.Tensor, q: TurboQuantMSE, table: DeviceTable, block_rows: int | None = None):
    """Encode ``x`` exactly like ``q.encode(x)`` (codes and norms).

    Parameters
    ----------
    x : torch.Tensor, shape (..., q.dim)
        float16, bfloat16, float32 or float64, on the table's device.
    q : TurboQuantMSE
        With ``rotation="hadamard"``; any bits 1..8, any dim, with or without norm correction.
    table : DeviceTable
        ``load_device_table(q.dim, q.bits)``.
    block_rows : int, optional
        Rows per program (power of two).

    Returns
    -------
    packed : torch.Tensor, uint8, shape (..., ceil(dim * bits / 8))
        ``q.encode(x).arrays["codes"]``.
    norms : torch.Tensor, shape (...), ``q.norm_dtype``
        ``q.encode(x).arrays["norms"]``.

    Raises
    ------
    TableMismatchError
        ``table`` is not SphereMarginal(q.dim) at q.bits (checked before launch).
    TypeError, ValueError
        Bad input dtype, shape, device or values; a scale that overflows the norm dtype.
    """
    _check_table(q, table, TurboQuantMSE)
    flat, lead = _check_input(x, q.dim, table)
    n, nb = flat.shape[0], packed_size(q.dim, q.bits)
    packed = torch.empty((n, nb), dtype=torch.uint8, device=flat.device)
    norms = torch.empty((n,), dtype=getattr(torch, q.norm_dtype), device=flat.device)
    _launch("quantize", q, table, block_rows, flat, packed, norms)
    if not bool(torch.isfinite(norms).all()):
        raise ValueError(f"norms overflow {q.norm_dtype}; store them in float32")
    return packed.reshape(lead + (nb,)), norms.reshape(lead)


def dequantize_mse(packed: torch.Tensor, norms: torch.Tensor, q: TurboQuantMSE, table: DeviceTable,
                   block_rows: int | None = None) -> torch.Tensor:
    """Decode packed codes and scales like ``q.decode`` (float32 arithmetic).

    Parameters
    ----------
    packed : torch.Tensor, uint8, shape (..., ceil(dim * bits / 8))
    norms : torch.Tensor, shape (...), ``q.norm_dtype``
    q : TurboQuantMSE
    table : DeviceTable
    block_rows : int, optional

    Returns
    -------
    torch.Tensor, float32, shape (..., q.dim)

    Raises
    ------
    TableMismatchError
        Wrong table (before launch).
    TypeError, ValueError
        Wrong dtypes or shapes, NaN/Inf norms, or set padding bits (a corrupted buffer).
    """
    _check_table(q, table, TurboQuantMSE)
    flat = _check_bytes("packed", packed, packed_size(q.dim, q.bits), "row", table)
    lead = tuple(packed.shape[:-1])
    want = getattr(torch, q.norm_dtype)
    if not isinstance(norms, torch.Tensor) or norms.dtype != want or tuple(norms.shape) != lead:
        raise ValueError(f"norms must be {want} of shape {lead}")
    _check_device("norms", norms, table)
    nrm = norms.reshape(-1).contiguous()
    if not bool(torch.isfinite(nrm).all()):
        raise ValueError("encoded array 'norms' holds NaN/Inf: corrupted buffer")
    used = (q.dim * q.bits) % 8
    if used and flat.shape[0] and bool((flat[:, -1] >> used).any()):
        raise ValueError("packed codes have non-zero padding bits: corrupted buffer")
    out = torch.empty((flat.shape[0], q.dim), dtype=torch.float32, device=flat.device)
    _launch("dequantize", q, table, block_rows, flat, nrm, out)
    return out.reshape(lead + (q.dim,))


def quantize_turbo_block(x: torch.Tensor, q: TurboBlock, table: DeviceTable,
                         block_rows: int | None = None) -> torch.Tensor:
    """Encode ``x`` into raw turbo2/3/4 blocks, byte-identical to ``q.encode(x).arrays["blocks"]``.

    Parameters
    ----------
    x : torch.Tensor, shape (..., q.block)
    q : TurboBlock
        Profile ``"kvq"``, any format, 128- or 32-value blocks.
    table : DeviceTable
        ``load_device_table(q.block, q.bits)``.
    block_rows : int, optional

    Returns
    -------
    torch.Tensor, uint8, shape (..., q.bytes_per_block)

    Raises
    ------
    TableMismatchError, TypeError, ValueError
        As for ``quantize_mse``.
    """
    _check_table(q, table, TurboBlock)
    flat, lead = _check_input(x, q.block, table)
    blocks = torch.empty((flat.shape[0], q.bytes_per_block), dtype=torch.uint8, device=flat.device)
    _launch("quantize", q, table, block_rows, flat, blocks)
    if not bool(((blocks[:, 1] & 0x7C) != 0x7C).all()):
        raise ValueError("norms overflow float16")
    return blocks.reshape(lead + (q.bytes_per_block,))


def dequantize_turbo_block(blocks: torch.Tensor, q: TurboBlock, table: DeviceTable,
                           block_rows: int | None = None) -> torch.Tensor:
    """Decode raw turbo blocks like ``q.decode`` (float32 arithmetic).

    Parameters
    ----------
    blocks : torch.Tensor, uint8, shape (..., q.bytes_per_block)
    q : TurboBlock
    table : DeviceTable
    block_rows : int, optional

    Returns
    -------
    torch.Tensor, float32, shape (..., q.block)

    Raises
    ------
    TableMismatchError
        Wrong table (before launch).
    ValueError
        Wrong dtype or size, a NaN/Inf or sign-bit-set norm, or a non-zero unused field.
    """
    _check_table(q, table, TurboBlock)
    flat = _check_bytes("blocks", blocks, q.bytes_per_block, "block", table)
    lead = tuple(blocks.shape[:-1])
    hi = flat[:, 1]
    if bool(((hi & 0x80) != 0).any()) or bool(((hi & 0x7C) == 0x7C).any()):
        raise ValueError(f"{q.fmt} block norm is NaN/Inf or negative: corrupted buffer")
    if q._has_unused and bool(flat[:, 2:4].any()):
        raise ValueError(f"{q.fmt} block unused field is not zero: corrupted buffer")
    out = torch.empty((flat.shape[0], q.block), dtype=torch.float32, device=flat.device)
    _launch("dequantize", q, table, block_rows, flat, out)
    return out.reshape(lead + (q.block,))


# ---- Hopper compile check (no GPU needed) --------------------------------------------------------
_TT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
       torch.uint8: "u8", torch.int32: "i32"}


def _hopper_compile_one(kernel: str, q, dtype=torch.float16, block_rows: int | None = None):
    """Compile one kernel specialization in this (non-interpreter) process, with ``_plan``'s arguments."""
    from .hopper import compile_for_hopper

    if kernel not in ("quantize", "dequantize"):
        raise ValueError(f"kernel must be 'quantize' or 'dequantize', got {kernel!r}")

    def e(dt):
        return torch.empty((1, q.dim), dtype=dt)

    u8, f32 = e(torch.uint8), e(torch.float32)
    nrm = e(torch.float16 if isinstance(q, TurboBlock) else getattr(torch, q.norm_dtype))
    tab = DeviceTable(None, e(torch.float64), e(torch.float64), f32, f32)
    tensors = {("quantize", True): (e(dtype), u8), ("quantize", False): (e(dtype), u8, nrm),
               ("dequantize", True): (u8, f32), ("dequantize", False): (u8, nrm, f32)}
    bn = block_rows or max(1, 2048 // _rot_operands(q, "cpu").dp)
    fn, args, consts, opts = _plan(kernel, q, tab, bn, *tensors[kernel, isinstance(q, TurboBlock)])
    sig = {name: f"*{_TT[v.dtype]}" if isinstance(v, torch.Tensor) else ("fp32" if isinstance(v, float) else "i32")
           for name, v in zip(fn.arg_names, args)}
    return compile_for_hopper(fn, {**sig, **{k: "constexpr" for k in consts}}, consts, **opts)


def hopper_compile(specs):
    """Compile kernel specializations for sm_90 (no GPU needed) and report their resources.

    Parameters
    ----------
    specs : iterable of tuples ``(kernel, q[, dtype[, block_rows]])``
        ``kernel`` is ``"quantize"`` or ``"dequantize"``; ``q`` a TurboQuantMSE or TurboBlock;
        ``dtype`` the quantize kernel's input dtype (default float16); ``block_rows`` the rows per
        program (default: what a GPU launch of many rows uses).

    Returns
    -------
    list of gpu.triton.hopper.HopperReport
        Under ``TRITON_INTERPRET=1`` compiled in a fresh process (``hopper.in_compile_process``).
    """
    from .hopper import in_compile_process

    specs = [tuple(s) for s in specs]
    if _interpreting():
        return in_compile_process(__name__, "hopper_compile", specs)
    return [_hopper_compile_one(*s) for s in specs]
