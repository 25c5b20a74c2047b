"""CUDA C++ kernels (gpu/cuda): Hopper compile check, bit-exact quantize, decode attention, validation.

Backends. Every correctness test runs twice: ``host`` compiles the very same ``.cu`` sources with
g++ against ``gpu/cuda/host_emu.h`` (each CUDA block run by 128 CPU threads, ``__syncthreads`` a
barrier) and calls them on CPU tensors (``KVQ_CUDA_HOST_EMULATION=1``), so the kernels' logic is
checked on machines without a GPU; ``cuda`` builds them with nvcc and runs them on the GPU
(skipped, "needs a CUDA GPU", when torch.cuda.is_available() is False).

Quantize kernels are bit-exact: packed codes, float16 norms and turbo block bytes equal kvq_ref's
for float16 and float32 inputs (squares of both are exact in float64 and the kernels sum them in
kvq_ref's order; see gpu/cuda/binding.py). A zero row puts every rotated coordinate exactly on the
middle threshold 0.0, which checks the tie rule (the lower cell).

Decode-attention tolerance: ``kvq_ref.testing.ATTENTION_RTOL`` (float32, u = 2^-24 ~ 6e-8). The kernel rounds the rotated query and
the levels to float32, forms d-term float32 dot products (typical error ~ sqrt(d) u relative),
exponentials (CUDA's expf: <= 2 ulp; glibc's in the host emulation: <= 1 ulp), running sums over
n tokens (~ sqrt(n) u) and a float32 inverse rotation (log2(b) + 2 roundings), against kvq_ref's
float64. For the shapes below (d <= 256, n <= 300, logits of order 1..10) that is ~1e-6 relative;
measured on the host emulation: at most 1.2e-6 (Frobenius) and 2e-6 (max element / max |ref|).
The test allows 2e-5 for both: a 10x margin for the GPU's expf and its FMA contractions, while
any indexing or softmax bug (a wrong level, code, sign or weight) shows up at >= 1e-3.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.cuda import binding
from gpu.cuda.binding import (HOST_EMULATION_ENV, CudaUnavailableError, decode_attention, find_nvcc,
                              quantize_mse, quantize_turbo_block)
from gpu.tables import TableMismatchError, load_device_table
from gpu.triton.report import nvdisasm_path
from kvq_ref.attention import QuantizedKV, attention_decode, relative_error
from kvq_ref.packing import packed_size
from kvq_ref.testing import ATTENTION_RTOL
from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turboquant import TurboQuantMSE

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
KERNELS = {"kvq_quantize_mse_kernel", "kvq_quantize_turbo_kernel", "kvq_decode_split_kernel",
           "kvq_decode_merge_kernel"}
ATTN_TOL = ATTENTION_RTOL


@pytest.fixture(params=[pytest.param("host", id="host-emulation"), pytest.param("cuda", marks=needs_gpu)])
def device(request, monkeypatch):
    """torch device of the backend under test (the host emulation takes CPU tensors)."""
    if request.param == "cuda":
        if find_nvcc() is None:
            pytest.skip("needs nvcc (CUDA toolkit)")
        return torch.device("cuda")
    if not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("the host emulation needs g++ (>= 12)")
    monkeypatch.setenv(HOST_EMULATION_ENV, "1")
    return torch.device("cpu")


def _rows(n, d, seed, dtype):
    """Rows of varied magnitude, a zero row, and one mixing tiny and large entries."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * np.exp(rng.uniform(-4, 4, (n, 1)))
    x[1] = 0.0
    x[2, ::3] *= 1e-4
    x[2, 1::5] *= 30.0
    return torch.tensor(x, dtype=dtype)


def _same_mse(x, q, codes, norms):
    enc = q.encode(x)
    np.testing.assert_array_equal(codes.cpu().numpy(), enc.arrays["codes"])
    np.testing.assert_array_equal(norms.cpu().numpy().view(np.uint16), enc.arrays["norms"].view(np.uint16))


# ---- compile check for Hopper (no GPU needed) ---------------------------------------------------
@needs_nvcc
def test_sources_compile_for_hopper_without_spills(capsys):
    report = binding.ptxas_report("sm_90")
    with capsys.disabled():
        print("\nptxas -v, sm_90:\n" + binding.format_report(report))
    assert {r.kernel for r in report} == KERNELS
    assert {r.source for r in report} == set(binding.SOURCES)
    assert all(r.arch == "sm_90" and 0 < r.registers <= 255 for r in report)
    spilled = [f"{r.kernel}: {r.spill_stores} B stores / {r.spill_loads} B loads" for r in report if r.spills]
    assert not spilled, f"register spills: {spilled}"


@needs_nvcc
def test_sass_has_no_half_to_integer_conversion(tmp_path):
    """The kernels move float16 bits; they never convert a half value to an integer.

    ptxas of CUDA 13.0 compiled a byte store of a float16 register (the turbo block scale's low byte)
    as F2I.U8.F16, which stores min(255, trunc(gamma)) instead of the bits: codes exact, scales wrong
    on the H200 while the host emulation was exact. The kernels now store the scale as one 16-bit
    value; this checks the sm_90 SASS (build_library's flags) for any half-to-integer conversion.
    """
    tool = nvdisasm_path()
    if tool is None:
        pytest.skip("needs nvdisasm (nvidia-cuda-nvdisasm, the gpu extra)")
    for src in binding.SOURCES:
        cubin = tmp_path / f"{src}.cubin"
        subprocess.run([find_nvcc(), "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(cubin), src],
                       cwd=binding.CUDA_DIR, check=True, capture_output=True)
        sass = subprocess.run([tool, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
        assert "STG.E" in sass, f"{src}: no global stores in the disassembly"
        bad = [line.strip() for line in sass.splitlines() if re.search(r"\bF2I\S*\.F16\b", line)]
        assert not bad, f"{src}: half-to-integer conversions in the SASS: {bad}"


# ---- TurboQuantMSE quantize-and-pack ------------------------------------------------------------
@pytest.mark.parametrize("d,bits", [(d, b) for d in (64, 80, 96, 128, 256) for b in (2, 3, 4)]
                         + [(128, 1), (80, 1)])
def test_quantize_mse_bit_exact(device, d, bits):
    x16 = _rows(19, d, d + bits, torch.float16)
    q = TurboQuantMSE(d, bits, seed=3)
    _same_mse(x16, q, *quantize_mse(x16.to(device), q))
    x32 = _rows(7, d, 7 * d + bits, torch.float32).reshape(7, 1, d)  # leading axes are kept
    qc = TurboQuantMSE(d, bits, seed=11, norm_correction=True)
    codes, norms = quantize_mse(x32.to(device), qc)
    assert codes.shape == (7, 1, packed_size(d, bits)) and norms.shape == (7, 1)
    _same_mse(x32, qc, codes, norms)


@settings(max_examples=8)
@given(d=st.sampled_from([16, 32, 80, 96, 192]), bits=st.integers(1, 4), seed=st.integers(0, 2**16),
       half=st.booleans(), corrected=st.booleans(), n=st.integers(3, 12))
def test_host_quantize_mse_bit_exact_any_config(d, bits, seed, half, corrected, n):
    if not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("the host emulation needs g++ (>= 12)")
    x = _rows(n, d, seed, torch.float16 if half else torch.float32)
    q = TurboQuantMSE(d, bits, seed=seed, norm_correction=corrected)
    old = os.environ.get(HOST_EMULATION_ENV)
    os.environ[HOST_EMULATION_ENV] = "1"  # hypothesis forbids function-scoped fixtures (monkeypatch)
    try:
        _same_mse(x, q, *quantize_mse(x, q))
    finally:
        if old is None:
            del os.environ[HOST_EMULATION_ENV]
        else:
            os.environ[HOST_EMULATION_ENV] = old


def test_quantize_mse_empty_and_overflow(device):
    q = TurboQuantMSE(64, 2)
    codes, norms = quantize_mse(torch.zeros((0, 64), dtype=torch.float16, device=device), q)
    assert codes.shape == (0, 16) and norms.shape == (0,)
    big = torch.full((1, 64), 60000.0, dtype=torch.float32, device=device)  # ||x|| = 480000
    with pytest.raises(ValueError, match="overflow"):
        quantize_mse(big, q)


# ---- turbo2/3/4 blocks --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["turbo2", "turbo3", "turbo4"])
@pytest.mark.parametrize("block", [128, 32])
def test_turbo_blocks_bit_exact(device, fmt, block):
    tb = TurboBlock(fmt, block, seed=5, profile="kvq")
    for dtype in (torch.float16, torch.float32):
        x = _rows(13, block, block + len(fmt), dtype)
        out = quantize_turbo_block(x.to(device), tb)
        np.testing.assert_array_equal(out.cpu().numpy(), tb.encode(x).arrays["blocks"])


# ---- fused decode attention ---------------------------------------------------------------------
def _cache(G, n, d, sink, window, km, vm, seed):
    rng = np.random.default_rng(seed)
    K, V = rng.standard_normal((2, G, n, d))
    caches = [QuantizedKV.build(K[g], V[g], km, vm, sink, window) for g in range(G)]
    return caches


def _tensors(caches, d, km, vm, device):
    """The caches' stored arrays as (G, ...) tensors: codes, norms, band rows."""
    def stack(f):
        return torch.stack([torch.from_numpy(np.ascontiguousarray(f(c))) for c in caches]).to(device)

    G = len(caches)
    if caches[0].keys is None:
        empty = torch.zeros((G, 0), dtype=torch.float16, device=device)
        kc = torch.zeros((G, 0, packed_size(d, km.bits)), dtype=torch.uint8, device=device)
        vc = torch.zeros((G, 0, packed_size(d, vm.bits)), dtype=torch.uint8, device=device)
        mid = (kc, empty, vc, empty)
    else:
        mid = tuple(stack(lambda c, t=t, k=k: getattr(c, t).arrays[k])
                    for t, k in (("keys", "codes"), ("keys", "norms"), ("values", "codes"), ("values", "norms")))
    band = {}
    if caches[0].band_keys.shape[0]:
        band = {"band_k": stack(lambda c: c.band_keys), "band_v": stack(lambda c: c.band_values)}
    return mid, band


@pytest.mark.parametrize("d,n,sink,window,kbits,vbits", [
    (64, 1, 0, 0, 2, 3),       # one coded token
    (96, 54, 4, 8, 3, 2),      # non-power-of-two d (block-Hadamard with a permutation) + band
    (80, 97, 8, 8, 4, 3),
    (128, 97, 0, 0, 4, 4),     # no band
    (256, 54, 2, 6, 2, 2),
    (128, 300, 16, 64, 3, 4),  # several tiles of 128 tokens (online softmax rescaling)
    (64, 5, 2, 3, 2, 2),       # band only, no coded tokens
])
def test_decode_attention_matches_kvq_ref(device, d, n, sink, window, kbits, vbits):
    G, h = 2, 4
    km = TurboQuantMSE(d, kbits, seed=1)
    vm = TurboQuantMSE(d, vbits, seed=2, norm_correction=True)
    caches = _cache(G, n, d, sink, window, km, vm, seed=d + n)
    Q = np.random.default_rng(n).standard_normal((G, h, d)) * 2.0
    ref = np.stack([attention_decode(Q[g], caches[g]) for g in range(G)])
    mid, band = _tensors(caches, d, km, vm, device)
    out = decode_attention(torch.tensor(Q, dtype=torch.float32, device=device), *mid, km, vm, **band)
    assert out.shape == (G, h, d) and out.dtype == torch.float32
    got = out.cpu().numpy()
    assert relative_error(got, ref) <= ATTN_TOL
    assert np.abs(got - ref).max() <= ATTN_TOL * np.abs(ref).max()
    # one group without the G axis, and an explicit logit scale
    one = decode_attention(torch.tensor(Q[0], dtype=torch.float32, device=device), *(t[0] for t in mid), km, vm,
                           scale=0.5, **{k: v[0] for k, v in band.items()})
    assert relative_error(one.cpu().numpy(), attention_decode(Q[0], caches[0], scale=0.5)) <= ATTN_TOL


@pytest.mark.parametrize("splits,h", [(1, 1), (3, 8), (9, 4)])
def test_decode_attention_splits_match_kvq_ref(device, splits, h):
    """Split-and-merge over 300 coded tokens in tiles of 64: one split, a few, more splits than
    tiles (empty splits merge as nothing); one query row, and GQA groups of 4 and 8."""
    d, G = 64, 2
    km, vm = TurboQuantMSE(d, 4, seed=3), TurboQuantMSE(d, 2, seed=4)
    caches = _cache(G, 312, d, 4, 8, km, vm, seed=splits)
    Q = np.random.default_rng(splits).standard_normal((G, h, d)) * 2.0
    ref = np.stack([attention_decode(Q[g], caches[g]) for g in range(G)])
    mid, band = _tensors(caches, d, km, vm, device)
    got = decode_attention(torch.tensor(Q, dtype=torch.float32, device=device), *mid, km, vm, splits=splits,
                           **band).cpu().numpy()
    assert relative_error(got, ref) <= ATTN_TOL
    assert np.abs(got - ref).max() <= ATTN_TOL * np.abs(ref).max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_takes_16_bit_queries(device, dtype):
    """A 16-bit q is widened exactly and the float32 result rounded once to q's dtype: the output
    equals the float32 path's output on the same (16-bit-representable) values, rounded."""
    d, G, h = 64, 2, 4
    km, vm = TurboQuantMSE(d, 3, seed=5), TurboQuantMSE(d, 2, seed=6)
    caches = _cache(G, 150, d, 2, 8, km, vm, seed=3)
    mid, band = _tensors(caches, d, km, vm, device)
    q16 = torch.from_numpy(np.random.default_rng(4).standard_normal((G, h, d)) * 2.0).to(dtype).to(device)
    out = decode_attention(q16, *mid, km, vm, **band)
    want = decode_attention(q16.float(), *mid, km, vm, **band)
    assert out.dtype == dtype and out.shape == (G, h, d)
    assert torch.equal(out, want.to(dtype))
    ref = np.stack([attention_decode(q16.float().cpu().numpy()[g].astype(np.float64), caches[g]) for g in range(G)])
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # half an output ulp, relative
    assert np.abs(out.float().cpu().numpy() - ref).max() <= (ATTN_TOL + u) * np.abs(ref).max()


# ---- validation before launch (no GPU, no compiler) ---------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a wrapper gets as far as building or loading a library."""
    def refuse(backend):
        raise AssertionError(f"validation let the call reach the {backend} library")

    monkeypatch.setattr(binding, "_library", refuse)
    monkeypatch.setenv(HOST_EMULATION_ENV, "1")


def _attn_inputs(d=64, n=6, kbits=2, vbits=3):
    km, vm = TurboQuantMSE(d, kbits), TurboQuantMSE(d, vbits)
    return dict(q=torch.zeros((2, 3, d)), k_codes=torch.zeros((2, n, packed_size(d, kbits)), dtype=torch.uint8),
                k_norms=torch.zeros((2, n), dtype=torch.float16),
                v_codes=torch.zeros((2, n, packed_size(d, vbits)), dtype=torch.uint8),
                v_norms=torch.zeros((2, n), dtype=torch.float16), key_method=km, value_method=vm)


def test_mismatched_tables_refused_before_launch(no_launch):
    x = torch.zeros((4, 128), dtype=torch.float16)
    with pytest.raises(TableMismatchError, match="bits=4"):
        quantize_mse(x, TurboQuantMSE(128, 3), table=load_device_table(128, 4))
    with pytest.raises(TableMismatchError, match="dim=64"):
        quantize_mse(x, TurboQuantMSE(128, 3), table=load_device_table(64, 3))
    with pytest.raises(TableMismatchError):
        quantize_turbo_block(x, TurboBlock("turbo3", 128, profile="kvq"), table=load_device_table(128, 4))
    with pytest.raises(TableMismatchError):
        quantize_turbo_block(x[:, :32], TurboBlock("turbo2", 32, profile="kvq"), table=load_device_table(128, 2))
    args = _attn_inputs()
    with pytest.raises(TableMismatchError, match="bits=2"):
        decode_attention(**args, k_table=load_device_table(64, 3))
    with pytest.raises(TableMismatchError, match="dim=64"):
        decode_attention(**args, v_table=load_device_table(128, 3))
    assert issubclass(TableMismatchError, ValueError)


def test_bad_arguments_refused_before_launch(no_launch):
    q = TurboQuantMSE(128, 3)
    with pytest.raises(ValueError, match="last dimension 128"):
        quantize_mse(torch.zeros((4, 64), dtype=torch.float16), q)
    with pytest.raises(TypeError, match="dtype"):
        quantize_mse(torch.zeros((4, 128), dtype=torch.float64), q)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_mse(np.zeros((4, 128), dtype=np.float16), q)
    with pytest.raises(ValueError, match="NaN"):
        quantize_mse(torch.full((2, 128), math.nan), q)
    with pytest.raises(ValueError, match="hadamard"):
        quantize_mse(torch.zeros((2, 128)), TurboQuantMSE(128, 3, rotation="haar"))
    with pytest.raises(ValueError, match="bits 1..4"):
        quantize_mse(torch.zeros((2, 128)), TurboQuantMSE(128, 5))
    with pytest.raises(ValueError, match="dim <= 256"):
        quantize_mse(torch.zeros((2, 576)), TurboQuantMSE(576, 2))
    with pytest.raises(TypeError, match="TurboBlock"):
        quantize_turbo_block(torch.zeros((2, 128)), q)
    for profile in ("fork@69d8e4be", "fork@69d8e4be+exact"):  # float32 rules the kernels do not implement
        with pytest.raises(ValueError, match="profile 'kvq'"):
            quantize_turbo_block(torch.zeros((2, 128)), TurboBlock("turbo3", profile=profile))
    good = _attn_inputs()
    for change, err, msg in [
        ({"k_codes": torch.zeros((2, 6, 24), dtype=torch.uint8)}, ValueError, r"k_codes must have shape \(2, 6, 16\)"),
        ({"v_norms": torch.zeros((2, 5), dtype=torch.float16)}, ValueError, "v_norms must have shape"),
        ({"q": torch.zeros((2, 3, 64), dtype=torch.float64)}, TypeError, "float32 or torch.float16"),
        ({"q": torch.zeros((2, 3, 96))}, ValueError, "d=96"),
        ({"k_norms": torch.zeros((2, 6))}, TypeError, "float16"),
        ({"value_method": TurboQuantMSE(64, 3, norm_dtype="float32")}, ValueError, "float16 norms"),
    ]:
        with pytest.raises(err, match=msg):
            decode_attention(**{**good, **change})
    with pytest.raises(ValueError, match="together"):
        decode_attention(**good, band_k=torch.zeros((2, 1, 64), dtype=torch.float16))
    with pytest.raises(ValueError, match="no tokens"):
        decode_attention(**_attn_inputs(n=0))


def test_cpu_tensors_without_gpu_get_a_clear_error(monkeypatch):
    monkeypatch.delenv(HOST_EMULATION_ENV, raising=False)
    with pytest.raises(CudaUnavailableError, match="need CUDA tensors"):
        quantize_mse(torch.zeros((2, 64), dtype=torch.float16), TurboQuantMSE(64, 2))
    monkeypatch.setattr(binding, "find_nvcc", lambda: None)
    with pytest.raises(CudaUnavailableError, match="nvcc not found"):
        binding.build_library("sm_90")
    with pytest.raises(CudaUnavailableError, match="nvcc not found"):
        binding.ptxas_report()


def test_launch_functions_refuse_bad_sizes(device):
    """The C launch functions' own checks (second line of defence): KVQ_EINVAL, nothing launched."""
    lib = binding._library("cuda" if device.type == "cuda" else "host")
    assert lib.kvq_quantize_mse(None, 0, 1, 300, 2, *[None] * 5, 256, 0, None, None, None) == -1  # d > 256
    assert lib.kvq_quantize_mse(None, 0, 1, 96, 2, *[None] * 5, 64, 0, None, None, None) == -1  # 64 does not divide 96
    assert lib.kvq_quantize_turbo(None, 0, 1, 64, 3, *[None] * 5, None) == -1  # turbo blocks are 32 or 128
    assert lib.kvq_decode_attention(1, 1, 64, None, None, 0, None, None, None, 2, None, None, None, 2, 0, None, None,
                                    None, None, None, 64, 1.0, 1, 64, None, None, None) == -1  # no tokens
    assert lib.kvq_decode_attention(1, 17, 64, None, None, 5, None, None, None, 2, None, None, None, 2, 0, None, None,
                                    None, None, None, 64, 1.0, 1, 64, None, None, None) == -1  # h > 16
    assert lib.kvq_decode_attention(1, 1, 64, None, None, 500, None, None, None, 2, None, None, None, 2, 0, None, None,
                                    None, None, None, 64, 1.0, 2, 64, None, None, None) == -1  # splits miss tokens
    assert b"refused before launch" in lib.kvq_cuda_error_string(-1)
    for fmt, block in [(f, b) for f in ("turbo2", "turbo3", "turbo4") for b in (32, 128)]:
        tb = TurboBlock(fmt, block, profile="kvq")
        assert lib.kvq_turbo_block_bytes_of(block, tb.bits) == tb.bytes_per_block
