"""Decode attention over a contiguous TurboQuantMSE-packed KV cache: a thin case of the paged kernels.

``decode_attention_mse`` takes kvq_ref's arrays (one cache per leading index, ``(..., N, nbytes)``
codes) and runs ``gpu.triton.paged``'s split-sequence kernels with one page per cache (page size N,
one KV head, the identity block table). What it computes is
``kvq_ref.attention.attention_decode`` for a ``QuantizedKV`` whose key and value methods are
``kvq_ref.TurboQuantMSE`` with the Hadamard rotation:

1. the query is rotated once into the key codebook domain, ``q_r = R_k q`` with
   ``R = D2 . H_b . P . D1`` from ``kvq_ref.rotations.HadamardRotation(d, seed)``;
2. scores of encoded tokens are ``scale * norm_t * sum_j q_r[j] levels_k[code_tj]``, of the 16-bit
   band tokens ``scale * q . k_t``;
3. an online softmax per split of the encoded tokens sums values in the value rotation's domain
   (``p_t * norm_t * levels_v[code_tj]``), the band is one more partial in the original domain;
4. the merge applies ``R_v^T`` once to the merged rotated sum, adds the band and divides.

Precision contract: float32 (levels, norms widened from float16, products, exp, sums); not
bit-identical to kvq_ref, which works in float64. Tests compare under a tolerance derived from
float32 rounding (``tests/gpu/test_triton_attention.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections import namedtuple
from functools import lru_cache

import numpy as np
import torch
import triton

from gpu.tables import DeviceTable, TableMismatchError, check_device_table
from kvq_ref.packing import packed_size
from kvq_ref.rotations import HadamardRotation
from kvq_ref.turboquant import TurboQuantMSE

from .paged import default_blocks, interpreting, launch_paged, plan_splits, row_words, rows_pad

_interpreting = interpreting  # used by gpu.triton.nova

__all__ = ["Band", "decode_attention_mse", "inputs_from_cache", "kernel_params", "check_method"]


@dataclass(frozen=True)
class Band:
    """The 16-bit band of a cache: the first ``sink`` and last ``window`` tokens, kept in float16.

    Attributes
    ----------
    keys, values : torch.Tensor, float16, shape (..., n_band, d)
    positions : sequence of int, length n_band
        Token positions ``0 .. sink-1`` then ``n - window .. n - 1`` (``QuantizedKV.band_positions``);
        the encoded tokens are the positions in between, in order.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: tuple


@lru_cache(maxsize=64)
def _rotation_tensors(d: int, seed: int, device: str):
    """HadamardRotation(d, seed) for the kernel: perm int32 (d,), signs float32 (2, d) = (signs1, signs2)
    on ``device``, log2 of the block size and 1/sqrt(block)."""
    rot = HadamardRotation(d, seed)
    return (torch.tensor(rot.perm, dtype=torch.int32, device=device),
            torch.tensor(np.stack([rot.signs1, rot.signs2]), dtype=torch.float32, device=device),
            int(rot.block).bit_length() - 1, 1.0 / math.sqrt(rot.block))


KernelParams = namedtuple("KernelParams", "bits perm signs log_b inv_sqrt_b levels sym")


def kernel_params(method: TurboQuantMSE, table: DeviceTable, device) -> KernelParams:
    """What the kernels read of one method: bits, the rotation (perm int32 (d,), signs float32 (2, d),
    log2 of the block, 1/sqrt(block)) and the table's float32 levels as 16 host floats (kernel
    arguments, i.e. registers; unused slots 0). No device-to-host copy: levels come from the host table.

    At 4 bits a table that is exactly symmetric in float32 (``level[c] = -level[15 - c]``, true of the
    Lloyd-Max tables) is passed as its upper half (magnitudes) with ``sym=True``: the kernel selects
    among 8 magnitudes and takes the sign from the code's top bit (sm_90 SASS of the encoded loop at
    d=128, g=4, measured before in-place bit tests: 1555 instead of 1614 instructions per warp; at
    2 bits the sign cost more than the saved selects, 1604 against 1420, so 2-bit tables use the
    full tree)."""
    perm, signs, log_b, inv = _rotation_tensors(method.dim, method.seed, str(device))
    lev32 = np.asarray(table.codebook.levels, dtype=np.float32)
    sym = method.bits == 4 and bool(np.array_equal(lev32, -lev32[::-1]))
    lev = [float(x) for x in (lev32[lev32.size // 2:] if sym else lev32)]
    return KernelParams(method.bits, perm, signs, log_b, inv, tuple(lev + [0.0] * (16 - len(lev))), sym)


def resolve_precision(kq, vq, precision):
    """The ``tl.dot`` operand precision: "fp16" by default with float16 norms (the value norm is
    folded into float16 weights, so float32 norms, which may exceed 65504, default to "tf32x3")."""
    half_norms = kq.norm_dtype == "float16" and vq.norm_dtype == "float16"
    precision = precision or ("fp16" if half_norms else "tf32x3")
    if precision not in ("fp16", "tf32x3", "ieee"):
        raise ValueError(f"precision must be 'fp16', 'tf32x3' or 'ieee', got {precision!r}")
    if precision == "fp16" and not half_norms:
        raise ValueError("precision 'fp16' folds value norms into float16 weights: it needs float16 norms")
    return precision


def check_method(name, method, table, d):
    """TypeError/ValueError/TableMismatchError unless ``method`` is a Hadamard TurboQuantMSE of dim d
    with at most 4 bits and ``table`` its DeviceTable."""
    _check_method(name, method, table, d)
    if method.bits > 4:
        raise ValueError(f"{name} has {method.bits} bits; the decode kernels take 1..4")


def _check_method(name, method, table, d):
    if not isinstance(method, TurboQuantMSE):
        raise TypeError(f"{name} must be a kvq_ref.TurboQuantMSE, got {type(method).__name__}")
    if method.rotation != "hadamard":
        raise ValueError(f"{name} uses the {method.rotation!r} rotation; this kernel implements 'hadamard'")
    if method.dim != d:
        raise ValueError(f"{name} has dim {method.dim}, the queries have d={d}")
    if not isinstance(table, DeviceTable):
        raise TypeError(f"the table for {name} must be a gpu.tables.DeviceTable, got {type(table).__name__}")
    try:
        check_device_table(table, d, method.bits)  # types, sizes, device and values: what the kernels index
    except TableMismatchError as exc:
        raise TableMismatchError(f"{name} needs the SphereMarginal({d}) table at {method.bits} bits: {exc}") from None


def _check_tensor(name, x, dtypes, shape, device):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(t) for t in dtypes)}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the queries are on {device}")


def _check_band(band, lead, d, n_mid, device):
    if not isinstance(band, Band):
        raise TypeError(f"band must be a Band or None, got {type(band).__name__}")
    pos = np.asarray(band.positions, dtype=np.int64).reshape(-1)
    nb = pos.size
    n = n_mid + nb
    prefix = pos == np.arange(nb)
    sink = nb if prefix.all() else int(np.argmin(prefix))  # length of the run 0, 1, 2, ...
    want = np.concatenate([np.arange(sink), np.arange(sink + n_mid, n)])
    if not np.array_equal(pos, want):
        raise ValueError(f"band positions must be 0..sink-1 then the last window positions of the {n} tokens "
                         f"(encoded tokens in between), got {pos.tolist()}")
    for nm in ("keys", "values"):
        _check_tensor(f"band.{nm}", getattr(band, nm), (torch.float16,), lead + (nb, d), device)
    return nb


def inputs_from_cache(cache, device="cpu") -> tuple:
    """Kernel inputs of one head's ``kvq_ref.attention.QuantizedKV`` (TurboQuantMSE keys and values).

    Returns
    -------
    keys_packed, keys_norms, values_packed, values_norms : torch.Tensor
        The encoded middle tokens, shapes (N, nbytes) and (N,); N = 0 when every token is in the band.
    band : Band or None
        None when the cache keeps no band tokens.
    """
    out = []
    for method, enc in ((cache.key_method, cache.keys), (cache.value_method, cache.values)):
        if not isinstance(method, TurboQuantMSE):
            raise TypeError(f"cache methods must be TurboQuantMSE, got {type(method).__name__}")
        if enc is None:
            codes = np.zeros((0, packed_size(cache.d, method.bits)), np.uint8)
            norms = np.zeros(0, np.dtype(method.norm_dtype))
        else:
            codes, norms = enc.arrays["codes"], enc.arrays["norms"]
        out += [torch.from_numpy(np.ascontiguousarray(codes)).to(device),
                torch.from_numpy(np.ascontiguousarray(norms)).to(device)]
    band = None
    if cache.band_keys.shape[0]:
        band = Band(torch.from_numpy(np.ascontiguousarray(cache.band_keys)).to(device),
                    torch.from_numpy(np.ascontiguousarray(cache.band_values)).to(device),
                    tuple(int(p) for p in cache.band_positions))
    return (*out, band)




def _rows_for_kernel(packed, d, bits, lead, n):
    """(pages = prod(lead), 1, N, row) uint8 rows the kernel reads as whole words: kvq_ref's rows as
    they are when their length is a multiple of 4 bytes covering the words read, else zero-padded."""
    pages = math.prod(lead)
    nb = packed.shape[-1]
    need = 4 * row_words(d, bits)
    flat = packed.reshape(pages, 1, n, nb)
    if nb % 4 == 0 and nb >= need:
        return flat.contiguous()
    row = -(-need // 16) * 16
    out = torch.zeros((pages, 1, n, row), dtype=torch.uint8, device=packed.device)
    out[..., :nb] = flat
    return out


def decode_attention_mse(q, keys_packed, keys_norms, values_packed, values_norms, kq, vq, ktable, vtable,
                         band=None, scale=None, block_n=None, block_band=None, num_warps=None, splits=None,
                         precision=None):
    """Decode attention of a GQA group over a TurboQuantMSE-packed cache (split over the sequence).

    Parameters
    ----------
    q : torch.Tensor, float32/float16/bfloat16, shape (..., g, d)
        Queries; the leading axes (batch, KV heads) index independent caches.
    keys_packed, values_packed : torch.Tensor, uint8, shape (..., N, nbytes)
        ``TurboQuantMSE.encode(x).arrays["codes"]`` of the N encoded tokens (nbytes from kq/vq bits).
    keys_norms, values_norms : torch.Tensor, shape (..., N)
        The stored scales, of the methods' ``norm_dtype`` (float16 by default).
    kq, vq : kvq_ref.TurboQuantMSE
        The key and value methods (Hadamard rotation, 1..4 bits; bits and seeds may differ).
    ktable, vtable : gpu.tables.DeviceTable
        ``load_device_table(d, kq.bits)`` and ``load_device_table(d, vq.bits)`` on q's device.
    band : Band, optional
        16-bit band tokens (first sink, last window), float16 or bfloat16, shape (..., n_band, d).
    scale : float, optional
        Logit scale (default ``1/sqrt(d)``).
    block_n, block_band : int, optional
        Tokens per tile (powers of two >= 16; defaults from ``gpu.triton.paged.default_blocks``).
    num_warps : int, optional
    splits : int, optional
        Split count over the encoded tokens (default: ``gpu.triton.paged.plan_splits``).
    precision : str, optional
        ``tl.dot`` operands: "fp16" (default with float16 norms: tensor cores, operands rounded to
        float16, float32 accumulation), "tf32x3" (default with float32 norms) or "ieee" (float32).

    Returns
    -------
    torch.Tensor, q's dtype, shape (..., g, d)

    Raises
    ------
    TypeError, ValueError, gpu.tables.TableMismatchError
        Before any launch, on a wrong type, dtype, shape, device, method or table.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q must be a float32/float16/bfloat16 torch.Tensor, got {getattr(q, 'dtype', type(q))}")
    if q.ndim < 2 or q.shape[-2] < 1 or q.shape[-1] < 2:
        raise ValueError(f"q must have shape (..., g, d) with g >= 1 and d >= 2, got {tuple(q.shape)}")
    *lead, g, d = q.shape
    lead = tuple(lead)
    dev = q.device
    if dev.type == "cpu" and not interpreting():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    check_method("kq", kq, ktable, d)
    check_method("vq", vq, vtable, d)
    if not isinstance(keys_packed, torch.Tensor):
        raise TypeError(f"keys_packed must be a torch.Tensor, got {type(keys_packed).__name__}")
    if keys_packed.ndim != len(lead) + 2:
        raise ValueError(f"keys_packed must be a tensor of shape {lead + ('N', packed_size(d, kq.bits))}")
    n = keys_packed.shape[-2]
    for name, x, method in (("keys", (keys_packed, keys_norms), kq), ("values", (values_packed, values_norms), vq)):
        _check_tensor(f"{name}_packed", x[0], (torch.uint8,), lead + (n, packed_size(d, method.bits)), dev)
        _check_tensor(f"{name}_norms", x[1], (getattr(torch, method.norm_dtype),), lead + (n,), dev)
    for name, table in (("ktable", ktable), ("vtable", vtable)):
        if table.levels32.device != dev:
            raise ValueError(f"{name} is on {table.levels32.device}, the queries are on {dev}")
    nb = 0 if band is None else _check_band(band, lead, d, n, dev)
    if n + nb == 0:
        raise ValueError("the cache holds no tokens")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    m_pad = rows_pad(g)
    bn_auto, bb_auto, warps_auto = default_blocks(d, m_pad, max(kq.bits, vq.bits))
    block_n, block_band = block_n or bn_auto, block_band or bb_auto
    for name, b in (("block_n", block_n), ("block_band", block_band)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    precision = resolve_precision(kq, vq, precision)

    pages = math.prod(lead)
    out = torch.empty(lead + (g, d), dtype=q.dtype, device=dev)
    if pages == 0:
        return out
    plan = plan_splits(pages, 1, n, block_n, splits=splits)

    def rows(packed, method):
        if n == 0:
            return torch.zeros((pages, 1, 1, 16), dtype=torch.uint8, device=dev)
        return _rows_for_kernel(packed, d, method.bits, lead, n)

    def norms(x, method):
        if n == 0:
            return torch.zeros((pages, 1, 1), dtype=getattr(torch, method.norm_dtype), device=dev)
        return x.reshape(pages, 1, n).contiguous()

    if nb:
        bk = band.keys.reshape(pages, 1, nb, d).contiguous()
        bv = band.values.reshape(pages, 1, nb, d).contiguous()
    else:
        bk = bv = torch.zeros((pages, 1, 1, d), dtype=torch.float16, device=dev)
    idx = torch.arange(pages, dtype=torch.int32, device=dev)
    launch_paged(q.reshape(pages, 1, 1, g, d).contiguous(), rows(keys_packed, kq), norms(keys_norms, kq),
                 rows(values_packed, vq), norms(values_norms, vq), idx.reshape(pages, 1),
                 torch.full((pages,), n, dtype=torch.int32, device=dev), bk, bv,
                 torch.full((pages,), nb, dtype=torch.int32, device=dev),
                 kernel_params(kq, ktable, dev), kernel_params(vq, vtable, dev),
                 out=out.view(pages, 1, 1, g, d), scale=scale, plan=plan, block_band=block_band,
                 num_warps=num_warps or warps_auto, prec=precision)
    return out
