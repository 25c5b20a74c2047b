"""Triton decode attention over a TurboQuantMSE cache, and NOVA-KV decode scores, against kvq_ref.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (set here and in conftest, before any kernel is
created); with ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run on the GPU.

Both kernels compute in float32 and kvq_ref in float64, so results are compared with bounds on
float32 rounding evaluated per case from the data: ``mse_tolerance`` and ``nova_tolerance`` are
``kvq_ref.testing.mse_attention_tolerance`` and ``nova_score_tolerance`` (derivations in
``kvq_ref.testing.tolerances``). Measured errors are about 1e-3 of the attention bound (a few 1e-7 on
outputs of order 1), still 10x below what one wrong 3-bit code does
(``test_mse_tolerance_rejects_one_wrong_code``), and 1e-3 to 1e-2 of the NOVA-KV score bound.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import gpu.triton.attention as att  # noqa: E402
from codebooks.nova import calibrate  # noqa: E402
from gpu.tables import TableMismatchError, load_device_table  # noqa: E402
from gpu.triton import nova as tnova  # noqa: E402
from gpu.triton.attention import Band, decode_attention_mse, inputs_from_cache  # noqa: E402
from gpu.triton.nova import NovaKeyTables, nova_key_scores  # noqa: E402
from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode  # noqa: E402
from kvq_ref.nova import NovaKV  # noqa: E402
from kvq_ref.testing import mse_attention_tolerance as mse_tolerance  # noqa: E402
from kvq_ref.testing import nova_score_tolerance as nova_tolerance  # noqa: E402
from tests.nova_data import generator, sequence  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

_TABLES = {}


def table(d, bits):
    if (d, bits) not in _TABLES:
        _TABLES[d, bits] = load_device_table(d, bits, device=DEV)
    return _TABLES[d, bits]


def to_dev(cache_inputs):
    *arrays, band = cache_inputs
    band = band if band is None else Band(band.keys.to(DEV), band.values.to(DEV), band.positions)
    return [a.to(DEV) for a in arrays] + [band]


# --- decode attention over TurboQuantMSE --------------------------------------------------------------
def make_kv(n, d, g, seed):
    """Keys with an offset and two outlier channels (as real keys have), values, and a query group
    rounded to float32 (the kernel's input), as float64 arrays."""
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((n, d)) + 0.5
    K[:, rng.integers(0, d, 2)] *= 4.0
    V = rng.standard_normal((n, d))
    q = (2.0 * rng.standard_normal((g, d))).astype(np.float32).astype(np.float64)
    return q, K, V


def make_case(n, d, g, bits, band, seed, norm_dtype="float16", norm_correction=False):
    """A query group and the QuantizedKV the kernel must reproduce (K and V rotations differ)."""
    q, K, V = make_kv(n, d, g, seed)
    kq = TurboQuantMSE(d, bits[0], seed=seed % 5, norm_dtype=norm_dtype, norm_correction=norm_correction)
    vq = TurboQuantMSE(d, bits[1], seed=seed % 5 + 7, norm_dtype=norm_dtype, norm_correction=norm_correction)
    return q, QuantizedKV.build(K, V, kq, vq, sink=band[0], window=band[1]), kq, vq


def stacked(caches, lead, device):
    """Kernel inputs of several heads' caches stacked on leading axes ``lead``."""
    inputs = [inputs_from_cache(c) for c in caches]
    arrays = [torch.stack([x[i] for x in inputs]).reshape(lead + tuple(inputs[0][i].shape)).to(device)
              for i in range(4)]
    nb = inputs[0][4].keys.shape[0]
    band = Band(*(torch.stack([getattr(x[4], f) for x in inputs]).reshape(lead + (nb, caches[0].d)).to(device)
                  for f in ("keys", "values")), inputs[0][4].positions)
    return arrays, band


def run_mse(q, cache, kq, vq, scale=None, **kw):
    kw.setdefault("precision", "ieee")  # the float32 tier (test_triton_paged.py checks the fp16 one)
    *arrays, band = to_dev(inputs_from_cache(cache))
    out = decode_attention_mse(torch.tensor(q, dtype=torch.float32, device=DEV), *arrays, kq, vq,
                               table(cache.d, kq.bits), table(cache.d, vq.bits), band=band, scale=scale, **kw)
    return out.cpu().numpy().astype(np.float64)


def check_mse(q, cache, kq, vq, scale=None, **kw):
    ref = attention_decode(q, cache, scale=scale)
    out = run_mse(q, cache, kq, vq, scale=scale, **kw)
    assert out.shape == ref.shape
    tol = mse_tolerance(q, cache, kq, vq, 1.0 / math.sqrt(cache.d) if scale is None else scale)
    err = np.abs(out - ref).max(axis=1)
    assert np.all(err <= tol), f"errors {err} exceed float32 bounds {tol}"
    return err / tol


NS, DS = (1, 54, 97, 300), (64, 128, 80, 96)
BITS = ((2, 2), (3, 3), (4, 4), (2, 4), (4, 3), (3, 2))
CASES = [(n, d, (1, 3)[i % 2], BITS[i % len(BITS)], ((0, 0), (4, 16))[(i // 2) % 2])
         for i, (d, n) in enumerate((d, n) for d in DS for n in NS)]


@pytest.mark.parametrize("n,d,g,bits,band", CASES)
def test_mse_decode_matches_kvq_ref(n, d, g, bits, band):
    q, cache, kq, vq = make_case(n, d, g, bits, band, seed=n + d + g)
    # small blocks: several online-softmax steps over band and encoded tokens
    check_mse(q, cache, kq, vq, block_n=32, block_band=16)


def test_mse_decode_options():
    # float32 norms with norm correction, a custom scale, a band that swallows the whole cache,
    # a band of sink tokens only and one of window tokens only, default (single-block) sizes
    q, cache, kq, vq = make_case(97, 128, 3, (3, 2), (4, 16), seed=3, norm_dtype="float32", norm_correction=True)
    check_mse(q, cache, kq, vq, scale=0.3)
    for band in ((60, 60), (5, 0), (0, 7)):
        check_mse(*make_case(97, 80, 3, (4, 2), band, seed=sum(band)))


def test_mse_decode_batch_and_heads_on_the_grid():
    b, h, n, d, g = 2, 3, 97, 96, 3
    kq, vq = TurboQuantMSE(d, 3, seed=1), TurboQuantMSE(d, 4, seed=8)
    data = [make_kv(n, d, g, seed=100 + i) for i in range(b * h)]
    caches = [QuantizedKV.build(K, V, kq, vq, sink=4, window=16) for _, K, V in data]
    q = np.stack([x[0] for x in data])
    arrays, band = stacked(caches, (b, h), DEV)
    out = decode_attention_mse(torch.tensor(q, dtype=torch.float32, device=DEV).reshape(b, h, g, d), *arrays,
                               kq, vq, table(d, 3), table(d, 4), band=band, precision="ieee")
    assert out.shape == (b, h, g, d)
    out = out.cpu().numpy().reshape(b * h, g, d)
    for i, c in enumerate(caches):
        err = np.abs(out[i] - attention_decode(q[i], c)).max(axis=1)
        assert np.all(err <= mse_tolerance(q[i], c, kq, vq, 1 / math.sqrt(d)))


def test_mse_tolerance_rejects_one_wrong_code():
    """The bound is loose (it sums magnitudes) yet still rejects a single corrupted code."""
    q, cache, kq, vq = make_case(97, 128, 3, (3, 3), (4, 16), seed=9)
    z = cache.logits(q) / math.sqrt(128)
    top = int(np.argmax(z[0, cache.middle]))  # the encoded token query 0 attends to most
    *arrays, band = to_dev(inputs_from_cache(cache))
    tol = mse_tolerance(q, cache, kq, vq, 1 / math.sqrt(128))
    for which in (0, 2):  # a key code, then a value code: coordinate 0 moves by one level
        bad = [a.clone() for a in arrays]
        bad[which][top, 0] ^= 1
        out = decode_attention_mse(torch.tensor(q, dtype=torch.float32, device=DEV), *bad, kq, vq, table(128, 3),
                                   table(128, 3), band=band, precision="ieee").cpu().numpy()
        assert np.abs(out - attention_decode(q, cache)).max(axis=1)[0] > 10 * tol[0]


def test_mse_refuses_mismatches_before_launch(monkeypatch):
    q, cache, kq, vq = make_case(54, 80, 3, (3, 2), (4, 16), seed=1)
    *arrays, band = to_dev(inputs_from_cache(cache))
    qt = torch.tensor(q, dtype=torch.float32, device=DEV)
    kt, vt = table(80, 3), table(80, 2)

    class NoLaunch:
        def __call__(self, *args, **kwargs):
            raise AssertionError("kernel launched despite invalid inputs")

    monkeypatch.setattr(att, "launch_paged", NoLaunch())
    bad = [
        (TableMismatchError, dict(ktable=table(80, 4))),            # table bits != kq.bits
        (TableMismatchError, dict(vtable=table(96, 2))),            # table of another dimension
        (TypeError, dict(ktable=kt.levels32)),                      # not a DeviceTable
        (TypeError, dict(kq=NovaKV)),                               # not a TurboQuantMSE
        (ValueError, dict(kq=TurboQuantMSE(80, 3, rotation="haar"))),
        (ValueError, dict(kq=TurboQuantMSE(96, 3))),                # method dimension
        (ValueError, dict(keys_packed=arrays[0][:, :-1])),          # bytes per row
        (ValueError, dict(values_packed=arrays[2][:-1])),           # token count differs from keys
        (TypeError, dict(keys_norms=arrays[1].float())),            # norm dtype != kq.norm_dtype
        (TypeError, dict(values_packed=arrays[2].to(torch.int8))),
        (TypeError, dict(q=qt.double())),
        (ValueError, dict(q=qt[:, :64])),
        (ValueError, dict(band=Band(band.keys, band.values, band.positions[::-1]))),
        (ValueError, dict(band=Band(band.keys[:-1], band.values[:-1], band.positions))),
        (ValueError, dict(band=Band(band.keys, band.values, band.positions[:-1] + (99,)))),
        (TypeError, dict(band=Band(band.keys.float(), band.values, band.positions))),
        (TypeError, dict(band=(band.keys, band.values))),
        (ValueError, dict(block_n=48)),
        (ValueError, dict(scale=float("nan"))),
    ]
    good = dict(q=qt, keys_packed=arrays[0], keys_norms=arrays[1], values_packed=arrays[2], values_norms=arrays[3],
                kq=kq, vq=vq, ktable=kt, vtable=vt, band=band)
    for exc, change in bad:
        with pytest.raises(exc):
            decode_attention_mse(**{**good, **change})
    with pytest.raises(AssertionError, match="launched"):
        decode_attention_mse(**good)


# --- NOVA-KV decode scores ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[32, 64])
def nova(request):
    d = request.param
    gen = generator(d, seed=5)
    _, model = calibrate([sequence(gen, 2, 1, 400, 0)], d, g=4, bits=2, iterations=3, seed=1)
    head = model.head(0, 0)
    return gen, head, NovaKV(head, "key", gain_dtype="float16"), NovaKeyTables.from_head(head, DEV)


def check_nova(q, nk, tables, keys, **kw):
    enc = nk.encode(keys)
    ref = nk.inner_product(q, enc)
    codes, gains = (torch.from_numpy(enc.arrays[k]).to(DEV) for k in ("codes", "gains"))
    out = nova_key_scores(torch.tensor(q, dtype=torch.float32, device=DEV), codes, gains, tables, **kw).cpu().numpy()
    assert out.shape == ref.shape
    tol = nova_tolerance(q, nk.head, enc, ref)
    assert np.all(np.abs(out - ref) <= tol), f"max error/bound {np.max(np.abs(out - ref) / tol):.3g}"
    return out


@pytest.mark.parametrize("n,m", [(1, 1), (54, 3), (97, 1), (300, 3)])
def test_nova_scores_match_kvq_ref(nova, n, m):
    gen, head, nk, tables = nova
    q, k, _ = sequence(gen, m, 1, n, 50 + n)[0]
    q = q[:, -1].astype(np.float32).astype(np.float64)  # the group's decode queries, exact in float32
    keys = k[0].copy()
    keys[n // 2] = head.key.mu  # a token whose coefficients vanish: gain 0, score q . mu
    check_nova(q, nk, tables, keys, block_n=32)  # several token blocks per head


def test_nova_scores_float32_gains(nova):
    # NovaKV's default (the release's float32 gains): the kernel widens either gain dtype exactly.
    gen, head, _, tables = nova
    q, k, _ = sequence(gen, 3, 1, 97, 11)[0]
    q = q[:, -1].astype(np.float32).astype(np.float64)
    nk = NovaKV(head, "key")
    assert nk.encode(k[0]).arrays["gains"].dtype == np.float32
    check_nova(q, nk, tables, k[0].copy(), block_n=32)


def test_nova_batch_heads_and_head_argument(nova):
    gen, head, nk, tables = nova
    q, k, _ = sequence(gen, 6, 2, 97, 7)[0]  # two KV heads (sharing the calibrated head), 3 queries each
    q = q[:, -1].astype(np.float32).astype(np.float64).reshape(2, 3, head.d)
    encs = [nk.encode(k[h]) for h in range(2)]
    codes = torch.from_numpy(np.stack([e.arrays["codes"] for e in encs])).to(DEV)
    gains = torch.from_numpy(np.stack([e.arrays["gains"] for e in encs])).to(DEV)
    qt = torch.tensor(q, dtype=torch.float32, device=DEV)
    out = nova_key_scores(qt, codes, gains, tables).cpu().numpy()
    for h in range(2):
        ref = nk.inner_product(q[h], encs[h])
        assert np.all(np.abs(out[h] - ref) <= nova_tolerance(q[h], head, encs[h], ref))
    np.testing.assert_array_equal(nova_key_scores(qt, codes, gains, head).cpu().numpy(), out)


def test_nova_refuses_mismatches(nova):
    gen, head, nk, tables = nova
    enc = nk.encode(sequence(gen, 1, 1, 20, 3)[0][1][0])
    codes, gains = torch.from_numpy(enc.arrays["codes"]).to(DEV), torch.from_numpy(enc.arrays["gains"]).to(DEV)
    q = torch.zeros((2, head.d), device=DEV)
    for exc, args in [(ValueError, (q[:, :-4], codes, gains, tables)), (ValueError, (q, codes[:, :-1], gains, tables)),
                      (ValueError, (q, codes, gains[:-1], tables)), (TypeError, (q, codes, gains.double(), tables)),
                      (TypeError, (q, codes.to(torch.int16), gains, tables)), (TypeError, (q, codes, gains, nk)),
                      (TypeError, (q.int(), codes, gains, tables))]:
        with pytest.raises(exc):
            nova_key_scores(*args)
    with pytest.raises(ValueError):
        nova_key_scores(q, codes, gains, tables, block_n=24)


# --- Hopper builds and the GPU -------------------------------------------------------------------------
def test_hopper_compile_registers_and_spills():
    """sm_90 builds of the NOVA kernels (under the interpreter in a fresh TRITON_INTERPRET=0 process,
    ``hopper.in_compile_process``); print registers and spills. The decode-attention kernels are
    checked at every benchmark configuration by ``test_static_report.py``."""
    nova = tnova.hopper_builds(d=128, m=4)
    for r in nova:
        print(r.summary())
        assert r.n_regs <= 255 and r.spill_stores == 0 and r.spill_loads == 0, r.summary()
        assert ".target sm_90a" in r.ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_long_cache_many_heads():
    """On a GPU (TRITON_INTERPRET=0): 2 x 8 KV heads over 4096 tokens, d = 128, default block sizes."""
    if INTERPRET:
        pytest.skip("kernels were created for the interpreter (run with TRITON_INTERPRET=0)")
    b, h, n, d, g = 2, 8, 4096, 128, 4
    kq, vq = TurboQuantMSE(d, 3, seed=1), TurboQuantMSE(d, 2, seed=2)
    data = [make_kv(n, d, g, seed=i) for i in range(b * h)]
    caches = [QuantizedKV.build(K, V, kq, vq, sink=4, window=64) for _, K, V in data]
    q = np.stack([x[0] for x in data])
    arrays, band = stacked(caches, (b, h), "cuda")
    out = decode_attention_mse(torch.tensor(q, dtype=torch.float32, device="cuda").reshape(b, h, g, d), *arrays,
                               kq, vq, table(d, 3), table(d, 2), band=band,
                               precision="ieee").cpu().numpy().reshape(b * h, g, d)
    for i, c in enumerate(caches):
        err = np.abs(out[i] - attention_decode(q[i], c)).max(axis=1)
        assert np.all(err <= mse_tolerance(q[i], c, kq, vq, 1 / math.sqrt(d)))


def test_nova_hand_built_tables_are_validated(nova):
    """Issue 53: a hand-built NovaKeyTables with a group index of 1e6 segfaulted the kernel (it
    gathers query coordinates at the group indices); every field is now checked before launch."""
    import dataclasses

    gen, head, nk, tables = nova
    enc = nk.encode(sequence(gen, 1, 1, 20, 3)[0][1][0])
    codes, gains = torch.from_numpy(enc.arrays["codes"]).to(DEV), torch.from_numpy(enc.arrays["gains"]).to(DEV)
    q = torch.zeros((2, head.d), device=DEV)
    far = tables.groups.clone()
    far[0, 0] = 10**6
    twice = tables.groups.clone()
    twice[0, 0] = twice[0, 1]
    nan = tables.centroids.clone()
    nan[0, 0, 0] = float("nan")
    for edit, exc, msg in [(dict(groups=far), ValueError, "index 1000000 is out of range"),
                           (dict(groups=twice), ValueError, "an index repeats"),
                           (dict(groups=tables.groups.long()), TypeError, "groups must be a torch.int32"),
                           (dict(centroids=nan), ValueError, "centroids holds NaN/Inf"),
                           (dict(centroids=tables.centroids[:, :-1].contiguous()), ValueError, "centroids must have shape"),
                           (dict(inverse=tables.inverse.t()), ValueError, "inverse must be contiguous"),
                           (dict(bits=0), ValueError, "bits must be a positive integer"),
                           (dict(g=True), ValueError, "g must be a positive integer")]:
        with pytest.raises(exc, match=msg):
            nova_key_scores(q, codes, gains, dataclasses.replace(tables, **edit))
    assert tables.check() is tables
