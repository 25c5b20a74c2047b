"""Fused decode attention over a TurboQuantMSE-packed KV cache (Triton).

One program per (batch, KV head) attends the queries of its GQA group to every cached token in a
single pass, the way ``kvq_ref.attention.attention_decode`` defines it for a ``QuantizedKV`` whose
key and value methods are ``kvq_ref.TurboQuantMSE`` with the Hadamard rotation:

1. the query is rotated once into the key codebook domain, ``q_r = R_k q`` with
   ``R = D2 . H_b . P . D1`` from ``kvq_ref.rotations.HadamardRotation(d, seed)`` (the permutation
   and ``D1`` are applied while loading, the butterflies on registers, then ``1/sqrt(b)`` and ``D2``);
2. scores of encoded tokens are ``scale * norm_t * sum_j q_r[j] levels_k[code_tj]`` (codes unpacked
   from the little-endian bit stream of ``kvq_ref.packing``, levels from the float32 table of
   ``gpu.tables``), scores of the 16-bit band tokens are ``scale * q . k_t``;
3. an online softmax runs over blocks of tokens (band blocks first, then encoded blocks), summing
   encoded values in the value rotation's domain (``p_t * norm_t * levels_v[code_tj]``) and band
   values in the original domain;
4. the epilogue applies ``R_v^T`` once to the rotated sum, adds the band sum and divides by the
   softmax denominator.

Precision contract: this is a float32 kernel (levels, norms widened from float16, products, exp,
sums); it is not bit-identical to kvq_ref, which works in float64. Tests compare it with kvq_ref
under a tolerance derived from float32 rounding (``tests/gpu/test_triton_attention.py``). Kernels
own no math: levels come from table files through ``gpu.tables.load_device_table``, rotation signs
and permutations from ``kvq_ref.rotations``, byte layouts from ``kvq_ref.packing``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from codebooks import SphereMarginal
from gpu.tables import DeviceTable, TableMismatchError
from kvq_ref.packing import packed_size
from kvq_ref.rotations import HadamardRotation
from kvq_ref.turboquant import TurboQuantMSE

from .codes import code_at, fwht_tile

__all__ = ["Band", "decode_attention_mse", "inputs_from_cache", "hopper_builds"]


@triton.jit
def _mse_decode_kernel(q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, klev_ptr, vlev_ptr,
                       kperm_ptr, ksign_ptr, vperm_ptr, vsign_ptr, bk_ptr, bv_ptr, out_ptr,
                       N, NB, scale, k_inv_sqrt_b, v_inv_sqrt_b,
                       G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, KBITS: tl.constexpr,
                       VBITS: tl.constexpr, KBYTES: tl.constexpr, VBYTES: tl.constexpr,
                       K_LOG_B: tl.constexpr, V_LOG_B: tl.constexpr):
    """One (batch, KV head): queries (G, D), N encoded tokens, NB band tokens -> output (G, D).

    Layouts (contiguous): q/out (P, G, D) float32; kc/vc (P, N, K/VBYTES) uint8; kn/vn (P, N);
    bk/bv (P, NB, D) float16; ksign/vsign (2, D) float32 = (signs1, signs2); kperm/vperm (D,) int32.
    """
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    qmask = (rows < G)[:, None] & cmask[None, :]
    q_base = q_ptr + pid * G * D + rows[:, None] * D
    q = tl.load(q_base + cols[None, :], mask=qmask, other=0.0)

    # rotate the query once: pre[j] = q[perm[j]] * signs1[perm[j]], butterflies, 1/sqrt(b), signs2
    kperm = tl.load(kperm_ptr + cols, mask=cmask, other=0)
    pre = tl.load(q_base + kperm[None, :], mask=qmask, other=0.0) \
        * tl.load(ksign_ptr + kperm, mask=cmask, other=0.0)[None, :]
    ks2 = tl.load(ksign_ptr + D + cols, mask=cmask, other=0.0)
    q_rot = fwht_tile(pre, G_PAD, D_PAD, K_LOG_B) * (ks2 * (k_inv_sqrt_b * scale))[None, :]

    vperm = tl.load(vperm_ptr + cols, mask=cmask, other=0)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_rot = tl.zeros((G_PAD, D_PAD), tl.float32)   # encoded values, value-rotation domain
    acc_band = tl.zeros((G_PAD, D_PAD), tl.float32)  # band values, original domain at vperm order

    for start in range(0, NB, BLOCK_B):
        t = start + tl.arange(0, BLOCK_B)
        tmask = t < NB
        bmask = tmask[:, None] & cmask[None, :]
        base = (pid * NB + t)[:, None] * D
        kb = tl.load(bk_ptr + base + cols[None, :], mask=bmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * kb[None, :, :], axis=2) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vb = tl.load(bv_ptr + base + vperm[None, :], mask=bmask, other=0.0).to(tl.float32)
        acc_band = acc_band * alpha[:, None] + tl.sum(p[:, :, None] * vb[None, :, :], axis=1)
        acc_rot = acc_rot * alpha[:, None]
        m_i = m_new

    for start in range(0, N, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < N
        lmask = tmask[:, None] & cmask[None, :]
        tok = pid * N + t
        kcode = code_at(kc_ptr + tok[:, None] * KBYTES, cols[None, :], KBITS, KBYTES, lmask)
        klev = tl.load(klev_ptr + kcode, mask=lmask, other=0.0)
        kn = tl.load(kn_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
        s = tl.sum(q_rot[:, None, :] * klev[None, :, :], axis=2) * kn[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vcode = code_at(vc_ptr + tok[:, None] * VBYTES, cols[None, :], VBITS, VBYTES, lmask)
        vn = tl.load(vn_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
        vhat = tl.load(vlev_ptr + vcode, mask=lmask, other=0.0) * vn[:, None]
        acc_rot = acc_rot * alpha[:, None] + tl.sum(p[:, :, None] * vhat[None, :, :], axis=1)
        acc_band = acc_band * alpha[:, None]
        m_i = m_new

    # one inverse value rotation: x[perm[j]] = signs1[perm[j]] * (H (signs2 * y))[j] / sqrt(b)
    vs2 = tl.load(vsign_ptr + D + cols, mask=cmask, other=0.0)
    vs1 = tl.load(vsign_ptr + vperm, mask=cmask, other=0.0)
    z = fwht_tile(acc_rot * vs2[None, :], G_PAD, D_PAD, V_LOG_B) * (vs1 * v_inv_sqrt_b)[None, :]
    out = (z + acc_band) / l_i[:, None]
    tl.store(out_ptr + pid * G * D + rows[:, None] * D + vperm[None, :], out, mask=qmask)


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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_method(name, method, table, d):
    if not isinstance(method, TurboQuantMSE):
        raise TypeError(f"{name} must be a kvq_ref.TurboQuantMSE, got {type(method).__name__}")
    if method.rotation != "hadamard":
        raise ValueError(f"{name} uses the {method.rotation!r} rotation; this kernel implements 'hadamard'")
    if method.dim != d:
        raise ValueError(f"{name} has dim {method.dim}, the queries have d={d}")
    if not isinstance(table, DeviceTable):
        raise TypeError(f"the table for {name} must be a gpu.tables.DeviceTable, got {type(table).__name__}")
    if table.codebook.density != SphereMarginal(d) or table.bits != method.bits:
        raise TableMismatchError(f"{name} needs the SphereMarginal({d}) table at {method.bits} bits, "
                                 f"got {table.codebook.name} ({table.bits} bits)")


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


def decode_attention_mse(q, keys_packed, keys_norms, values_packed, values_norms, kq, vq, ktable, vtable,
                         band=None, scale=None, block_n=None, block_band=None, num_warps=None):
    """Decode attention of a GQA group over a TurboQuantMSE-packed cache, fused in one Triton kernel.

    Parameters
    ----------
    q : torch.Tensor, float32/float16/bfloat16, shape (..., g, d)
        Queries; the leading axes (batch, KV heads) index independent caches, one program each.
    keys_packed, values_packed : torch.Tensor, uint8, shape (..., N, nbytes)
        ``TurboQuantMSE.encode(x).arrays["codes"]`` of the N encoded tokens (nbytes from kq/vq bits).
    keys_norms, values_norms : torch.Tensor, shape (..., N)
        The stored scales, of the methods' ``norm_dtype`` (float16 by default).
    kq, vq : kvq_ref.TurboQuantMSE
        The key and value methods (Hadamard rotation; bits and seeds may differ).
    ktable, vtable : gpu.tables.DeviceTable
        ``load_device_table(d, kq.bits)`` and ``load_device_table(d, vq.bits)`` on q's device.
    band : Band, optional
        Float16 band tokens (first sink, last window), shape (..., n_band, d).
    scale : float, optional
        Logit scale (default ``1/sqrt(d)``).
    block_n, block_band : int, optional
        Tokens per loop step (powers of two; defaults: 16 on a GPU, up to 512 under the interpreter).
    num_warps : int, optional
        Default ``_default_warps(g, d)`` (4, or 8 for g * d above 512: no spills on sm_90).

    Returns
    -------
    torch.Tensor, float32, shape (..., g, d)

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
    if dev.type == "cpu" and not _interpreting():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    _check_method("kq", kq, ktable, d)
    _check_method("vq", vq, vtable, d)
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
    auto = 512 if _interpreting() else 16
    block_n = block_n or min(auto, triton.next_power_of_2(max(n, 1)))
    block_band = block_band or min(auto, triton.next_power_of_2(max(nb, 1)))
    for name, b in (("block_n", block_n), ("block_band", block_band)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two, got {b}")

    programs = math.prod(lead)
    out = torch.empty(lead + (g, d), dtype=torch.float32, device=dev)
    if programs == 0:
        return out
    kperm, ksign, k_log_b, k_inv = _rotation_tensors(d, kq.seed, str(dev))
    vperm, vsign, v_log_b, v_inv = _rotation_tensors(d, vq.seed, str(dev))

    def buffer(x, present):  # never hand the kernel an empty allocation (a null pointer on a GPU)
        return x.contiguous() if present else torch.zeros(1, dtype=x.dtype, device=dev)

    half = torch.zeros(1, dtype=torch.float16, device=dev)
    bk, bv = (band.keys, band.values) if nb else (half, half)
    _mse_decode_kernel[(programs,)](
        q.to(torch.float32).contiguous(), buffer(keys_packed, n), buffer(keys_norms, n), buffer(values_packed, n),
        buffer(values_norms, n), ktable.levels32, vtable.levels32, kperm, ksign, vperm, vsign,
        bk.contiguous(), bv.contiguous(), out, n, nb, scale, k_inv, v_inv,
        G=g, D=d, G_PAD=triton.next_power_of_2(g), D_PAD=triton.next_power_of_2(d), BLOCK_N=block_n,
        BLOCK_B=block_band, KBITS=kq.bits, VBITS=vq.bits, KBYTES=packed_size(d, kq.bits),
        VBYTES=packed_size(d, vq.bits), K_LOG_B=k_log_b, V_LOG_B=v_log_b,
        num_warps=num_warps or _default_warps(g, d))
    return out


def _default_warps(g: int, d: int) -> int:
    """Warps per program: a (g, 16, d) product tile over 4 warps fits sm_90's registers up to g*d = 512."""
    return 4 if triton.next_power_of_2(g) * triton.next_power_of_2(d) <= 512 else 8


def hopper_builds(d=128, g=4, kbits=3, vbits=2, block_n=16, block_band=16, num_warps=None, norm_dtype="fp16"):
    """Compile the decode kernel for sm_90 (no GPU needed) and report registers and spills.

    Measured with Triton 3.9 (d=128, g=4, 3/2 bits, 16-token blocks): 195 registers, no spills at 4 warps;
    64-token blocks spill about 3.4 KB, which is why the GPU default is 16.

    Returns
    -------
    gpu.triton.hopper.HopperReport
    """
    from .hopper import compile_for_hopper, in_compile_process

    if _interpreting():  # this process's kernels are interpreter functions: compile in a fresh one
        return in_compile_process(__name__, "hopper_builds", d, g, kbits, vbits, block_n, block_band, num_warps,
                                  norm_dtype)

    block = d & -d
    sig = {name: "*fp32" for name in ("q_ptr", "klev_ptr", "vlev_ptr", "ksign_ptr", "vsign_ptr", "out_ptr")}
    sig.update({"kc_ptr": "*u8", "vc_ptr": "*u8", "kn_ptr": f"*{norm_dtype}", "vn_ptr": f"*{norm_dtype}",
                "kperm_ptr": "*i32", "vperm_ptr": "*i32", "bk_ptr": "*fp16", "bv_ptr": "*fp16",
                "N": "i32", "NB": "i32", "scale": "fp32", "k_inv_sqrt_b": "fp32", "v_inv_sqrt_b": "fp32"})
    const = {"G": g, "D": d, "G_PAD": triton.next_power_of_2(g), "D_PAD": triton.next_power_of_2(d),
             "BLOCK_N": block_n, "BLOCK_B": block_band, "KBITS": kbits, "VBITS": vbits,
             "KBYTES": packed_size(d, kbits), "VBYTES": packed_size(d, vbits),
             "K_LOG_B": block.bit_length() - 1, "V_LOG_B": block.bit_length() - 1}
    sig.update({k: "constexpr" for k in const})
    return compile_for_hopper(_mse_decode_kernel, {k: sig[k] for k in _mse_decode_kernel.arg_names}, const,
                              num_warps=num_warps or _default_warps(g, d), enable_fp_fusion=True)
