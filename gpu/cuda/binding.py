"""Thin ctypes binding of the CUDA kernels in ``gpu/cuda`` (quantize-and-pack, decode attention).

The ``.cu`` files are plain CUDA C++ with ``extern "C"`` launch functions taking raw device
pointers. On first use they are compiled with nvcc into one shared library for the GPU's
architecture and cached under ``$KVQ_CACHE_DIR/cuda`` (default ``~/.cache/kvq-toolkit/cuda``),
keyed by a hash of the sources, the flags and the compiler version; the launch functions are then
called through ctypes with torch CUDA tensors' ``data_ptr()`` on torch's current stream. Without a
GPU (or without nvcc) the wrappers raise ``CudaUnavailableError``. With
``KVQ_CUDA_HOST_EMULATION=1`` they accept CPU tensors instead and run the very same sources
compiled by a host C++ compiler against ``host_emu.h`` (each CUDA block run by CPU threads): slow,
for tests on machines without a GPU.

Every wrapper validates its inputs (types, dtypes, shapes, devices, table bits and dimension
against the quantizer) and raises one ``TypeError``/``ValueError`` (``gpu.tables.
TableMismatchError`` for tables) before anything is compiled or launched.

Bit-exactness contract. ``quantize_mse`` and ``quantize_turbo_block`` compute in float64 from the
stored input dtype (float16 or float32), with explicitly rounded double operations in the order of
kvq_ref (``kvq_ref.turboquant.quantize_rotated``, the rule TurboQuantMSE and TurboBlock share): the
norm is the sequential sum of squares of ``kvq_ref.common.row_norm``; then ``x * (1/||x||)`` (the
reciprocal times x, not a division), the signs, the permutation, the butterflies ``(a + b, a - b)``
stage by stage, the ``1/sqrt(b)`` scale and the second signs; codes count the float64 thresholds
strictly below each coordinate; the norm-corrected scale ``||x|| / ||levels[codes]||`` sums the
squared levels sequentially too; the scale is rounded once to float16. Squares of float16 and float32 values are exact
in float64 and the summation order is the reference's, so codes, packed bytes and norms are
bit-identical to kvq_ref for float16 and float32 inputs alike. ``decode_attention`` works in
float32 (float32 levels, float16 norms and band rows; float16/bfloat16 queries are widened exactly
and the output rounded once to their dtype) and matches ``kvq_ref.attention.attention_decode`` to
float32 rounding (tolerances in ``tests/gpu/test_cuda.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kvq_ref.packing import packed_size
from kvq_ref.turbo_block import FORMATS, TurboBlock
from kvq_ref.turboquant import TurboQuantMSE

from ..schedule import plan_splits
from ..tables import DeviceTable, TableMismatchError, check_device_table, load_device_table

__all__ = ["CudaUnavailableError", "KernelResources", "SOURCES", "MAX_DIM", "MAX_BITS", "cache_dir", "find_nvcc",
           "ptxas_report", "format_report", "build_library", "build_host_emulation", "quantize_mse",
           "quantize_turbo_block", "decode_attention"]

CUDA_DIR = Path(__file__).resolve().parent
SOURCES = ("kvq_quantize.cu", "kvq_decode_attention.cu")
TILE = 64        # KVQ_TILE of kvq_decode_attention.cu: tokens per staged tile (splits are multiples)
MAX_GROUP = 16   # KVQ_MAX_GROUP: query rows per KV group
HEADERS = ("kvq_common.cuh", "kvq_quant.cuh", "kvq_frag.cuh", "kvq_frag_parts.cuh", "host_emu.h")
MAX_DIM = 256   # KVQ_MAX_DIM in kvq_common.cuh
MAX_BITS = 4    # KVQ_MAX_BITS
HOST_EMULATION_ENV = "KVQ_CUDA_HOST_EMULATION"
_IN_DTYPE = {"torch.float16": 0, "torch.float32": 1}   # KVQ_IN_F16, KVQ_IN_F32
_EINVAL = -1


class CudaUnavailableError(RuntimeError):
    """No GPU, no nvcc (or host compiler for the emulation), or the build failed."""


# ---- compilers and the cache --------------------------------------------------------------------
def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$KVQ_CACHE_DIR/cuda`` or ``~/.cache/kvq-toolkit/cuda``."""
    root = os.environ.get("KVQ_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "kvq-toolkit") / "cuda"


def find_nvcc() -> str | None:
    """Path of nvcc: on PATH, else ``$CUDA_HOME/bin``, else ``/usr/local/cuda/bin``; None if absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _run(cmd, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=CUDA_DIR)
    if proc.returncode != 0:
        raise CudaUnavailableError(f"{what} failed ({' '.join(map(str, cmd))}):\n{proc.stderr.strip()}")
    return proc


def _cached_build(tag: str, compiler: str, flags: list[str], sources=SOURCES) -> Path:
    """Compile ``sources`` into ``lib<tag>_<hash>.so`` unless a library of that hash is cached."""
    version = _run([compiler, "--version"], f"{compiler} --version").stdout
    digest = hashlib.sha256()
    for chunk in [compiler, version, *flags] + [(CUDA_DIR / f).read_text() for f in tuple(sources) + HEADERS]:
        digest.update(chunk.encode() + b"\0")
    out = cache_dir() / f"lib{tag}_{digest.hexdigest()[:20]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            _run([compiler, *flags, "-o", tmp, *sources], f"building {tag}")
            os.replace(tmp, out)  # atomic: concurrent builders never see a partial library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def gpu_arch() -> str:
    """``sm_<major><minor>`` of the current GPU (CudaUnavailableError without one)."""
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailableError("no CUDA GPU (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def build_library(arch: str | None = None, sources=SOURCES, defines: tuple = (), tag: str = "kvq_cuda") -> Path:
    """The nvcc-built shared library of ``sources`` for ``arch`` (default: the current GPU's, e.g. ``sm_90``)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaUnavailableError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
                                   "the CUDA kernels are compiled on first use")
    arch = arch or gpu_arch()
    return _cached_build(f"{tag}_{arch}", nvcc, ["-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler",
                                                 "-fPIC", *defines], sources)


def build_host_emulation(sources=SOURCES, defines: tuple = (), tag: str = "kvq_host_emu") -> Path:
    """The same sources built for the CPU against ``host_emu.h`` (needs g++ >= 12 for _Float16)."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise CudaUnavailableError("no host C++ compiler (g++ or $CXX) for the CUDA host emulation")
    # -fno-ipa-icf: g++ 12.2 -O2 folded two template instances of the fragment append kernel's helpers
    # that differ (identical code folding), so a 4-bit lane wrote all its words to one address when a
    # 2-bit one was instantiated beside it (tests/gpu/test_cuda_fragment.py's append round trip)
    return _cached_build(tag, cxx, ["-std=c++20", "-O2", "-fno-ipa-icf", "-ffp-contract=off", "-fPIC", "-shared",
                                    "-pthread", "-x", "c++", "-include", "host_emu.h", "-I", ".", *defines], sources)


# ---- compile check: ptxas registers and spills --------------------------------------------------
@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel."""

    source: str
    kernel: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    smem_bytes: int
    barriers: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def _field(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else 0


def ptxas_report(arch: str = "sm_90", sources=SOURCES) -> list[KernelResources]:
    """Compile-check every source with ``nvcc -arch=<arch> -cubin -Xptxas -v -o /dev/null``.

    Returns
    -------
    list of KernelResources
        One per kernel (entry function), parsed from ptxas' verbose output.

    Raises
    ------
    CudaUnavailableError
        nvcc is absent, or a source does not compile (the message holds the compiler output).
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaUnavailableError("nvcc not found: cannot compile-check the CUDA sources")
    out = []
    for src in sources:
        log = _run([nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", os.devnull, src],
                   f"compiling {src}").stderr
        # one section per entry function: "Compiling entry function 'name' for 'sm_90'" ... "Used N registers"
        parts = re.split(r"Compiling entry function '([^']+)' for '([^']+)'", log)
        for name, target, body in zip(parts[1::3], parts[2::3], parts[3::3]):
            out.append(KernelResources(
                src, name, target, _field(r"Used (\d+) registers", body), _field(r"(\d+) bytes spill stores", body),
                _field(r"(\d+) bytes spill loads", body), _field(r"(\d+) bytes stack frame", body),
                _field(r"(\d+) bytes smem", body), _field(r"used (\d+) barriers", body)))
    return out


def format_report(report: list[KernelResources]) -> str:
    """A table of the ptxas report, one kernel per line."""
    lines = [f"{'source':26} {'kernel':30} {'arch':6} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}"]
    for r in report:
        lines.append(f"{r.source:26} {r.kernel:30} {r.arch:6} {r.registers:4d} "
                     f"{f'{r.spill_stores}/{r.spill_loads}':>11} {r.stack_frame:5d} {r.smem_bytes:6d}")
    return "\n".join(lines)


# ---- loading ------------------------------------------------------------------------------------
_P, _I, _LL, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
_SIGNATURES = {
    "kvq_quantize_mse": [_P, _I, _LL, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P],
    "kvq_quantize_turbo": [_P, _I, _LL, _I, _I, _P, _P, _P, _P, _P, _P],
    "kvq_decode_attention": [_LL, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _I,
                             _F, _I, _I, _P, _P, _P],
    "kvq_turbo_block_bytes_of": [_I, _I],
    "kvq_cuda_set_device": [_I],
}
_libs: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def _library(backend: str) -> ctypes.CDLL:
    with _lock:
        if backend not in _libs:
            lib = ctypes.CDLL(str(build_library() if backend == "cuda" else build_host_emulation()))
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = ctypes.c_int
            lib.kvq_cuda_error_string.argtypes = [_I]
            lib.kvq_cuda_error_string.restype = ctypes.c_char_p
            _libs[backend] = lib
        return _libs[backend]


def _backend(device) -> str:
    """'cuda' for CUDA tensors; 'host' for CPU tensors when KVQ_CUDA_HOST_EMULATION=1."""
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu" and os.environ.get(HOST_EMULATION_ENV) == "1":
        return "host"
    import torch

    why = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else f"tensors are on {device}"
    raise CudaUnavailableError(f"the CUDA kernels need CUDA tensors ({why}); set {HOST_EMULATION_ENV}=1 to run "
                               "their source on CPU tensors through the host emulation (slow, for tests)")


def _launch(backend: str, device, name: str, *args) -> None:
    import torch

    lib = _library(backend)
    stream = None
    if backend == "cuda":
        rc = lib.kvq_cuda_set_device(device.index if device.index is not None else torch.cuda.current_device())
        if rc != 0:
            raise CudaUnavailableError(f"cudaSetDevice failed: {lib.kvq_cuda_error_string(rc).decode()}")
        stream = torch.cuda.current_stream(device).cuda_stream
    rc = getattr(lib, name)(*args, stream)
    if rc != 0:
        raise RuntimeError(f"{name} failed: {lib.kvq_cuda_error_string(rc).decode()}")


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


# ---- validation helpers -------------------------------------------------------------------------
def _tensor(name, t, dtypes, device=None):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if str(t.dtype) not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    return t.contiguous()


def _shape(name, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _finite(name, t):
    import torch

    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def _check_mse(name, q) -> None:
    if not isinstance(q, TurboQuantMSE):
        raise TypeError(f"{name} must be a kvq_ref TurboQuantMSE, got {type(q).__name__}")
    if q.rotation != "hadamard" or q.norm_dtype != "float16":
        raise ValueError(f"{name}: the kernels implement rotation='hadamard' with float16 norms, got "
                         f"rotation={q.rotation!r}, norm_dtype={q.norm_dtype!r}")
    if not 1 <= q.bits <= MAX_BITS or q.dim > MAX_DIM:
        raise ValueError(f"{name}: the kernels take bits 1..{MAX_BITS} and dim <= {MAX_DIM}, got bits={q.bits}, "
                         f"dim={q.dim}")


_table_cache: dict = {}


def _table(table, dim: int, bits: int, device) -> DeviceTable:
    """The table for (dim, bits) on ``device``: the given one after checks, or the shipped one."""
    if table is None:
        key = (dim, bits, str(device))
        if key not in _table_cache:
            _table_cache[key] = load_device_table(dim, bits, device=device)
        return _table_cache[key]
    if not isinstance(table, DeviceTable):
        raise TypeError(f"table must be a gpu.tables.DeviceTable, got {type(table).__name__}")
    cb_bits, cb_dim = getattr(table.codebook, "bits", None), getattr(getattr(table.codebook, "density", None), "d", None)
    if cb_bits != bits or cb_dim != dim:
        raise TableMismatchError(f"table {getattr(table.codebook, 'name', table.codebook)!r} is for dim={cb_dim}, "
                                 f"bits={cb_bits}; the quantizer needs dim={dim}, bits={bits}")
    check_device_table(table, dim, bits)  # types, sizes, contiguity and values: what the kernels index
    if table.levels.device != device:
        raise TableMismatchError(f"table is on {table.levels.device}, the inputs on {device}")
    return table


_rot_cache: dict = {}


def _rotation(key, rot, device) -> dict:
    """A HadamardRotation's arrays on ``device``: signs (float32 +-1), perm/inv_perm (int32), block."""
    import torch

    full = (key, str(device))
    if full not in _rot_cache:
        _rot_cache[full] = {
            "signs1": torch.tensor(rot.signs1, dtype=torch.float32, device=device),
            "signs2": torch.tensor(rot.signs2, dtype=torch.float32, device=device),
            "perm": torch.tensor(rot.perm, dtype=torch.int32, device=device),
            "inv_perm": torch.tensor(rot.inv_perm, dtype=torch.int32, device=device),
            "block": int(rot.block),
            "matrix": torch.tensor(rot.matrix(), dtype=torch.float64, device=device),
        }
    return _rot_cache[full]


def _input(x, dim: int):
    x = _tensor("x", x, tuple(_IN_DTYPE))
    if x.ndim < 1 or x.shape[-1] != dim:
        raise ValueError(f"x must have last dimension {dim}, got shape {tuple(x.shape)}")
    _finite("x", x)
    return x


# ---- the kernels --------------------------------------------------------------------------------
def quantize_mse(x, quantizer: TurboQuantMSE, table: DeviceTable | None = None):
    """``quantizer.encode(x)`` on the device: packed codes and float16 norms, bit-exact.

    Parameters
    ----------
    x : torch.Tensor, float16 or float32, shape (..., d)
    quantizer : kvq_ref.turboquant.TurboQuantMSE
        Hadamard rotation, float16 norms, bits 1..4, d <= 256 (its seed and norm_correction apply).
    table : gpu.tables.DeviceTable, optional
        Default: the shipped SphereMarginal(d) table at ``quantizer.bits``.

    Returns
    -------
    codes : torch.Tensor, uint8, shape (..., ceil(d * bits / 8))
    norms : torch.Tensor, float16, shape (...)

    Raises
    ------
    TypeError, ValueError, TableMismatchError
        Invalid inputs, found before launch; ValueError also when a norm overflows float16.
    CudaUnavailableError
        No GPU/nvcc (or, for CPU tensors, host emulation not enabled).
    """
    import torch

    _check_mse("quantizer", quantizer)
    d, bits = quantizer.dim, quantizer.bits
    x = _input(x, d)
    tab = _table(table, d, bits, x.device)
    backend = _backend(x.device)
    lead = tuple(x.shape[:-1])
    n = math.prod(lead)
    codes = torch.empty((n, packed_size(d, bits)), dtype=torch.uint8, device=x.device)
    norms = torch.empty((n,), dtype=torch.float16, device=x.device)
    if n:
        rot = _rotation(("mse", d, quantizer.seed), quantizer.rot, x.device)
        _launch(backend, x.device, "kvq_quantize_mse", _ptr(x), _IN_DTYPE[str(x.dtype)], n, d, bits,
                _ptr(tab.thresholds), _ptr(tab.levels), _ptr(rot["signs1"]), _ptr(rot["signs2"]), _ptr(rot["perm"]),
                rot["block"], int(quantizer.norm_correction), _ptr(codes), _ptr(norms))
        if bool(torch.isinf(norms).any()):
            raise ValueError("norms overflow float16 (max 65504); store them in float32")
    return codes.reshape(lead + (codes.shape[1],)), norms.reshape(lead)


def quantize_turbo_block(x, quantizer: TurboBlock, table: DeviceTable | None = None):
    """``quantizer.encode(x).arrays['blocks']`` on the device: turbo2/3/4 blocks, bit-exact.

    Parameters
    ----------
    x : torch.Tensor, float16 or float32, shape (..., block)
    quantizer : kvq_ref.turbo_block.TurboBlock
        Profile ``"kvq"``: format, block size (32 or 128) and the seed of its two sign vectors.
    table : gpu.tables.DeviceTable, optional
        Default: the shipped SphereMarginal(block) table at the format's bits.

    Returns
    -------
    torch.Tensor, uint8, shape (..., quantizer.bytes_per_block)
    """
    import torch

    if not isinstance(quantizer, TurboBlock):
        raise TypeError(f"quantizer must be a kvq_ref TurboBlock, got {type(quantizer).__name__}")
    if quantizer.spec.arithmetic != "float64" or quantizer.spec.tables is not None:
        raise ValueError(f"the kernels implement TurboBlock profile 'kvq' (float64 rule, Lloyd-Max tables), "
                         f"not profile {quantizer.spec.name!r}")
    d, bits = quantizer.block, FORMATS[quantizer.fmt]
    x = _input(x, d)
    tab = _table(table, d, bits, x.device)
    backend = _backend(x.device)
    lead = tuple(x.shape[:-1])
    n = math.prod(lead)
    blocks = torch.empty((n, quantizer.bytes_per_block), dtype=torch.uint8, device=x.device)
    if n:
        lib = _library(backend)
        if lib.kvq_turbo_block_bytes_of(d, bits) != quantizer.bytes_per_block:
            raise RuntimeError(f"kernel and kvq_ref disagree on the {quantizer.fmt} block size")
        rot = _rotation(("turbo", d, quantizer.seed), quantizer.rot, x.device)
        _launch(backend, x.device, "kvq_quantize_turbo", _ptr(x), _IN_DTYPE[str(x.dtype)], n, d, bits,
                _ptr(tab.thresholds), _ptr(tab.levels), _ptr(rot["signs1"]), _ptr(rot["signs2"]), _ptr(blocks))
        if bool(torch.isinf(blocks[:, :2].contiguous().view(torch.float16)).any()):
            raise ValueError("block norms overflow float16 (max 65504)")
    return blocks.reshape(lead + (quantizer.bytes_per_block,))


def decode_attention(q, k_codes, k_norms, v_codes, v_norms, key_method: TurboQuantMSE, value_method: TurboQuantMSE,
                     *, band_k=None, band_v=None, scale: float | None = None, k_table: DeviceTable | None = None,
                     v_table: DeviceTable | None = None, splits: int | None = None):
    """One decode step over TurboQuantMSE-coded keys/values plus an optional float16 band.

    Split over the sequence like the Triton kernels (``gpu.schedule.plan_splits`` over the G groups,
    tiles of 64 tokens): one block per (group, split) reads each K/V tile once for the group's h
    query rows, a merge kernel combines the splits by log-sum-exp and inverts the value rotation once.

    ``kvq_ref.attention.attention_decode`` for a ``QuantizedKV`` whose middle tokens are coded by
    ``key_method``/``value_method``, per KV group g. The query is rotated here with the key
    method's rotation (float64, then float32); the kernel inverts the value rotation itself.

    Parameters
    ----------
    q : torch.Tensor, float16, bfloat16 or float32, shape (G, h, d) or (h, d)
        Queries (original domain), h per KV group (a GQA group); without G, the caches have no G axis.
        The kernels work in float32: a 16-bit q is widened exactly here, and the output is rounded
        once to q's dtype (round to nearest even) after the float32 result.
    k_codes, v_codes : torch.Tensor, uint8, shape (G, n_mid, ceil(d * bits / 8))
    k_norms, v_norms : torch.Tensor, float16, shape (G, n_mid)
    key_method, value_method : kvq_ref.turboquant.TurboQuantMSE
        What encoded the keys and the values (Hadamard rotation, bits 1..4, dim d).
    band_k, band_v : torch.Tensor, float16, shape (G, n_band, d), optional
        The 16-bit band tokens (both or neither).
    scale : float, optional
        Logit scale (default 1/sqrt(d)).
    k_table, v_table : gpu.tables.DeviceTable, optional
    splits : int, optional
        Force the split count (default: the plan's).

    Returns
    -------
    torch.Tensor, q's dtype, shape of q
    """
    import torch

    _check_mse("key_method", key_method)
    _check_mse("value_method", value_method)
    q = _tensor("q", q, ("torch.float32", "torch.float16", "torch.bfloat16"))
    out_dtype = q.dtype
    if q.ndim not in (2, 3):
        raise ValueError(f"q must be (G, h, d) or (h, d), got shape {tuple(q.shape)}")
    grouped = q.ndim == 3
    q3 = q if grouped else q.unsqueeze(0)
    G, h, d = q3.shape
    if key_method.dim != d or value_method.dim != d:
        raise ValueError(f"q has d={d}, the methods have dim {key_method.dim} and {value_method.dim}")
    _finite("q", q)
    q3 = q3.float().contiguous()  # exact for float16/bfloat16
    dev = q.device

    def cache(name, t, dtypes):
        t = _tensor(name, t, dtypes, dev)
        return t if grouped else t.unsqueeze(0)

    kc, vc = cache("k_codes", k_codes, ("torch.uint8",)), cache("v_codes", v_codes, ("torch.uint8",))
    kn, vn = cache("k_norms", k_norms, ("torch.float16",)), cache("v_norms", v_norms, ("torch.float16",))
    n_mid = kc.shape[1] if kc.ndim == 3 else -1
    _shape("k_codes", kc, (G, n_mid, packed_size(d, key_method.bits)))
    _shape("v_codes", vc, (G, n_mid, packed_size(d, value_method.bits)))
    _shape("k_norms", kn, (G, n_mid))
    _shape("v_norms", vn, (G, n_mid))
    if (band_k is None) != (band_v is None):
        raise ValueError("band_k and band_v must be given together")
    n_band = 0
    if band_k is not None:
        band_k, band_v = cache("band_k", band_k, ("torch.float16",)), cache("band_v", band_v, ("torch.float16",))
        n_band = band_k.shape[1] if band_k.ndim == 3 else -1
        _shape("band_k", band_k, (G, n_band, d))
        _shape("band_v", band_v, (G, n_band, d))
    if n_mid + n_band < 1:
        raise ValueError("the cache holds no tokens")
    if h > MAX_GROUP:
        raise ValueError(f"h = {h} query rows per group exceed the kernel's {MAX_GROUP}")
    plan = plan_splits(max(G, 1), 1, n_mid, TILE, splits=splits)
    if G * (plan.splits + 1) > 2**31 - 1:
        raise ValueError(f"G * (splits + 1) = {G * (plan.splits + 1)} blocks exceed the grid limit")
    ktab = _table(k_table, d, key_method.bits, dev)
    vtab = _table(v_table, d, value_method.bits, dev)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    backend = _backend(dev)

    krot = _rotation(("mse", d, key_method.seed), key_method.rot, dev)
    vrot = _rotation(("mse", d, value_method.seed), value_method.rot, dev)
    q_rot = (q3.double() @ krot["matrix"].T).float().contiguous()
    out = torch.empty((G, h, d), dtype=torch.float32, device=dev)
    workspace = torch.empty(max(1, G * (plan.splits + 1) * h * (d + 2)), dtype=torch.float32, device=dev)
    if G * h:
        _launch(backend, dev, "kvq_decode_attention", G, h, d, _ptr(q_rot), _ptr(q3), n_mid, _ptr(kc), _ptr(kn),
                _ptr(ktab.levels32), key_method.bits, _ptr(vc), _ptr(vn), _ptr(vtab.levels32), value_method.bits,
                n_band, _ptr(band_k), _ptr(band_v), _ptr(vrot["signs1"]), _ptr(vrot["signs2"]),
                _ptr(vrot["inv_perm"]), vrot["block"], sm_scale, plan.splits, plan.chunk, _ptr(workspace),
                _ptr(out))
    out = out.to(out_dtype)
    return out if grouped else out[0]
