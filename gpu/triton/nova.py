"""NOVA-KV decode scores against gain-shape VQ keys (Triton).

``kvq_ref.nova.NovaKV(head, "key")`` stores per token the packed indices of ``d / g`` group
centroids (``bits * g`` bits each) and a gain (float32 by default, float16 with ``gain_dtype``). A query never meets a decoded key: it is
mapped once to coefficient space, ``q_m = q @ key.inverse.T``, and

    score_t = gain_t * sum_j T[j, code_tj] + q . mu,     T[j, i] = q_m[groups_j] . centroids[j, i]

Two kernels implement it:

* ``_nova_tables_kernel`` (one program per (batch, KV head)) forms ``q_m`` group by group (the rows
  ``key.inverse[groups_j]`` are loaded by index, so every row of the inverse is used once), the
  ``G x K`` lookup tables of every query and the offsets ``q . mu``, and writes them to a scratch
  buffer (G * K * 4 bytes per query: 32 KiB at d = 128, g = 4, 2 bits);
* ``_nova_scores_kernel`` (one program per (batch, KV head, block of tokens)) unpacks the codes
  (``kvq_ref.packing`` bit order), gathers ``T[j, code_tj]`` from the scratch tables, sums over the
  groups and applies the gain and the offset.

Precision contract: float32 throughout (the float64 ``key.inverse`` and ``key.mu`` are rounded to
float32 once; centroids are float32 in ``NovaHead``; gains are float32 or float16, widened exactly). Results are
compared with ``NovaKV.inner_product`` under a forward-error bound in the tests. Kernels own no
math: transforms, groups and centroids come from the calibrated ``codebooks.nova.NovaHead``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from codebooks.nova import NovaHead
from kvq_ref.packing import packed_size

from .attention import _check_tensor, _interpreting
from .codes import code_at

__all__ = ["NovaKeyTables", "nova_key_scores", "hopper_builds"]


@triton.jit
def _nova_tables_kernel(q_ptr, inv_ptr, mu_ptr, groups_ptr, cent_ptr, lut_ptr, qmu_ptr,
                        M: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr,
                        K: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr, GS_PAD: tl.constexpr):
    """Lookup tables of one (batch, KV head): lut (P, M, NG, K) and offsets qmu (P, M), float32.

    q (P, M, D) float32; inv (D, D), mu (D,) float32; groups (NG, GS) int32; cent (NG, K, GS) float32.
    """
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D_PAD)
    rmask = rows < M
    cmask = cols < D
    q = tl.load(q_ptr + pid * M * D + rows[:, None] * D + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0)
    mu = tl.load(mu_ptr + cols, mask=cmask, other=0.0)
    tl.store(qmu_ptr + pid * M + rows, tl.sum(q * mu[None, :], axis=1), mask=rmask)

    ts = tl.arange(0, GS_PAD)
    tmask = ts < GS
    ks = tl.arange(0, K)
    for j in range(NG):
        idx = tl.load(groups_ptr + j * GS + ts, mask=tmask, other=0)
        inv_rows = tl.load(inv_ptr + idx[:, None] * D + cols[None, :], mask=tmask[:, None] & cmask[None, :],
                           other=0.0)
        q_m = tl.sum(q[:, None, :] * inv_rows[None, :, :], axis=2)  # (M_PAD, GS_PAD) = q_m[groups_j]
        cent = tl.load(cent_ptr + (j * K + ks[:, None]) * GS + ts[None, :], mask=tmask[None, :], other=0.0)
        lut = tl.sum(q_m[:, None, :] * cent[None, :, :], axis=2)  # (M_PAD, K)
        tl.store(lut_ptr + ((pid * M + rows[:, None]) * NG + j) * K + ks[None, :], lut, mask=rmask[:, None])


@triton.jit
def _nova_scores_kernel(codes_ptr, gains_ptr, lut_ptr, qmu_ptr, out_ptr, N,
                        M: tl.constexpr, NG: tl.constexpr, K: tl.constexpr, CODE_BITS: tl.constexpr,
                        NBYTES: tl.constexpr, M_PAD: tl.constexpr, NG_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores of one block of tokens: out (P, M, N) float32.

    codes (P, N, NBYTES) uint8 (NG codes of CODE_BITS bits per token), gains (P, N) float32 or float16.
    """
    pid = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < N
    js = tl.arange(0, NG_PAD)
    jmask = js < NG
    tok = pid * N + t
    codes = code_at(codes_ptr + tok[:, None] * NBYTES, js[None, :], CODE_BITS, NBYTES,
                    tmask[:, None] & jmask[None, :])  # (BLOCK_N, NG_PAD)
    rows = tl.arange(0, M_PAD)
    rmask = rows < M
    lmask = rmask[:, None, None] & (tmask[:, None] & jmask[None, :])[None, :, :]
    lut = tl.load(lut_ptr + ((pid * M + rows[:, None, None]) * NG + js[None, None, :]) * K + codes[None, :, :],
                  mask=lmask, other=0.0)
    gain = tl.load(gains_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
    qmu = tl.load(qmu_ptr + pid * M + rows, mask=rmask, other=0.0)
    s = tl.sum(lut, axis=2) * gain[None, :] + qmu[:, None]
    tl.store(out_ptr + (pid * M + rows[:, None]) * N + t[None, :], s, mask=rmask[:, None] & tmask[None, :])


@dataclass(frozen=True, eq=False)
class NovaKeyTables:
    """A NovaHead's key tables as float32/int32 device tensors (convert once, launch many times).

    Attributes
    ----------
    inverse : torch.Tensor, float32, (d, d)
        ``key.inverse`` (queries map as ``q_m = q @ inverse.T``).
    mu : torch.Tensor, float32, (d,)
    groups : torch.Tensor, int32, (G, g)
    centroids : torch.Tensor, float32, (G, K, g)
    bits, g : int
        Bits per coefficient and coefficients per group (codes have ``bits * g`` bits).
    digest : str
        ``NovaHead.digest`` of the head the tables came from.
    """

    inverse: torch.Tensor
    mu: torch.Tensor
    groups: torch.Tensor
    centroids: torch.Tensor
    bits: int
    g: int
    digest: str

    def check(self, device=None) -> "NovaKeyTables":
        """Refuse, before any launch, tables the kernels cannot index safely (hand-built ones too): the
        kernels gather query coordinates at ``groups`` and centroids at code values, so ``groups``
        must be a partition of 0..d-1 into (G, g), every tensor contiguous on one device with the
        documented dtype and shape, ``K = 2^(bits * g)`` with ``bits * g`` in 1..8, values finite.
        One small device-to-host copy of ``groups`` and a finiteness reduction per call."""
        for name, dtype in (("inverse", torch.float32), ("mu", torch.float32), ("groups", torch.int32),
                            ("centroids", torch.float32)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise TypeError(f"tables.{name} must be a {dtype} torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if t.device != (device or self.mu.device):
                raise ValueError(f"tables.{name} is on {t.device}, the others on {device or self.mu.device}")
            if not t.is_contiguous():
                raise ValueError(f"tables.{name} must be contiguous (a strided view would be read as if it were)")
        for name in ("bits", "g"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tables.{name} must be a positive integer, got {v!r}")
        if self.mu.ndim != 1:
            raise ValueError(f"tables.mu must be 1-D (d,), got shape {tuple(self.mu.shape)}")
        d, g = self.d, self.g
        code_bits = self.bits * g
        if not 1 <= code_bits <= 8 or d % g:
            raise ValueError(f"tables: bits * g = {code_bits} must be in 1..8 and g = {g} must divide d = {d}")
        shapes = {"inverse": (d, d), "groups": (d // g, g), "centroids": (d // g, 1 << code_bits, g)}
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"tables.{name} must have shape {shape}, got {tuple(getattr(self, name).shape)}")
        groups = self.groups.detach().cpu().numpy().reshape(-1)
        if not np.array_equal(np.sort(groups), np.arange(d)):
            bad = groups[(groups < 0) | (groups >= d)]
            raise ValueError(f"tables.groups must partition the coordinates 0..{d - 1} "
                             f"({'index ' + str(int(bad[0])) + ' is out of range' if bad.size else 'an index repeats'})")
        for name in ("inverse", "mu", "centroids"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise ValueError(f"tables.{name} holds NaN/Inf")
        return self

    @property
    def d(self) -> int:
        return int(self.mu.shape[0])

    @property
    def n_groups(self) -> int:
        return int(self.groups.shape[0])

    @property
    def k(self) -> int:
        return int(self.centroids.shape[1])

    @classmethod
    def from_head(cls, head: NovaHead, device="cpu") -> "NovaKeyTables":
        """Round ``head``'s key transform to float32 and move everything to ``device``."""
        if not isinstance(head, NovaHead):
            raise TypeError(f"head must be a codebooks.nova.NovaHead, got {type(head).__name__}")
        d, g = head.d, head.g
        n_groups, k = d // g, 2 ** (head.bits * g)
        if head.key_groups.shape != (n_groups, g) or head.key_centroids.shape != (n_groups, k, g):
            raise ValueError(f"head tables have groups {head.key_groups.shape} and centroids "
                             f"{head.key_centroids.shape}; d={d}, g={g}, bits={head.bits} need "
                             f"{(n_groups, g)} and {(n_groups, k, g)}")

        def tensor(a, dtype):
            return torch.tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        return cls(tensor(head.key.inverse, torch.float32), tensor(head.key.mu, torch.float32),
                   tensor(head.key_groups, torch.int32), tensor(head.key_centroids, torch.float32),
                   head.bits, g, head.digest)


def _default_block(n_groups: int, m_pad: int) -> int:
    """Tokens per scores program on a GPU: a (m, BLOCK_N, G) gather tile of about 8K entries."""
    return max(16, min(128, 8192 // (m_pad * triton.next_power_of_2(n_groups))))


def nova_key_scores(q, codes, gains, tables, block_n=None, num_warps=4) -> torch.Tensor:
    """NOVA-KV decode scores ``q . k_hat_t`` of queries against packed keys, by per-group lookup tables.

    Parameters
    ----------
    q : torch.Tensor, float32/float16/bfloat16, shape (..., m, d)
        Queries (a GQA group); leading axes (batch, KV heads) index independent caches.
    codes : torch.Tensor, uint8, shape (..., N, nbytes)
        ``NovaKV(head, "key").encode(k).arrays["codes"]`` (``nbytes = ceil(G * bits * g / 8)``).
    gains : torch.Tensor, float32 or float16, shape (..., N)
        ``...arrays["gains"]``.
    tables : NovaKeyTables or codebooks.nova.NovaHead
        The head's key tables (a NovaHead is converted on every call; convert once for speed).
    block_n : int, optional
        Tokens per scores program (power of two; default 128-ish on a GPU, up to 1024 interpreted).
    num_warps : int

    Returns
    -------
    torch.Tensor, float32, shape (..., m, N)

    Raises
    ------
    TypeError, ValueError
        Before any launch, on a wrong type, dtype, shape or device.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q must be a float32/float16/bfloat16 torch.Tensor, got {getattr(q, 'dtype', type(q))}")
    if q.ndim < 2 or q.shape[-2] < 1:
        raise ValueError(f"q must have shape (..., m, d) with m >= 1, got {tuple(q.shape)}")
    dev = q.device
    if dev.type == "cpu" and not _interpreting():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    if isinstance(tables, NovaHead):
        tables = NovaKeyTables.from_head(tables, dev)
    if not isinstance(tables, NovaKeyTables):
        raise TypeError(f"tables must be NovaKeyTables or a NovaHead, got {type(tables).__name__}")
    if getattr(tables.mu, "device", None) != dev:
        raise ValueError(f"tables are on {getattr(tables.mu, 'device', None)}, the queries are on {dev}")
    tables.check(dev)
    *lead, m, d = q.shape
    lead = tuple(lead)
    if d != tables.d:
        raise ValueError(f"q has d={d}, the head's tables have d={tables.d}")
    code_bits = tables.bits * tables.g
    nbytes = packed_size(tables.n_groups, code_bits)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.ndim != len(lead) + 2:
        raise ValueError(f"codes must be a tensor of shape {lead + ('N', nbytes)}")
    n = codes.shape[-2]
    _check_tensor("codes", codes, (torch.uint8,), lead + (n, nbytes), dev)
    _check_tensor("gains", gains, (torch.float32, torch.float16), lead + (n,), dev)
    m_pad, ng_pad = triton.next_power_of_2(m), triton.next_power_of_2(tables.n_groups)
    block_n = block_n or (min(1024, triton.next_power_of_2(max(n, 1))) if _interpreting()
                          else _default_block(tables.n_groups, m_pad))
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")

    programs = math.prod(lead)
    out = torch.empty(lead + (m, n), dtype=torch.float32, device=dev)
    if programs == 0 or n == 0:
        return out
    lut = torch.empty((programs, m, tables.n_groups, tables.k), dtype=torch.float32, device=dev)
    qmu = torch.empty((programs, m), dtype=torch.float32, device=dev)
    _nova_tables_kernel[(programs,)](
        q.to(torch.float32).contiguous(), tables.inverse, tables.mu, tables.groups, tables.centroids, lut, qmu,
        M=m, D=d, NG=tables.n_groups, GS=tables.g, K=tables.k, M_PAD=m_pad, D_PAD=triton.next_power_of_2(d),
        GS_PAD=triton.next_power_of_2(tables.g), num_warps=num_warps)
    _nova_scores_kernel[(programs, triton.cdiv(n, block_n))](
        codes.contiguous(), gains.contiguous(), lut, qmu, out, n, M=m, NG=tables.n_groups, K=tables.k,
        CODE_BITS=code_bits, NBYTES=nbytes, M_PAD=m_pad, NG_PAD=ng_pad, BLOCK_N=block_n, num_warps=num_warps)
    return out


def hopper_builds(d=128, m=4, g=4, bits=2, block_n=None, num_warps=4):
    """Compile both NOVA-KV kernels for sm_90 (no GPU needed) and report registers and spills.

    Returns
    -------
    tuple of gpu.triton.hopper.HopperReport
        (tables kernel, scores kernel).
    """
    from .hopper import compile_for_hopper, in_compile_process

    if _interpreting():  # this process's kernels are interpreter functions: compile in a fresh one
        return in_compile_process(__name__, "hopper_builds", d, m, g, bits, block_n, num_warps)

    n_groups, k, code_bits = d // g, 2 ** (bits * g), bits * g
    m_pad = triton.next_power_of_2(m)
    tab_sig = {"q_ptr": "*fp32", "inv_ptr": "*fp32", "mu_ptr": "*fp32", "groups_ptr": "*i32",
               "cent_ptr": "*fp32", "lut_ptr": "*fp32", "qmu_ptr": "*fp32"}
    tab_const = {"M": m, "D": d, "NG": n_groups, "GS": g, "K": k, "M_PAD": m_pad,
                 "D_PAD": triton.next_power_of_2(d), "GS_PAD": triton.next_power_of_2(g)}
    sc_sig = {"codes_ptr": "*u8", "gains_ptr": "*fp16", "lut_ptr": "*fp32", "qmu_ptr": "*fp32",
              "out_ptr": "*fp32", "N": "i32"}
    sc_const = {"M": m, "NG": n_groups, "K": k, "CODE_BITS": code_bits, "NBYTES": packed_size(n_groups, code_bits),
                "M_PAD": m_pad, "NG_PAD": triton.next_power_of_2(n_groups),
                "BLOCK_N": block_n or _default_block(n_groups, m_pad)}
    out = []
    for fn, sig, const in ((_nova_tables_kernel, tab_sig, tab_const), (_nova_scores_kernel, sc_sig, sc_const)):
        full = {**sig, **{c: "constexpr" for c in const}}
        out.append(compile_for_hopper(fn, {a: full[a] for a in fn.arg_names}, const, num_warps=num_warps,
                                      enable_fp_fusion=True))
    return tuple(out)
