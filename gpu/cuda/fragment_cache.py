"""A paged TurboQuantMSE cache in the fragment layout, and the CUDA kernels that write and read it.

``FragmentKVCache`` is the CUDA backend's counterpart of ``gpu.triton.cache.PagedKVCache``: the same
block tables, per-sequence lengths and 16-bit band, but each page holds tiles of 16 tokens in the
fragment layout (``gpu.cuda.fragment``; ``kv (num_pages, H, page_size / 16, tile_bytes)`` uint8)
that ``kvq_frag_attention.cu`` decodes straight into tensor-core fragments. ``append_fragment``
quantizes new tokens into their tiles (codes and norms bit-identical to ``TurboQuantMSE.encode``);
``fragment_decode_attention`` is split-K decode attention over it; ``write_rows``/``read_rows``
convert one sequence to and from kvq_ref's packed rows, bit for bit.

The kernels are compiled per (head_dim, key bits, value bits) on first use (nvcc for CUDA tensors;
g++ against ``host_emu.h`` for CPU tensors when ``KVQ_CUDA_HOST_EMULATION=1``) and cached like
``gpu.cuda.binding``'s library. Configurations: head_dim 64, 128, 256; 2, 3 or 4 bits; Hadamard
rotation with float16 norms; up to 8 query rows (T G) per KV head; page sizes powers of two >= 32.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import numpy as np

from kvq_ref.rotations import HadamardRotation
from kvq_ref.turboquant import TurboQuantMSE

from ..schedule import plan_splits
from ..tables import DeviceTable, TableMismatchError, load_device_table
from . import binding, fragment, lookup
from .binding import CudaUnavailableError

__all__ = ["FragmentKVCache", "append_fragment", "fragment_decode_attention", "decode_tiles", "write_rows",
           "read_rows", "fragment_library", "SOURCES", "MAX_ROWS", "WARPS"]

SOURCES = ("kvq_frag_attention.cu", "kvq_frag_append.cu")
MAX_ROWS = 8   # KVQ_FRAG_ROWS: query rows (T G) per KV head, the MMA's N
WARPS = 4      # KVQ_FRAG_WARPS
BAND_TILE = 64  # KVQ_BAND_TILE: band tokens per CTA of the band path
_DT = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}
_IN = {"torch.float16": 0, "torch.float32": 1}  # kvq_quant.cuh KVQ_IN_F16 / KVQ_IN_F32
_c_int, _c_ptr, _u32 = ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32


class _Mul(ctypes.Structure):
    _fields_ = [(n, _u32) for n in ("m17", "m17s16", "s16", "s26", "s28", "s29", "s30", "s31", "m16", "y16")]


MUL = (17, 17 << 16, 1 << 16, 1 << 26, 1 << 28, 1 << 29, 1 << 30, 1 << 31, 16, fragment.Y16)  # kvq_frag.cuh KvqMul


class _FragArgs(ctypes.Structure):
    _fields_ = [("B", _c_int), ("T", _c_int), ("H", _c_int), ("G", _c_int), ("R", _c_int), ("d", _c_int),
                ("q", _c_ptr), ("q_dtype", _c_int), ("out_dtype", _c_int), ("out", _c_ptr), ("kv", _c_ptr),
                ("block_table", _c_ptr), ("seq_lens", _c_ptr), ("page_size", _c_int), ("log_page", _c_int),
                ("bt_stride", _c_int), ("page_bytes", _u32), ("log_tpp", _u32), ("tpp_mask", _u32), ("band_k", _c_ptr), ("band_v", _c_ptr), ("band_lens", _c_ptr), ("band_dtype", _c_int),
                ("band_cap", _c_int), ("kpool", _u32 * 4), ("vpool", _u32 * 4), ("mul", _Mul), ("ksigma", ctypes.c_float), ("kperm", _c_ptr),
                ("ksigns", _c_ptr), ("vinv_perm", _c_ptr), ("vsigns", _c_ptr), ("khblock", _c_int),
                ("vhblock", _c_int), ("sm_scale", ctypes.c_float), ("splits", _c_int), ("chunk", _c_int),
                ("ws", _c_ptr), ("dependent_launch", _c_int), ("band_ctas", _c_int)]


class _Quant(ctypes.Structure):
    _fields_ = [("thresholds", _c_ptr), ("levels", _c_ptr), ("signs1", _c_ptr), ("signs2", _c_ptr),
                ("perm", _c_ptr), ("hblock", _c_int), ("norm_correction", _c_int)]


class _AppendArgs(ctypes.Structure):
    _fields_ = [("k", _c_ptr), ("v", _c_ptr), ("in_dtype", _c_int), ("B", _c_int), ("T", _c_int), ("H", _c_int),
                ("kv", _c_ptr), ("block_table", _c_ptr), ("seq_lens", _c_ptr), ("page_size", _c_int),
                ("bt_stride", _c_int), ("kq", _Quant), ("vq", _Quant)]


# ---- libraries ----------------------------------------------------------------------------------------
_libs: dict = {}
_lock = threading.Lock()


def _defines(d: int, kb: int, vb: int) -> tuple:
    return (f"-DKVQ_FRAG_D={d}", f"-DKVQ_FRAG_KB={kb}", f"-DKVQ_FRAG_VB={vb}")


def fragment_library(backend: str, d: int, kb: int, vb: int) -> ctypes.CDLL:
    """The compiled kernels of one configuration: ``backend`` "cuda" (nvcc, the current GPU) or "host"."""
    key = (backend, d, kb, vb)
    with _lock:
        if key not in _libs:
            tag = f"kvq_frag_d{d}_k{kb}v{vb}"
            if backend == "cuda":
                path = binding.build_library(None, SOURCES, _defines(d, kb, vb), tag)
            else:
                path = binding.build_host_emulation(SOURCES, _defines(d, kb, vb), tag + "_host_emu")
            lib = ctypes.CDLL(str(path))
            for name in ("kvq_frag_attention", "kvq_frag_append"):
                getattr(lib, name).argtypes = [_c_ptr, _c_ptr]
                getattr(lib, name).restype = _c_int
            lib.kvq_frag_decode_tiles.argtypes = [_c_ptr, _c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr]
            lib.kvq_frag_error_string.argtypes = [_c_int]
            lib.kvq_frag_error_string.restype = ctypes.c_char_p
            if (lib.kvq_frag_args_size() != ctypes.sizeof(_FragArgs)
                    or lib.kvq_frag_append_args_size() != ctypes.sizeof(_AppendArgs)):
                raise RuntimeError("FragArgs/FragAppendArgs differ between kvq_frag_*.cu and gpu.cuda.fragment_cache")
            if tuple(lib.kvq_frag_config(i) for i in range(3)) != (d, kb, vb):
                raise RuntimeError(f"library {path} is not the ({d}, {kb}, {vb}) configuration")
            _libs[key] = lib
        return _libs[key]


_current: dict = {}  # library -> the device its runtime was last pointed at


def _call(lib, backend, device, name, *args):
    import torch

    stream = None
    if backend == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _current.get(id(lib)) != index:  # once per device change: not inside every captured call
            rc = lib.kvq_frag_set_device(index)
            if rc:
                raise CudaUnavailableError(f"cudaSetDevice failed: {lib.kvq_frag_error_string(rc).decode()}")
            _current[id(lib)] = index
        stream = torch.cuda.current_stream(device).cuda_stream
    rc = getattr(lib, name)(*args, stream)
    if rc:
        raise RuntimeError(f"{name} failed: {lib.kvq_frag_error_string(rc).decode()}")


# ---- the cache --------------------------------------------------------------------------------------
def _check_method(name, m):
    if not isinstance(m, TurboQuantMSE) or m.rotation != "hadamard" or m.norm_dtype != "float16":
        raise ValueError(f"{name} must be a Hadamard TurboQuantMSE with float16 norms")
    fragment.check_config(m.dim, m.bits)


@dataclass(frozen=True)
class FragmentKVCache:
    """Device tensors of a paged cache in the fragment layout (module docstring); mutable state.

    Attributes
    ----------
    kv : torch.Tensor, uint8, (num_pages, H, page_size / 16, tile_bytes)
    block_table : int32 (B, pages_per_seq); seq_lens : int32 (B,)
    band_k, band_v : float16/bfloat16 (B, H, C, d); band_lens : int32 (B,) valid band slots (any order)
    """

    key_method: TurboQuantMSE
    value_method: TurboQuantMSE
    kv: object
    block_table: object
    seq_lens: object
    band_k: object
    band_v: object
    band_lens: object

    @property
    def d(self) -> int:
        return self.key_method.dim

    @property
    def page_size(self) -> int:
        return 16 * self.kv.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.kv.shape[1]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @classmethod
    def allocate(cls, key_method, value_method, batch, kv_heads, num_pages, page_size, pages_per_seq,
                 band_capacity=0, band_dtype=None, device="cpu"):
        """Zeroed cache; ``block_table[b] = b * pages_per_seq + arange(pages_per_seq)`` (mod num_pages).

        Parameters
        ----------
        page_size : int
            Tokens per page, a power of two >= 32 (tiles of 16 never cross pages, nor do a warp's pairs of
            tiles; the kernel finds a tile's page with a shift).
        band_dtype : torch.float16 (default) or torch.bfloat16
        """
        import torch

        _check_method("key_method", key_method)
        _check_method("value_method", value_method)
        if key_method.dim != value_method.dim:
            raise ValueError(f"key and value dims differ: {key_method.dim} != {value_method.dim}")
        for name, v in (("batch", batch), ("kv_heads", kv_heads), ("num_pages", num_pages),
                        ("pages_per_seq", pages_per_seq)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 32 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 32, got {page_size!r}")
        if isinstance(band_capacity, bool) or not isinstance(band_capacity, int) or band_capacity < 0:
            raise ValueError(f"band_capacity must be a non-negative int, got {band_capacity!r}")
        band_dtype = torch.float16 if band_dtype is None else band_dtype
        if band_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"band_dtype must be torch.float16 or torch.bfloat16, got {band_dtype}")
        d = key_method.dim
        tb = fragment.tile_bytes(d, key_method.bits, value_method.bits)
        kv = torch.zeros((num_pages, kv_heads, page_size // 16, tb), dtype=torch.uint8, device=device)
        table = (torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device) % num_pages).reshape(batch, -1)
        zeros = torch.zeros(batch, dtype=torch.int32, device=device)
        cap = max(band_capacity, 1)
        band = [torch.zeros((batch, kv_heads, cap, d), dtype=band_dtype, device=device) for _ in range(2)]
        return cls(key_method, value_method, kv, table, zeros.clone(), band[0], band[1], zeros.clone())


def _backend(device) -> str:
    return binding._backend(device)


def _tables(cache, ktable, vtable, device):
    km, vm = cache.key_method, cache.value_method
    out = []
    for name, tab, m in (("ktable", ktable, km), ("vtable", vtable, vm)):
        if tab is None:
            tab = load_device_table(m.dim, m.bits)
        if not isinstance(tab, DeviceTable):
            raise TypeError(f"{name} must be a gpu.tables.DeviceTable, got {type(tab).__name__}")
        if tab.bits != m.bits or tab.dim != m.dim:
            raise TableMismatchError(f"{name} is for dim={tab.dim}, bits={tab.bits}; the cache needs dim={m.dim}, "
                                     f"bits={m.bits}")
        out.append(tab)
    return out


_rot_cache: dict = {}


def _rotation(m: TurboQuantMSE, device):
    """signs (2, d) float32, perm and inv_perm int32 of the method's rotation, on ``device``."""
    import torch

    key = (m.dim, m.seed, str(device))
    if key not in _rot_cache:
        rot = HadamardRotation(m.dim, m.seed)
        _rot_cache[key] = {"signs": torch.tensor(np.stack([rot.signs1, rot.signs2]), dtype=torch.float32, device=device),
                           "perm": torch.tensor(rot.perm, dtype=torch.int32, device=device),
                           "inv_perm": torch.tensor(rot.inv_perm, dtype=torch.int32, device=device),
                           "block": int(rot.block)}
    return _rot_cache[key]


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


def _pools(table: DeviceTable, bits: int, side: str = "v"):
    return (_u32 * 4)(*[int(x) for x in lookup.pools(table.codebook.levels, bits, fragment.is_int8(side, bits))])


def _ksigma(table: DeviceTable, bits: int) -> float:
    return float(lookup.int8_levels(table.codebook.levels)[1]) if fragment.is_int8("k", bits) else 1.0


def append_fragment(cache: FragmentKVCache, k, v, ktable=None, vtable=None):
    """Quantize ``k, v (B, T, H, d)`` (float16/float32) into tiles at slots ``seq_lens[b] ..`` (the block
    table must own those pages), then ``seq_lens += T``. Codes and norms are bit-identical to
    ``TurboQuantMSE.encode`` (checked by ``read_rows`` in the tests)."""
    import torch

    if not isinstance(cache, FragmentKVCache):
        raise TypeError(f"cache must be a FragmentKVCache, got {type(cache).__name__}")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or str(x.dtype) not in _IN:
            raise TypeError(f"{name} must be a float16 or float32 torch.Tensor")
        if x.ndim != 4 or x.shape[0] != cache.batch or x.shape[2] != cache.kv_heads or x.shape[3] != cache.d:
            raise ValueError(f"{name} must have shape ({cache.batch}, T, {cache.kv_heads}, {cache.d}), got "
                             f"{tuple(x.shape)}")
        if x.device != cache.kv.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {cache.kv.device}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError("k and v must have the same shape and dtype")
    B, T, H, d = k.shape
    if T == 0:
        return cache
    ktab, vtab = _tables(cache, ktable, vtable, k.device)
    backend = _backend(k.device)
    km, vm = cache.key_method, cache.value_method
    lib = fragment_library(backend, d, km.bits, vm.bits)
    k, v = k.contiguous(), v.contiguous()
    keep = []

    def quant(m, tab):
        rot = binding._rotation(("mse", m.dim, m.seed), m.rot, k.device)
        t64 = [tab.levels.to(k.device), tab.thresholds.to(k.device)]
        keep.extend(t64)
        return _Quant(_ptr(t64[1]), _ptr(t64[0]), _ptr(rot["signs1"]), _ptr(rot["signs2"]), _ptr(rot["perm"]),
                      rot["block"], int(m.norm_correction))
    args = _AppendArgs(_ptr(k), _ptr(v), _IN[str(k.dtype)], B, T, H, _ptr(cache.kv), _ptr(cache.block_table),
                       _ptr(cache.seq_lens), cache.page_size, cache.block_table.stride(0), quant(km, ktab),
                       quant(vm, vtab))
    _call(lib, backend, k.device, "kvq_frag_append", ctypes.byref(args))
    cache.seq_lens.add_(T)
    return cache


def fragment_decode_attention(q, cache: FragmentKVCache, ktable=None, vtable=None, *, scale=None, max_seq_len=None,
                              splits=None, workspace=None, dependent_launch=True):
    """Attention of ``q (B, T, H, G, d)`` (T G <= 8; every query sees every cached token) over the cache.

    Parameters
    ----------
    q : torch.Tensor, float32/float16/bfloat16
    scale : float, optional
        Logit scale (default 1/sqrt(d)).
    max_seq_len : int, optional
        Bound on ``seq_lens`` for the split plan (default: the block table's capacity).
    splits : int, optional
        Force the split count (``gpu.schedule.plan_splits``).
    workspace : torch.Tensor, float32, optional
        ``B H (S + NB) 8 (d + 2)`` floats or more (NB = ceil(band capacity / 64)), kept across calls
        (CUDA graphs).
    dependent_launch : bool, default True
        Launch the merge kernel as a programmatic dependent of the split kernel (Hopper; elsewhere the
        runtime launches it plainly), so that its launch overlaps the split kernel. The result is the
        same either way; ``False`` is the plain stream-ordered launch, for comparison.

    Returns
    -------
    torch.Tensor, q's dtype, shape of q; a query that sees no token gets 0.
    """
    import torch

    if not isinstance(cache, FragmentKVCache):
        raise TypeError(f"cache must be a FragmentKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or str(q.dtype) not in _DT:
        raise TypeError("q must be a float32/float16/bfloat16 torch.Tensor")
    B, H, d = cache.batch, cache.kv_heads, cache.d
    if q.ndim != 5 or q.shape[0] != B or q.shape[2] != H or q.shape[4] != d or q.shape[1] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must have shape ({B}, T, {H}, G, {d}), got {tuple(q.shape)}")
    T, G = q.shape[1], q.shape[3]
    if T * G > MAX_ROWS:
        raise ValueError(f"T * G must be <= {MAX_ROWS} query rows per KV head, got {T * G}")
    if q.device != cache.kv.device:
        raise ValueError(f"q is on {q.device}, the cache on {cache.kv.device}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    cap = cache.block_table.shape[1] * cache.page_size
    max_seq_len = cap if max_seq_len is None else int(max_seq_len)
    if not 0 <= max_seq_len <= cap:
        raise ValueError(f"max_seq_len must be in 0..{cap}, got {max_seq_len}")
    if not isinstance(dependent_launch, bool):
        raise TypeError(f"dependent_launch must be a bool, got {type(dependent_launch).__name__}")
    km, vm = cache.key_method, cache.value_method
    ktab, vtab = _tables(cache, ktable, vtable, q.device)
    backend = _backend(q.device)
    lib = fragment_library(backend, d, km.bits, vm.bits)
    u = 1 if 4 in (km.bits, vm.bits) else 2
    plan = plan_splits(B, H, max_seq_len, 16 * WARPS * u, splits=splits)
    band_ctas = -(-cache.band_k.shape[2] // BAND_TILE)  # one CTA per 64 band slots (KVQ_BAND_TILE)
    size = B * H * (plan.splits + band_ctas) * MAX_ROWS * (d + 2)
    if workspace is None or workspace.numel() < size:
        workspace = torch.empty(max(size, 1), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kr, vr = _rotation(km, q.device), _rotation(vm, q.device)
    args = _FragArgs(B, T, H, G, T * G, d, _ptr(q), _DT[str(q.dtype)], _DT[str(q.dtype)], _ptr(out), _ptr(cache.kv),
                     _ptr(cache.block_table), _ptr(cache.seq_lens), cache.page_size, cache.page_size.bit_length() - 1,
                     cache.block_table.stride(0), H * cache.kv.shape[2] * cache.kv.shape[3],
                     cache.page_size.bit_length() - 5, cache.kv.shape[2] - 1, _ptr(cache.band_k), _ptr(cache.band_v), _ptr(cache.band_lens), _DT[str(cache.band_k.dtype)],
                     cache.band_k.shape[2], _pools(ktab, km.bits, "k"), _pools(vtab, vm.bits), _Mul(*MUL), _ksigma(ktab, km.bits),
                     _ptr(kr["perm"]), _ptr(kr["signs"]), _ptr(vr["inv_perm"]), _ptr(vr["signs"]), kr["block"],
                     vr["block"], scale, plan.splits, plan.chunk, _ptr(workspace), int(dependent_launch), band_ctas)
    _call(lib, backend, q.device, "kvq_frag_attention", ctypes.byref(args))
    return out


def decode_tiles(tiles, d: int, kbits: int, vbits: int, ktable=None, vtable=None):
    """The kernel's loads and lookups on ``tiles (n, tile_bytes)`` uint8: the fp16 pairs every lane
    decodes, ``(n, 32, d / 4)`` int32 (the uint32 bits) for K and for V (for checking against ``fragment.decode_words``)."""
    import torch

    backend = _backend(tiles.device)
    lib = fragment_library(backend, d, kbits, vbits)
    ktab = ktable or load_device_table(d, kbits)
    vtab = vtable or load_device_table(d, vbits)
    n = tiles.shape[0]
    out = [torch.zeros((n, 32, d // 4), dtype=torch.int32, device=tiles.device) for _ in range(2)]
    args = _FragArgs()
    args.kpool, args.vpool, args.mul = _pools(ktab, kbits, "k"), _pools(vtab, vbits), _Mul(*MUL)
    _call(lib, backend, tiles.device, "kvq_frag_decode_tiles", _ptr(tiles.contiguous()), n, ctypes.byref(args),
          _ptr(out[0]), _ptr(out[1]))
    return out[0], out[1]


# ---- interchange with kvq_ref's rows ------------------------------------------------------------------
def _seq_tiles(cache, b: int, n: int):
    """(page, tile-in-page) of the tiles of sequence b's first n tokens."""
    tiles = -(-n // 16)
    per_page = cache.page_size // 16
    pages = cache.block_table[b].cpu().numpy()
    idx = np.arange(tiles)
    return pages[idx // per_page], idx % per_page


def write_rows(cache: FragmentKVCache, b: int, h: int, k_rows, k_norms, v_rows, v_norms) -> None:
    """Store kvq_ref's packed rows and float16 norms of ``n`` tokens as sequence b, KV head h's tokens 0..n-1
    (host-side conversion, ``fragment.pack_tiles``); sets ``seq_lens[b] = n``."""
    km, vm = cache.key_method, cache.value_method
    tiles = fragment.pack_tiles(k_rows, k_norms, v_rows, v_norms, cache.d, km.bits, vm.bits)
    n = np.asarray(k_norms).shape[0]
    if -(-n // cache.page_size) > cache.block_table.shape[1]:
        raise ValueError(f"{n} tokens do not fit the block table's {cache.block_table.shape[1]} pages")
    import torch

    pages, tip = _seq_tiles(cache, b, n)
    t = torch.from_numpy(tiles).to(cache.kv.device)
    cache.kv[torch.as_tensor(pages, dtype=torch.long), h, torch.as_tensor(tip, dtype=torch.long)] = t
    cache.seq_lens[b] = n


def read_rows(cache: FragmentKVCache, b: int, h: int):
    """kvq_ref's (k_rows, k_norms, v_rows, v_norms) of sequence b, KV head h, bit for bit (``unpack_tiles``)."""
    import torch

    n = int(cache.seq_lens[b])
    pages, tip = _seq_tiles(cache, b, n)
    tiles = cache.kv[torch.as_tensor(pages, dtype=torch.long), h, torch.as_tensor(tip, dtype=torch.long)]
    km, vm = cache.key_method, cache.value_method
    return fragment.unpack_tiles(tiles.cpu().numpy(), n, cache.d, km.bits, vm.bits)
