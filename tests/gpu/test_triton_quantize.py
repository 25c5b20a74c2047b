"""Triton quantize/dequantize kernels against kvq_ref (TurboQuantMSE and turbo2/3/4 blocks).

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (set here and in conftest, before triton is
imported). Quantize kernels must be bit-exact: packed codes, norms and block bytes equal kvq_ref
for float16 inputs. Dequantize kernels compute in float32 and are compared with a stated bound:

The dequantize bound is ``kvq_ref.testing.decode_tolerance``: ``(log2(b) + 6) u ||ref||_2`` per row
(derivation in ``kvq_ref.testing.tolerances``). Measured: at most ~3.2 u over all the shapes below.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gpu.triton.quantize as tq  # noqa: E402
from gpu.tables import DeviceTable, TableMismatchError, check_device_table, load_device_table  # noqa: E402
from gpu.triton import (dequantize_mse, dequantize_turbo_block, hopper_compile, quantize_mse,  # noqa: E402
                        quantize_turbo_block)
from kvq_ref.packing import unpack_codes  # noqa: E402
from kvq_ref.testing import decode_tolerance  # noqa: E402
from kvq_ref.turbo_block import TurboBlock  # noqa: E402
from kvq_ref.turboquant import TurboQuantMSE  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

DIMS = (64, 80, 96, 128, 256)
U32 = 2.0**-24


_TABLES = {}


def table(dim, bits):
    if (dim, bits) not in _TABLES:
        _TABLES[dim, bits] = load_device_table(dim, bits, device=DEV)
    return _TABLES[dim, bits]


def data(n, d, seed, dtype=torch.float16, scale=1.0, zero_rows=()):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * scale
    if seed % 3 == 1:  # a few outlier channels, as in real keys
        x[:, rng.integers(0, d, 3)] *= 8.0
    x[list(zero_rows)] = 0.0
    return torch.tensor(x, dtype=dtype, device=DEV)


def np_(t):
    return t.detach().cpu().numpy()


def ref_table(q):
    """A DeviceTable of kvq_ref's own codebook (for dimensions the shipped table set lacks)."""
    cb = q.table
    return DeviceTable(cb, *(torch.tensor(np.array(a), dtype=dt, device=DEV) for a, dt in (
        (cb.levels, torch.float64), (cb.thresholds, torch.float64),
        (cb.levels.astype(np.float32), torch.float32), (cb.thresholds.astype(np.float32), torch.float32))))


def check_mse_exact(x, q, block_rows=None, tab=None):
    packed, norms = quantize_mse(x, q, tab or table(q.dim, q.bits), block_rows=block_rows)
    ref = q.encode(x.cpu())
    assert packed.dtype == torch.uint8 and norms.dtype == getattr(torch, q.norm_dtype)
    np.testing.assert_array_equal(np_(packed), ref.arrays["codes"])
    np.testing.assert_array_equal(np_(norms), ref.arrays["norms"])
    return packed, norms, ref


def rel_row_err(out, ref):
    out, ref = np_(out).astype(np.float64), np.asarray(ref, dtype=np.float64)
    err = np.linalg.norm(out - ref, axis=-1)
    return err, np.linalg.norm(ref, axis=-1)


# --- quantize: bit-exact ------------------------------------------------------------------------------
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_codes_fp16_bit_exact(d, bits):
    n = (1, 54, 97)[(d + bits) % 3]
    check_mse_exact(data(n, d, seed=d * 10 + bits), TurboQuantMSE(d, bits, seed=bits, norm_correction=bits == 3))


@settings(max_examples=24, deadline=None)
@given(d=st.sampled_from(DIMS), bits=st.integers(1, 8), n=st.sampled_from([1, 54, 97]),
       seed=st.integers(0, 2**31 - 1), qseed=st.integers(0, 1000), nc=st.booleans(),
       log_scale=st.floats(-6.0, 4.0), norm32=st.booleans())
def test_mse_codes_fp16_bit_exact_property(d, bits, n, seed, qseed, nc, log_scale, norm32):
    q = TurboQuantMSE(d, bits, seed=qseed, norm_correction=nc, norm_dtype="float32" if norm32 else "float16")
    check_mse_exact(data(n, d, seed, scale=2.0**log_scale), q)


def test_mse_other_shapes_and_bfloat16():
    # d = m * 2^k beyond the shipped head sizes (tables from kvq_ref's own solve), several programs
    # per launch, bfloat16 input, and leading axes
    for d, bits in ((6, 3), (20, 5), (48, 7), (192, 1)):
        q = TurboQuantMSE(d, bits, seed=d)
        check_mse_exact(data(37, d, seed=d, dtype=torch.bfloat16), q, block_rows=8, tab=ref_table(q))
    q = TurboQuantMSE(80, 3)
    x = data(12, 80, seed=5).reshape(3, 4, 80)
    packed, norms = quantize_mse(x, q, table(80, 3))
    ref = q.encode(x.cpu())
    assert packed.shape == (3, 4, 30) and norms.shape == (3, 4)
    np.testing.assert_array_equal(np_(packed), ref.arrays["codes"])


def test_mse_zero_vectors():
    for nc in (False, True):
        q = TurboQuantMSE(96, 3, norm_correction=nc)
        x = data(54, 96, seed=7, zero_rows=(0, 17, 53))
        packed, norms, ref = check_mse_exact(x, q)
        assert np.all(np_(norms)[[0, 17, 53]] == 0) and not np.any(np.signbit(np_(norms)[[0, 17, 53]]))
        out = dequantize_mse(packed, norms, q, table(96, 3))
        assert np.all(np_(out)[[0, 17, 53]] == 0)
    packed, norms = quantize_mse(torch.zeros((1, 64), dtype=torch.float16, device=DEV), TurboQuantMSE(64, 2),
                                 table(64, 2))
    assert np_(norms)[0] == 0


@pytest.mark.parametrize("d,bits", [(80, 3), (128, 4), (256, 2)])
def test_mse_float32_inputs_exact_away_from_thresholds(d, bits):
    q = TurboQuantMSE(d, bits, seed=11, norm_correction=bits == 4)
    x = data(97, d, seed=d + bits, dtype=torch.float32)
    packed, norms = quantize_mse(x, q, table(d, bits))
    ref = q.encode(x)
    # the reference rotated coordinates and their distance to the nearest threshold
    flat = np_(x.double())
    nrm = np.sqrt(np.sum(flat * flat, axis=1))
    y = q.rot.apply(flat * np.divide(1.0, nrm, out=np.zeros_like(nrm), where=nrm > 0)[:, None])
    thr = q.table.thresholds
    k = np.clip(np.searchsorted(thr, y), 1, len(thr)) - 1
    near = np.minimum(np.abs(y - thr[k]), np.abs(y - thr[np.minimum(k + 1, len(thr) - 1)]))
    tie = near <= 1e-12 * np.max(np.abs(thr))
    codes = unpack_codes(np_(packed), bits, d)
    ref_codes = unpack_codes(ref.arrays["codes"], bits, d)
    assert np.array_equal(codes[~tie], ref_codes[~tie])
    # random data lands within 1e-12 of a threshold with probability ~1e-11 per coordinate
    assert int(tie.sum()) == 0
    np.testing.assert_array_equal(np_(packed), ref.arrays["codes"])
    np.testing.assert_array_equal(np_(norms), ref.arrays["norms"])


@pytest.mark.parametrize("fmt", ["turbo2", "turbo3", "turbo4"])
@pytest.mark.parametrize("block", [128, 32])
def test_turbo_blocks_fp16_byte_exact(fmt, block):
    q = TurboBlock(fmt, block, seed=5, profile="kvq")
    x = data(97 if block == 32 else 54, block, seed=block + q.bits, zero_rows=(1,))
    blocks = quantize_turbo_block(x, q, table(block, q.bits))
    ref = q.encode(x.cpu()).arrays["blocks"]
    np.testing.assert_array_equal(np_(blocks), ref)
    assert np_(blocks)[1, 0] == 0 and np_(blocks)[1, 1] == 0  # zero vector: gamma = +0
    out = dequantize_turbo_block(blocks, q, table(block, q.bits))
    err, size = rel_row_err(out, q.decode(q.encode(x.cpu())))
    assert np.all(err <= decode_tolerance(q.decode(q.encode(x.cpu())), block))
    assert np.all(np_(out)[1] == 0)


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(["turbo2", "turbo3", "turbo4"]), block=st.sampled_from([32, 128]),
       n=st.sampled_from([1, 54, 97]), seed=st.integers(0, 2**31 - 1), qseed=st.integers(0, 1000),
       log_scale=st.floats(-6.0, 4.0), f32=st.booleans())
def test_turbo_blocks_byte_exact_property(fmt, block, n, seed, qseed, log_scale, f32):
    q = TurboBlock(fmt, block, seed=qseed, profile="kvq")
    x = data(n, block, seed, dtype=torch.float32 if f32 else torch.float16, scale=2.0**log_scale)
    np.testing.assert_array_equal(np_(quantize_turbo_block(x, q, table(block, q.bits))),
                                  q.encode(x.cpu()).arrays["blocks"])


# --- dequantize: float32 within the stated bound ----------------------------------------------------------
@pytest.mark.parametrize("d", DIMS)
def test_mse_dequantize_within_bound(d):
    for bits in (2, 3, 4):
        q = TurboQuantMSE(d, bits, seed=d, norm_correction=bits == 2)
        x = data((1, 54, 97)[bits - 2], d, seed=bits * d, zero_rows=(0,))
        packed, norms = quantize_mse(x, q, table(d, bits))
        out = dequantize_mse(packed, norms, q, table(d, bits))
        ref = q.decode(q.encode(x.cpu()))
        assert out.dtype == torch.float32 and out.shape == x.shape
        err, size = rel_row_err(out, ref)
        assert np.all(err <= decode_tolerance(ref, q.rot.block)), (err / np.maximum(size, 1e-30)).max() / U32


def test_dequantize_refuses_corrupted_buffers():
    q6 = TurboQuantMSE(6, 3)  # 18 bits in 3 bytes: 6 padding bits that must stay zero
    t6 = ref_table(q6)
    p6, n6, ref = check_mse_exact(data(4, 6, seed=1), q6, tab=t6)
    err, size = rel_row_err(dequantize_mse(p6, n6, q6, t6), q6.decode(ref))
    assert np.all(err <= decode_tolerance(q6.decode(ref), q6.rot.block))
    p6[0, -1] |= 0x80
    with pytest.raises(ValueError, match="padding"):
        dequantize_mse(p6, n6, q6, t6)
    q = TurboQuantMSE(64, 3)
    packed, norms = quantize_mse(data(4, 64, seed=2), q, table(64, 3))
    bad = norms.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mse(packed, bad, q, table(64, 3))
    with pytest.raises(ValueError, match="norms must be"):
        dequantize_mse(packed, norms.float(), q, table(64, 3))
    qb = TurboBlock("turbo4", 128, profile="kvq")
    blocks = quantize_turbo_block(data(3, 128, seed=3), qb, table(128, 4))
    neg = blocks.clone()
    neg[0, 1] |= 0x80
    with pytest.raises(ValueError, match="negative"):
        dequantize_turbo_block(neg, qb, table(128, 4))
    unused = blocks.clone()
    unused[2, 3] = 1
    with pytest.raises(ValueError, match="unused"):
        dequantize_turbo_block(unused, qb, table(128, 4))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's cast
def test_norm_overflow_refused_like_kvq_ref():
    x = torch.full((2, 256), 5000.0, dtype=torch.float16, device=DEV)  # ||x|| = 80000 > float16 max
    q = TurboQuantMSE(256, 2)
    with pytest.raises(ValueError, match="overflow"):
        q.encode(x.cpu())
    with pytest.raises(ValueError, match="overflow"):
        quantize_mse(x, q, table(256, 2))
    packed, norms = quantize_mse(x, TurboQuantMSE(256, 2, norm_dtype="float32"), table(256, 2))
    assert np.isclose(float(norms[0]), 80000.0)
    qb = TurboBlock("turbo2", 128, profile="kvq")
    xb = torch.full((1, 128), 8000.0, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="overflow"):
        qb.encode(xb.cpu())
    with pytest.raises(ValueError, match="overflow"):
        quantize_turbo_block(xb, qb, table(128, 2))


# --- validation before launch -------------------------------------------------------------------------
class _NoLaunch:
    """Stands in for a kernel: any launch attempt fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("kernel launched although the inputs should have been refused")


@pytest.fixture
def no_launch(monkeypatch):
    for name in ("_mse_quantize_kernel", "_mse_dequantize_kernel", "_turbo_quantize_kernel",
                 "_turbo_dequantize_kernel"):
        monkeypatch.setattr(tq, name, _NoLaunch())


def test_mismatched_table_refused_before_launch(no_launch):
    q = TurboQuantMSE(128, 3)
    x = data(4, 128, seed=0)
    packed = torch.zeros((4, 48), dtype=torch.uint8, device=DEV)
    norms = torch.ones(4, dtype=torch.float16, device=DEV)
    for wrong in (table(128, 4), table(128, 2), table(96, 3), table(256, 3)):
        with pytest.raises(TableMismatchError, match="SphereMarginal"):
            quantize_mse(x, q, wrong)
        with pytest.raises(TableMismatchError):
            dequantize_mse(packed, norms, q, wrong)
    qb = TurboBlock("turbo3", 128, profile="kvq")
    for wrong in (table(128, 4), table(64, 3)):
        with pytest.raises(TableMismatchError):
            quantize_turbo_block(x, qb, wrong)
        with pytest.raises(TableMismatchError):
            dequantize_turbo_block(torch.zeros((4, 50), dtype=torch.uint8, device=DEV), qb, wrong)


def test_bad_inputs_refused_before_launch(no_launch):
    q, t = TurboQuantMSE(64, 2), table(64, 2)
    with pytest.raises(TypeError, match="float16"):
        quantize_mse(torch.zeros((2, 64), dtype=torch.int32, device=DEV), q, t)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_mse(np.zeros((2, 64)), q, t)
    with pytest.raises(ValueError, match="last dimension 64"):
        quantize_mse(torch.zeros((2, 65), device=DEV), q, t)
    with pytest.raises(ValueError, match="NaN"):
        quantize_mse(torch.full((2, 64), float("inf"), device=DEV), q, t)
    with pytest.raises(ValueError, match="hadamard"):
        quantize_mse(torch.zeros((2, 64), device=DEV), TurboQuantMSE(64, 2, rotation="haar"), t)
    with pytest.raises(TypeError, match="DeviceTable"):
        quantize_mse(torch.zeros((2, 64), device=DEV), q, q.table)
    with pytest.raises(ValueError, match="bytes per row"):
        dequantize_mse(torch.zeros((2, 15), dtype=torch.uint8, device=DEV), torch.ones(2, dtype=torch.float16), q, t)
    with pytest.raises(ValueError, match="bytes per block"):
        dequantize_turbo_block(torch.zeros((2, 49), dtype=torch.uint8, device=DEV), TurboBlock("turbo3", profile="kvq"), table(128, 3))
    for profile in ("fork@69d8e4be", "fork@69d8e4be+exact"):  # float32 rules the kernels do not implement
        with pytest.raises(ValueError, match="profile 'kvq'"):
            quantize_turbo_block(torch.zeros((2, 128), device=DEV), TurboBlock("turbo3", profile=profile), table(128, 3))
        with pytest.raises(ValueError, match="profile 'kvq'"):
            dequantize_turbo_block(torch.zeros((2, 50), dtype=torch.uint8, device=DEV), TurboBlock("turbo3", profile=profile),
                                   table(128, 3))


# --- Hopper (sm_90) compile check: registers and spills --------------------------------------------------
def test_hopper_compile_every_kernel(capsys):
    specs = [("quantize", TurboQuantMSE(96, 3, norm_correction=True)), ("dequantize", TurboQuantMSE(96, 3)),
             ("quantize", TurboBlock("turbo3", 128, profile="kvq")), ("dequantize", TurboBlock("turbo3", 128, profile="kvq"))]
    reports = hopper_compile(specs)
    with capsys.disabled():
        print()
        for (kernel, q), rep in zip(specs, reports):
            print(f"  sm_90 {kernel} {q}: {rep.summary()}")
    for (kernel, _), rep in zip(specs, reports):
        assert rep.n_regs > 0 and rep.spill_stores == 0 and rep.spill_loads == 0
        if kernel == "quantize":  # the bit-exactness contract, visible in the PTX
            for op in ("div.rn.f64", "sqrt.rn.f64", "cvt.rn.f16.f64", "bar.sync"):
                assert op in rep.ptx, op
            assert not re.search(r"\bfma\.rn\.f64", rep.ptx)


# --- on a real GPU ---------------------------------------------------------------------------------------
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU (TRITON_INTERPRET=0)")
def test_on_gpu_many_rows():
    for d, bits, nc in ((128, 3, True), (80, 4, False), (256, 2, True)):
        q = TurboQuantMSE(d, bits, norm_correction=nc)
        packed, norms, ref = check_mse_exact(data(4099, d, seed=d), q)
        err, size = rel_row_err(dequantize_mse(packed, norms, q, table(d, bits)), q.decode(ref))
        assert np.all(err <= decode_tolerance(q.decode(ref), q.rot.block))
    for fmt in ("turbo2", "turbo3", "turbo4"):
        q = TurboBlock(fmt, 128, profile="kvq")
        x = data(4099, 128, seed=1)
        np.testing.assert_array_equal(np_(quantize_turbo_block(x, q, table(128, q.bits))),
                                      q.encode(x.cpu()).arrays["blocks"])


def test_hand_built_tables_are_validated_before_launch(no_launch):
    """Issue 53: the kernels trusted a hand-built DeviceTable (they index levels by code and search
    the thresholds): wrong sizes, dtypes, a non-contiguous view or edited values are refused."""
    import dataclasses

    q = TurboQuantMSE(128, 3)
    x = data(4, 128, seed=0)
    good = table(128, 3)
    bad = [dataclasses.replace(good, levels=good.levels[:4]), dataclasses.replace(good, thresholds=good.thresholds.float()),
           dataclasses.replace(good, levels32=good.levels32.clone().fill_(0.5)),
           dataclasses.replace(good, levels=torch.stack([good.levels, good.levels], 1)[:, 0]),
           dataclasses.replace(good, codebook=None), dataclasses.replace(good, thresholds32=[0.0] * 7)]
    for wrong in bad:
        with pytest.raises((TableMismatchError, TypeError)):
            quantize_mse(x, q, wrong)
        with pytest.raises((TableMismatchError, TypeError)):
            dequantize_mse(torch.zeros((4, 48), dtype=torch.uint8, device=DEV), torch.ones(4, dtype=torch.float16,
                                                                                        device=DEV), q, wrong)
    check_device_table(good, 128, 3)
