"""Split-sequence decode attention and the paged cache (gpu.triton.paged / gpu.triton.cache) against kvq_ref.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (conftest); with ``TRITON_INTERPRET=0`` on a CUDA
machine the same tests run on the GPU. Tolerances are ``mse_tolerance`` of
``tests/gpu/test_triton_attention.py`` (float32 rounding, Higham-Mary lambda = 6), with two stated
extensions:

* ``precision="fp16"`` (the tensor-core default) rounds the dot operands to float16: the rotated
  query, the levels, the band query and ``p * norm`` (relative ``2^-11`` each, two per product). In
  the bound's model every product and every accumulated value then carries a relative error of at
  most ``2 * 2^-11``, so the same formula holds with ``u = 2^-10`` in place of ``2^-24``.
* Outputs stored as bfloat16/float16 add one output ulp, ``u_out |ref|`` with ``u_out`` = 2^-7 / 2^-10
  (the interpreter truncates float32 to bfloat16, the GPU rounds to nearest: half of that).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gpu.triton import paged  # noqa: E402
from gpu.triton.cache import PagedKVCache, append_band, append_encoded, paged_decode_attention  # noqa: E402
from gpu.triton.paged import H200_SMS, MIN_CHUNK, plan_splits  # noqa: E402
from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode  # noqa: E402
from tests.gpu.test_triton_attention import DEV, INTERPRET, make_case, mse_tolerance, run_mse, table  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")
U16_DOT = 2.0**-10  # fp16 operands: two float16 roundings per product (module docstring)


# --- split planning --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [32768, 131072])
@pytest.mark.parametrize("batch", [1, 16])
def test_plan_gives_two_to_four_waves_at_low_batch(n, batch):
    for block_n in (16, 64, 128):
        plan = plan_splits(batch, 8, n, block_n, num_sms=132)
        assert 2.0 <= plan.waves <= 4.0, plan
        assert plan.chunk % block_n == 0 and plan.chunk >= MIN_CHUNK
        assert (plan.splits - 1) * plan.chunk < n <= plan.splits * plan.chunk  # no split is empty by plan


def test_plan_does_not_over_split():
    assert plan_splits(64, 8, 131072, 64, num_sms=132).splits == 1          # 512 programs: 3.9 waves already
    for base in range(1, 1200):  # any batch x heads: at most 4 waves unless one split alone is more
        plan = plan_splits(base, 1, 131072, 64, num_sms=132)
        assert plan.waves <= max(4.0, base / 132), (base, plan)
        assert plan.splits in (1, paged.MAX_SPLITS) or plan.waves >= 2.0, (base, plan)
    short = plan_splits(1, 8, 4096, 64, num_sms=132)                         # short context: >= 256 tokens a split
    assert short.splits == 4096 // MIN_CHUNK and short.chunk == MIN_CHUNK
    assert plan_splits(1, 1, 10, 16, num_sms=132).splits == 1
    assert plan_splits(1, 1, 0, 16, num_sms=132).splits == 1                # empty cache: one (empty) split
    many = plan_splits(1, 1, 100, 16, num_sms=132, splits=40)               # forced: past the last tile, empty
    assert many.splits == 40 and many.chunk == 16


def test_plan_without_gpu_targets_an_h200():
    if torch.cuda.is_available() and not INTERPRET:
        pytest.skip("a GPU is present: the plan uses its SM count")
    assert plan_splits(1, 8, 131072, 64) == plan_splits(1, 8, 131072, 64, num_sms=H200_SMS)
    assert H200_SMS == 132


@pytest.mark.parametrize("bad", [dict(batch=0), dict(kv_heads=-1), dict(block_n=0), dict(max_len=-5),
                                 dict(splits=0), dict(splits=2.5)])
def test_plan_rejects_bad_input(bad):
    args = dict(batch=1, kv_heads=8, max_len=1000, block_n=16) | bad
    with pytest.raises(ValueError):
        plan_splits(**args)


# --- split counts, contiguous API -------------------------------------------------------------------
@pytest.mark.parametrize("splits", [1, 2, 5, 18, 40])
def test_split_counts_match_kvq_ref(splits):
    """280 encoded tokens in 18 tiles of 16: 1 split, a few, one per tile, more splits than tiles."""
    q, cache, kq, vq = make_case(300, 64, 4, (3, 2), (4, 16), seed=11)
    ref = attention_decode(q, cache)
    out = run_mse(q, cache, kq, vq, block_n=16, block_band=16, splits=splits, precision="ieee")
    tol = mse_tolerance(q, cache, kq, vq, 1 / math.sqrt(64))
    assert np.all(np.abs(out - ref).max(axis=1) <= tol)


def test_fp16_precision_tier():
    """The tensor-core default rounds dot operands to float16 (module docstring: u = 2^-10)."""
    for d, bits in ((128, (4, 4)), (96, (2, 3))):
        q, cache, kq, vq = make_case(200, d, 8, bits, (2, 8), seed=d)
        ref = attention_decode(q, cache)
        out = run_mse(q, cache, kq, vq, precision="fp16", splits=3, block_n=32)
        tol = mse_tolerance(q, cache, kq, vq, 1 / math.sqrt(d), u=U16_DOT)
        err = np.abs(out - ref).max(axis=1)
        assert np.all(err <= tol), (err, tol)
        assert err.max() > 0  # it did round: the tier is not the float32 path


@pytest.mark.parametrize("d", [80, 192, 256])  # tables exist for d in 16..1024 (80, 192: non-powers of 2)
def test_awkward_dims_and_groups(d):
    for g, bits in ((1, (2, 4)), (8, (3, 3))):
        q, cache, kq, vq = make_case(150, d, g, bits, (0, 4), seed=d + g)
        ref = attention_decode(q, cache)
        out = run_mse(q, cache, kq, vq, precision="ieee", splits=4, block_n=16)
        assert np.all(np.abs(out - ref).max(axis=1) <= mse_tolerance(q, cache, kq, vq, 1 / math.sqrt(d)))


# --- paged cache ------------------------------------------------------------------------------------
def _fill(cache, K, V, kt, vt, chunks):
    """Append rows K/V (B, n, H, d) in the given chunk sizes (appends cross page boundaries)."""
    start = 0
    for c in chunks:
        append_encoded(cache, torch.from_numpy(K[:, start:start + c]).to(DEV),
                       torch.from_numpy(V[:, start:start + c]).to(DEV), kt, vt)
        start += c


def _shuffled_cache(kq, vq, B, H, pages_per_seq, page_size, seed, **kw):
    cache = PagedKVCache.allocate(kq, vq, B, H, num_pages=B * pages_per_seq + 3, page_size=page_size,
                                  pages_per_seq=pages_per_seq, device=DEV, **kw)
    pages = torch.from_numpy(np.random.default_rng(seed).permutation(B * pages_per_seq + 3)[:B * pages_per_seq])
    cache.block_table.copy_(pages.to(torch.int32).reshape(B, pages_per_seq))
    return cache


def _read_slots(cache, b, h, n, which):
    """Codes/norms of sequence b, head h, tokens 0..n-1 read back through the block table."""
    codes, norms = (cache.k_codes, cache.k_norms) if which == "k" else (cache.v_codes, cache.v_norms)
    t = np.arange(n)
    pages = cache.block_table[b].cpu().numpy()[t // cache.page_size]
    return codes[pages, h, t % cache.page_size].cpu().numpy(), norms[pages, h, t % cache.page_size].cpu().numpy()


def test_paged_varying_lengths_shuffled_pages_and_appends():
    """Two sequences of 75 and 37 tokens in shuffled pages of 16, appended in chunks of 5, 30, 40;
    codes and norms bit-exact with kvq_ref's encode, attention within the float32 bound."""
    d, H, G = 64, 2, 4
    kq, vq = TurboQuantMSE(d, 4, seed=3), TurboQuantMSE(d, 2, seed=4)
    kt, vt = table(d, 4), table(d, 2)
    rng = np.random.default_rng(5)
    K, V = rng.standard_normal((2, 2, 75, H, d)).astype(np.float32)
    cache = _shuffled_cache(kq, vq, 2, H, 5, 16, seed=1)
    _fill(cache, K, V, kt, vt, (5, 30, 40))
    # sequence 1 is shorter: drop its tail by its length (the kernel never reads past seq_lens)
    cache.seq_lens.copy_(torch.tensor([75, 37], dtype=torch.int32))
    lens = (75, 37)
    for b in range(2):
        for h in range(H):
            for which, x, m in (("k", K, kq), ("v", V, vq)):
                codes, norms = _read_slots(cache, b, h, lens[b], which)
                enc = m.encode(x[b, :lens[b], h])
                nb = enc.arrays["codes"].shape[1]
                np.testing.assert_array_equal(codes[:, :nb], enc.arrays["codes"])
                assert not codes[:, nb:].any()  # row padding stays zero
                np.testing.assert_array_equal(norms, enc.arrays["norms"])
    q = (2 * rng.standard_normal((2, 1, H, G, d))).astype(np.float32)
    out = paged_decode_attention(torch.from_numpy(q).to(DEV), cache, kt, vt, precision="ieee", splits=3,
                                 block_n=16).cpu().numpy()
    for b in range(2):
        for h in range(H):
            qc = QuantizedKV.build(K[b, :lens[b], h].astype(np.float64), V[b, :lens[b], h].astype(np.float64),
                                   kq, vq, sink=0, window=0)
            qq = q[b, 0, h].astype(np.float64)
            err = np.abs(out[b, 0, h] - attention_decode(qq, qc)).max(axis=1)
            assert np.all(err <= mse_tolerance(qq, qc, kq, vq, 1 / math.sqrt(d)))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tuning_variants_change_no_result(bits):
    """The schedules of ``gpu/sweep.py`` (prefetching the next tile or not, Triton's pipelining depth,
    tile and warp counts) give the same output as the default and stay within the fp16-tier bound of
    kvq_ref: sequences of 75 and 37 tokens over tiles of 16 (a partial last tile, a next tile past
    the end). Prefetching reorders loads only, so it is bit-identical."""
    from gpu.sweep import VARIANTS, run_variant

    d, H, G = 64, 2, 4
    kq, vq = TurboQuantMSE(d, bits, seed=3), TurboQuantMSE(d, bits, seed=4)
    kt = table(d, bits)
    rng = np.random.default_rng(bits)
    K, V = rng.standard_normal((2, 2, 75, H, d)).astype(np.float32)
    cache = _shuffled_cache(kq, vq, 2, H, 5, 16, seed=2)
    _fill(cache, K, V, kt, kt, (75,))
    cache.seq_lens.copy_(torch.tensor([75, 37], dtype=torch.int32))
    q = torch.from_numpy((2 * rng.standard_normal((2, 1, H, G, d))).astype(np.float32)).to(DEV)
    by_name = {v[0]: v for v in VARIANTS}
    outs = {name: run_variant(q, cache, kt, by_name[name], 75).cpu().numpy()
            for name in ("default", "prefetch", "no_prefetch", "stages1", "bn64_w2")}
    np.testing.assert_array_equal(outs["prefetch"], outs["no_prefetch"])
    np.testing.assert_array_equal(outs["default"], outs["prefetch" if bits <= 2 else "no_prefetch"])
    for b, n in enumerate((75, 37)):
        for h in range(H):
            qc = QuantizedKV.build(K[b, :n, h].astype(np.float64), V[b, :n, h].astype(np.float64), kq, vq,
                                   sink=0, window=0)
            qq = q[b, 0, h].cpu().numpy().astype(np.float64)
            tol = mse_tolerance(qq, qc, kq, vq, 1 / math.sqrt(d), u=U16_DOT)
            for out in outs.values():
                assert np.all(np.abs(out[b, 0, h] - attention_decode(qq, qc)).max(axis=1) <= tol)


def _sliding(dtype, n=20, sink=2, window=6, d=64, H=2, G=2, T=1, seed=0):
    """A sliding-window cache fed token by token: positions < sink and the last window positions in
    the band (ring slots wrap twice for n=20), positions in between appended to pages as they leave
    the window. Inputs rounded to ``dtype`` (so the float16 reference band holds the same values)."""
    kq, vq = TurboQuantMSE(d, 3, seed=1), TurboQuantMSE(d, 3, seed=2)
    kt, vt = table(d, 3), table(d, 3)
    rng = np.random.default_rng(seed)
    K, V = (torch.from_numpy(rng.standard_normal((2, 1, n, H, d))).to(dtype).double().numpy())
    cache = _shuffled_cache(kq, vq, 1, H, 2, 16, seed=seed, band_capacity=sink + window, band_dtype=dtype)
    cache.enc_pos0.fill_(sink)
    for p in range(n):
        if p >= sink + window:  # token p - window leaves the ring: quantize it into the pages
            old = p - window
            append_encoded(cache, torch.from_numpy(K[:, old:old + 1]).to(DEV, dtype),
                           torch.from_numpy(V[:, old:old + 1]).to(DEV, dtype), kt, vt)
        append_band(cache, torch.from_numpy(K[:, p:p + 1]).to(DEV, dtype),
                    torch.from_numpy(V[:, p:p + 1]).to(DEV, dtype), torch.tensor([[p]]), sink, window)
    return cache, K[0], V[0], kq, vq, kt, vt


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ring_band_wraps_and_matches_kvq_ref(dtype):
    n, sink, window, H, G, d = 20, 2, 6, 2, 2, 64
    cache, K, V, kq, vq, kt, vt = _sliding(dtype, n, sink, window, d, H, G)
    assert cache.seq_lens.tolist() == [n - sink - window] and cache.band_lens.tolist() == [sink + window]
    assert sorted(cache.band_pos[0].tolist()) == [0, 1, *range(n - window, n)]
    rng = np.random.default_rng(9)
    q = torch.from_numpy(2 * rng.standard_normal((1, 1, H, G, d))).to(dtype)
    out = paged_decode_attention(q.to(DEV), cache, kt, vt, precision="ieee").float().cpu().numpy()
    assert out.dtype == np.float32 and not np.isnan(out).any()
    u_out = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one output ulp (module docstring)
    for h in range(H):
        qc = QuantizedKV.build(K[:, h], V[:, h], kq, vq, sink=sink, window=window)
        qq = q[0, 0, h].double().numpy()
        ref = attention_decode(qq, qc)
        tol = mse_tolerance(qq, qc, kq, vq, 1 / math.sqrt(d)) + u_out * np.abs(ref).max(axis=1)
        assert np.all(np.abs(out[0, 0, h] - ref).max(axis=1) <= tol)


def test_multi_token_causal_queries():
    """Three query tokens at positions n-3, n-2, n-1: token i sees the cache up to its position
    (reference: the QuantizedKV of the first n-2+i tokens, same middle tokens, shorter window)."""
    n, sink, window, H, G, d, T = 20, 2, 6, 2, 2, 64, 3
    cache, K, V, kq, vq, kt, vt = _sliding(torch.float16, n, sink, window, d, H, G)
    rng = np.random.default_rng(10)
    q = (2 * rng.standard_normal((1, T, H, G, d))).astype(np.float32)
    qpos = torch.tensor([[n - 3, n - 2, n - 1]], dtype=torch.int32, device=DEV)
    out = paged_decode_attention(torch.from_numpy(q).to(DEV), cache, kt, vt, q_pos=qpos, precision="ieee",
                                 splits=2, block_n=16).cpu().numpy()
    for i in range(T):
        m = n - T + i + 1
        for h in range(H):
            qc = QuantizedKV.build(K[:m, h], V[:m, h], kq, vq, sink=sink, window=window - (n - m))
            qq = q[0, i, h].astype(np.float64)
            err = np.abs(out[0, i, h] - attention_decode(qq, qc)).max(axis=1)
            assert np.all(err <= mse_tolerance(qq, qc, kq, vq, 1 / math.sqrt(d)))


def test_query_that_sees_nothing_gets_zero_not_nan():
    """Causal position before every cached token: every split and tile fully masked."""
    cache, *_, kt, vt = _sliding(torch.float16, 12, 2, 4, 64, 1, 1)
    cache.enc_pos0.fill_(5)
    cache.band_pos.add_(5)
    q = torch.randn(1, 2, 1, 1, 64, device=DEV)
    out = paged_decode_attention(q, cache, kt, vt, q_pos=torch.tensor([[-1, 4]], dtype=torch.int32, device=DEV),
                                 splits=4, block_n=16)
    assert torch.all(out == 0) and not torch.isnan(out).any()


def test_band_without_a_ring_keeps_only_the_sink():
    """window = 0: positions past the sink have no slot (not stored, no length past the sink); the
    sink rows land in slots 0..sink-1 as given (float32 rows rounded to the band's float16)."""
    d, H = 64, 2
    kq = TurboQuantMSE(d, 2, seed=1)
    cache = _shuffled_cache(kq, kq, 1, H, 1, 16, seed=0, band_capacity=4)
    rng = np.random.default_rng(0)
    k, v = (torch.from_numpy(rng.standard_normal((1, 6, H, d)).astype(np.float32)).to(DEV) for _ in range(2))
    append_band(cache, k, v, torch.arange(6).reshape(1, 6), sink=4, window=0)
    assert cache.band_lens.tolist() == [4]
    assert cache.band_pos[0, :4].tolist() == [0, 1, 2, 3]
    assert torch.equal(cache.band_k[0, :, :4].cpu(), k[0, :4].transpose(0, 1).to(torch.float16).cpu())
    assert torch.equal(cache.band_v[0, :, :4].cpu(), v[0, :4].transpose(0, 1).to(torch.float16).cpu())
    with pytest.raises(TypeError, match="integer"):
        append_band(cache, k, v, torch.zeros((1, 6)), sink=4, window=0)


def test_paged_refuses_bad_input():
    cache, *_, kt, vt = _sliding(torch.float16, 12, 2, 4, 64, 2, 2)
    q = torch.randn(1, 1, 2, 2, 64, device=DEV)
    bad = [(ValueError, dict(q=q[..., :32])), (TypeError, dict(q=q.double())), (ValueError, dict(q=q[:, :, :1])),
           (TypeError, dict(cache="cache")), (TypeError, dict(ktable=kt.levels32)),
           (TypeError, dict(q_pos=torch.zeros((1, 1), dtype=torch.int64, device=DEV))),
           (ValueError, dict(q_pos=torch.zeros((1, 2), dtype=torch.int32, device=DEV))),
           (ValueError, dict(precision="bf16")), (ValueError, dict(max_seq_len=10**6)),
           (ValueError, dict(scale=float("inf"))), (ValueError, dict(block_n=24))]
    good = dict(q=q, cache=cache, ktable=kt, vtable=vt)
    for exc, change in bad:
        with pytest.raises(exc):
            args = good | change
            paged_decode_attention(args.pop("q"), args.pop("cache"), args.pop("ktable"), args.pop("vtable"), **args)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache.allocate(cache.key_method, cache.value_method, 1, 1, 4, 24, 2)
    with pytest.raises(ValueError, match="float16 norms"):
        kq32 = TurboQuantMSE(64, 3, seed=1, norm_dtype="float32")
        c32 = PagedKVCache.allocate(kq32, kq32, 1, 2, 4, 16, 2, band_capacity=2, device=DEV)
        paged_decode_attention(q, c32, kt, kt, precision="fp16")
    with pytest.raises(ValueError, match="shape"):
        append_encoded(cache, q[:, :, :, 0], q[:, :, :, 0, :32], kt, vt)


def test_symmetric_tables_take_the_magnitude_path():
    """4-bit Lloyd-Max tables are exactly symmetric in float32: the kernel gets 8 magnitudes (the
    tests above with 4-bit keys or values run that path); 2- and 3-bit tables keep the full tree."""
    from gpu.triton.attention import kernel_params
    for d in (64, 128, 256):
        p4 = kernel_params(TurboQuantMSE(d, 4), table(d, 4), DEV)
        lev = np.asarray(table(d, 4).codebook.levels, dtype=np.float32)
        assert p4.sym and p4.levels[:8] == tuple(float(x) for x in lev[8:]) and p4.levels[8:] == (0.0,) * 8
        assert not kernel_params(TurboQuantMSE(d, 2), table(d, 2), DEV).sym


def test_row_layout_helpers():
    # words read per row: ceil(d bits / 32), whole 96-bit groups of 32 codes at 3 bits; rows of 16 B
    assert [paged.row_words(128, b) for b in (2, 3, 4)] == [8, 12, 16]
    assert [paged.row_words(54, b) for b in (2, 3, 4)] == [4, 6, 7]
    assert [paged.row_bytes_for(54, b) for b in (2, 3, 4)] == [16, 32, 32]
