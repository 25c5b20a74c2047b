"""Split-K decode attention of the CUDA fragment kernel (gpu.cuda.fragment_cache) against kvq_ref.

The CUDA source runs on the host emulation (g++, ``KVQ_CUDA_HOST_EMULATION=1``: warps of std::threads,
mma.sync/movmatrix/shuffles by the PTX fragment definitions, see gpu/cuda/host_emu.h), and on a GPU when
one is present (the ``cuda`` parameter). Every case compares each query row with
``kvq_ref.attention_decode`` of its sequence and KV head (a ``QuantizedKV`` whose encoded tokens were
written with ``write_rows``, band tokens in the 16-bit band) under ``mse_attention_tolerance`` with

    U_FRAG = 3 * 2^-11.

Derivation (the bound's model: every product and accumulated value carries a relative error <= u; Higham
and Mary's lambda = 6 for the sums, kvq_ref/testing/tolerances.py). Scores: the fp16 path rounds the
rotated query and the key level to float16 (2^-11 each, two per product; the query is first scaled by a
power of two so that it is never subnormal); the int8 keys at 2 bits use levels within eps <= 3.7e-4 of
the table (gpu.cuda.lookup.int8_levels, < 2^-11) times a query kept to 16 bits (2^-16), products exact in
int32. Values: p is rounded to float16, p times the float16 value norm rounded again (HMUL2), and the value
level is float16: three roundings of 2^-11 per product, the worst term, hence u = 3 * 2^-11. The tensor
cores' float32 accumulation (<= a few float32 ulps per add), MUFU.EX2 (2^-22) and the float32 softmax,
merge and inverse rotation are far below u. Float16/bfloat16 outputs add half an output ulp.

That bound is a guarantee but a loose one (it charges every product its worst case, times lambda
sqrt(d + 4)), so each sequence's output is also held to a statistical tier,
``||out - ref|| <= 6 sqrt(U_V^2 + R^2) ||ref||`` (Frobenius over the sequence's rows; ``fro_tier``).
Model: the roundings are independent and uniform, a float16 rounding has a relative standard deviation
<= 2^-11 / sqrt(3).
* Values: three roundings per product, U_V = 2^-11 together; a weighted sum of such products keeps the
  output's relative error at about that (no cancellation: the outputs are averages of values).
* Scores: two roundings per product q_i k_i (rotated query, key level; the int8 levels' error is
  smaller), so an encoded token's logit moves by sigma_t = scale 2^-11 sqrt(2/3) sqrt(sum_i (q_i k_i)^2)
  nats, and the output by sum_t w_t delta_t (v_t - o) to first order: R = sqrt(sum_t w_t^2 sigma_t^2
  ||v_t - o||^2) / ||o||. Where attention spreads over many tokens R is far below U_V; where a few
  large logits take it (logits of tens of nats), R is the larger term: the weights themselves move by
  sigma_t, which a tier of 6 * 2^-11 alone ignored (the property test found such cases: 4.2e-3 at
  d = 256 with keys growing along the sequence).
lambda = 6 standard deviations. Measured: at most 1.0e-3 on the fixed cases (1.9e-3 with bfloat16
outputs, whose half ulp is added). A wrong token (one value row's codes complemented, about 3 % of the
output) breaks it (``test_a_wrong_token_breaks_the_tier``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.cuda.binding import HOST_EMULATION_ENV
from gpu.cuda.fragment_cache import FragmentKVCache, append_fragment, fragment_decode_attention, write_rows
from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode
from kvq_ref.testing import mse_attention_tolerance
from tests.gpu.test_cuda import device  # noqa: F401  (the host-emulation / GPU backends fixture)

U_FRAG = 3 * 2.0**-11
U_V = 2.0**-11


def fro_tier(qs, c, scale) -> float:
    """The statistical tier of one sequence's rows ``qs (m, d)`` over ``c`` (module docstring):
    6 sqrt(U_V^2 + R^2), relative to ||ref||."""
    K, V = c.dequantized()
    enc = np.zeros(K.shape[0], bool)
    enc[c.middle] = True
    z = scale * qs @ K.T
    w = np.exp(z - z.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    o = w @ V
    sigma = np.zeros_like(z)  # band tokens: float32 throughout
    if enc.any():
        qk = np.abs(c.key_method.rot.apply(qs))[:, None, :] * np.abs(c.key_method.rot.apply(K[enc]))[None]
        sigma[:, enc] = scale * 2.0**-11 * math.sqrt(2 / 3) * np.sqrt((qk**2).sum(axis=2))
    spread = np.linalg.norm(V[None] - o[:, None], axis=2)  # ||v_t - o_r||
    r = math.sqrt(float(((w * sigma * spread) ** 2).sum())) / np.linalg.norm(o)
    return 6 * math.sqrt(U_V**2 + r**2)


def build(device, d, kb, vb, lengths, heads=2, sink=2, window=3, page_size=64, band_dtype=torch.float16, seed=0,
          ramp=0.0):
    """A cache of len(lengths) sequences with `lengths[b]` encoded tokens (plus sink + window band tokens)
    on shuffled pages; the kvq_ref caches, (batch, heads) of QuantizedKV. Keys are scaled by
    e^(ramp t / total) at position t (ramp > 0: scores grow along the sequence)."""
    km, vm = TurboQuantMSE(d, kb, seed=seed + 1), TurboQuantMSE(d, vb, seed=seed + 2, norm_correction=True)
    B = len(lengths)
    per_seq = max(1, -(-max(lengths) // page_size))
    cache = FragmentKVCache.allocate(km, vm, B, heads, num_pages=B * per_seq + 3, page_size=page_size,
                                     pages_per_seq=per_seq, band_capacity=max(1, sink + window), band_dtype=band_dtype)
    gen = torch.Generator().manual_seed(seed)
    cache.block_table.copy_(torch.randperm(cache.kv.shape[0], generator=gen)[:B * per_seq].reshape(B, per_seq)
                            .to(torch.int32))
    rng = np.random.default_rng(seed)
    ref = []
    for b, n in enumerate(lengths):
        row = []
        for h in range(heads):
            total = n + sink + window
            K, V = rng.standard_normal((2, total, d)) * np.exp(rng.uniform(-1, 1, (2, total, 1)))
            K = K * np.exp(ramp * np.arange(total) / total)[:, None]
            c = QuantizedKV.build(K, V, km, vm, sink, window)
            if c.keys is not None:
                write_rows(cache, b, h, c.keys.arrays["codes"], c.keys.arrays["norms"], c.values.arrays["codes"],
                           c.values.arrays["norms"])
            nb = c.band_keys.shape[0]
            cache.band_k[b, h, :nb] = torch.from_numpy(c.band_keys).to(band_dtype)
            cache.band_v[b, h, :nb] = torch.from_numpy(c.band_values).to(band_dtype)
            cache.band_lens[b] = nb
            row.append(c)
        ref.append(row)
    cache = FragmentKVCache(*[getattr(cache, f).to(device) if isinstance(getattr(cache, f), torch.Tensor)
                              else getattr(cache, f) for f in FragmentKVCache.__dataclass_fields__])
    return cache, ref


def check(cache, ref, q, out, scale=None, out_ulp=0.0):
    """Every query row within its mse_attention_tolerance at U_FRAG (module docstring); returns the
    largest error / tolerance ratio."""
    q = q.float().cpu().numpy().astype(np.float64)
    got = out.float().cpu().numpy()
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    worst = 0.0
    for b, row in enumerate(ref):
        for h, c in enumerate(row):
            if c.band_keys.shape[0] == 0 and c.keys is None:
                np.testing.assert_array_equal(got[b, :, h], 0)  # sees no token: exactly 0
                continue
            qs = q[b, :, h].reshape(-1, d)
            if c.band_keys.dtype != np.float16:
                raise AssertionError("kvq_ref keeps its band in float16")
            want = attention_decode(qs, c, scale=scale)
            tol = mse_attention_tolerance(qs, c, c.key_method, c.value_method, scale, u=U_FRAG)
            tol = tol + out_ulp * np.abs(want).max(axis=1)
            diff = got[b, :, h].reshape(-1, d) - want
            err = np.abs(diff).max(axis=1)
            assert (err <= tol).all(), (b, h, err, tol)
            fro = np.linalg.norm(diff) / np.linalg.norm(want)
            assert fro <= fro_tier(qs, c, scale) + out_ulp, (b, h, fro, fro_tier(qs, c, scale))
            worst = max(worst, float((err / tol).max()))
    return worst


def _q(B, T, H, G, d, seed=5, dtype=torch.float32):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((B, T, H, G, d)) * 2).to(dtype)


@pytest.mark.parametrize("splits", [1, 3, 40])
def test_split_counts_and_varying_lengths(device, splits):
    """300 and 173 tokens in pages of 64: one split, a few, more splits than tiles (empty splits);
    the shorter sequence ends in a partial tile (masked tokens)."""
    cache, ref = build(device, 128, 2, 2, [300, 173])
    q = _q(2, 1, 2, 4, 128).to(device)
    out = fragment_decode_attention(q, cache, splits=splits)
    worst = check(cache, ref, q, out)
    assert worst < 0.2
    # the merge launched plainly (not as a programmatic dependent of the split kernel): the same bytes
    assert torch.equal(out, fragment_decode_attention(q, cache, splits=splits, dependent_launch=False))


def test_many_splits_per_merge_thread(device):
    """2,100 tokens in 40 splits of 64 (33 of them non-empty): on the host emulation (2 groups of splits
    per merge CTA) a merge thread takes 20 partials in 2 batches of 16 (KVQ_MERGE_BATCH), the second holding
    the last non-empty split, whose keys are the largest: keys grow along the sequence (ramp), so the
    running maximum rises from batch to batch and every rescale of the sums matters (the
    merge without the rescale of its accumulator fails this test), and the shorter sequence leaves most
    splits empty (m = -inf)."""
    cache, ref = build(device, 64, 4, 4, [2100, 5], heads=1, page_size=32, seed=11, ramp=3.0)
    q = _q(2, 1, 1, 4, 64, seed=12).to(device)
    worst = check(cache, ref, q, fragment_decode_attention(q, cache, splits=40))
    assert worst < 0.2


# configurations other tests of this module build anyway (one g++ build each, cached)
_BUILT = [(128, 2, 2), (128, 3, 3), (128, 4, 4), (64, 2, 4), (64, 4, 4), (256, 3, 2)]


@settings(max_examples=12)
@given(cfg=st.sampled_from(_BUILT), lengths=st.lists(st.integers(0, 1200), min_size=1, max_size=2),
       rows=st.sampled_from([(1, 1), (1, 4), (1, 8), (2, 4), (4, 2)]), splits=st.one_of(st.none(), st.integers(1, 40)),
       page=st.sampled_from([32, 64]), band=st.sampled_from([(0, 0), (1, 0), (2, 3), (4, 130)]),
       ramp=st.sampled_from([0.0, 3.0]),
       seed=st.integers(0, 2**16))
def test_host_any_shape_matches_kvq_ref(cfg, lengths, rows, splits, page, band, ramp, seed):
    """The law kernel == reference over random shapes (host emulation): 1-2 sequences of 0-1200 encoded
    tokens, T G = 1..8 query rows, forced (1-40) or planned split counts (empty splits included; up to
    19 non-empty splits of 64 tokens; past 32 splits a merge thread passes over two batches of 16), pages
    of 32 or 64 tokens, no band, a sink, a sink and a window, or a band of 134 tokens over 3 band CTAs,
    scores flat or growing along the sequence. Every row within the module's tier; a sequence that sees
    no token gets exactly 0."""
    if not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("the host emulation needs g++ (>= 12)")
    d, kb, vb = cfg
    T, G = rows
    old = os.environ.get(HOST_EMULATION_ENV)
    os.environ[HOST_EMULATION_ENV] = "1"  # hypothesis forbids function-scoped fixtures (monkeypatch)
    try:
        cache, ref = build(torch.device("cpu"), d, kb, vb, lengths, heads=2, sink=band[0], window=band[1],
                           page_size=page, seed=seed, ramp=ramp)
        q = _q(len(lengths), T, 2, G, d, seed=seed + 1)
        check(cache, ref, q, fragment_decode_attention(q, cache, splits=splits))
    finally:
        if old is None:
            del os.environ[HOST_EMULATION_ENV]
        else:
            os.environ[HOST_EMULATION_ENV] = old


@pytest.mark.parametrize("d,kb,vb,G,T", [(128, 3, 3, 8, 1), (128, 4, 4, 2, 3), (64, 2, 4, 1, 1), (256, 3, 2, 8, 1)])
def test_bits_dims_and_groups(device, d, kb, vb, G, T):
    """head_dim 64/128/256, 2/3/4-bit keys and values (int8 keys at 2 bits), G = 1/2/8, T G <= 8 rows."""
    cache, ref = build(device, d, kb, vb, [97, 54], seed=d + kb)
    q = _q(2, T, 2, G, d, seed=kb).to(device)
    check(cache, ref, q, fragment_decode_attention(q, cache, splits=2))


def test_band_only_empty_and_masked(device):
    """A sequence with no encoded token (band only), one with a 17-token cache (one full tile and one
    token), and one that sees nothing at all (its output is exactly 0)."""
    cache, ref = build(device, 128, 4, 2, [0, 17, 0], sink=1, window=2)
    cache.band_lens[2] = 0
    ref[2] = [QuantizedKV.build(np.zeros((0, 128)), np.zeros((0, 128)), ref[0][0].key_method,
                                ref[0][0].value_method) for _ in range(2)]
    q = _q(3, 1, 2, 4, 128).to(device)
    check(cache, ref, q, fragment_decode_attention(q, cache, splits=5))


def test_long_band_spread_over_ctas(device):
    """A 4 + 200-token band (a 4,200 setting): 4 band CTAs of 64 slots each (the last one partly
    filled), merged with the splits. The third sequence is 66 tokens, all in its band: band CTAs 0
    and 1 hold 64 and 2 of them, CTAs 2 and 3 are past the band's length (m = -inf), and no split
    has a token."""
    cache, ref = build(torch.device("cpu"), 128, 3, 3, [700, 40, 0], sink=4, window=200, seed=21)
    assert cache.band_k.shape[2] == 204  # ceil(204 / 64) = 4 band CTAs
    rng = np.random.default_rng(23)
    km, vm = ref[0][0].key_method, ref[0][0].value_method
    for h in range(2):
        K, V = rng.standard_normal((2, 66, 128))
        c = QuantizedKV.build(K, V, km, vm, 4, 200)
        assert c.keys is None and c.band_keys.shape[0] == 66
        cache.band_k[2, h, :66] = torch.from_numpy(c.band_keys).to(cache.band_k.dtype)
        cache.band_v[2, h, :66] = torch.from_numpy(c.band_values).to(cache.band_v.dtype)
        ref[2][h] = c
    cache.band_lens[2] = 66
    cache = FragmentKVCache(*[getattr(cache, f).to(device) if isinstance(getattr(cache, f), torch.Tensor)
                              else getattr(cache, f) for f in FragmentKVCache.__dataclass_fields__])
    q = _q(3, 1, 2, 4, 128, seed=22).to(device)
    check(cache, ref, q, fragment_decode_attention(q, cache))
    check(cache, ref, q, fragment_decode_attention(q, cache, splits=3))


@pytest.mark.parametrize("qdtype,bdtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_16_bit_queries_and_band(device, qdtype, bdtype):
    """Output in q's dtype (half an output ulp more); a bfloat16 band is what kvq_ref's float16 band
    holds rounded to bfloat16, so the reference band is rounded the same way here."""
    cache, ref = build(device, 128, 3, 4, [150, 80], band_dtype=bdtype)
    if bdtype == torch.bfloat16:
        for b, row in enumerate(ref):
            for h, c in enumerate(row):
                bk = cache.band_k[b, h, :c.band_keys.shape[0]].float().cpu().numpy().astype(np.float16)
                bv = cache.band_v[b, h, :c.band_values.shape[0]].float().cpu().numpy().astype(np.float16)
                row[h] = QuantizedKV(c.n, c.d, c.sink, c.window, bk, bv, c.key_method, c.value_method, c.keys, c.values)
    q = _q(2, 1, 2, 4, 128).to(qdtype).to(device)
    out = fragment_decode_attention(q, cache)
    assert out.dtype == qdtype and out.shape == q.shape
    check(cache, ref, q, out, out_ulp=2.0**-9 if qdtype == torch.bfloat16 else 2.0**-12)


def test_append_then_attend(device):
    """append_fragment's cache (bit-exact codes, tests/gpu/test_cuda_fragment.py) read by the kernel."""
    km, vm = TurboQuantMSE(128, 2, seed=7), TurboQuantMSE(128, 3, seed=8)
    cache = FragmentKVCache.allocate(km, vm, 1, 2, num_pages=4, page_size=32, pages_per_seq=4, device=device)
    rng = np.random.default_rng(3)
    K, V = rng.standard_normal((2, 1, 100, 2, 128)).astype(np.float32)
    for a, b in ((0, 61), (61, 62), (62, 100)):
        append_fragment(cache, torch.from_numpy(K[:, a:b]).to(device), torch.from_numpy(V[:, a:b]).to(device))
    ref = [[QuantizedKV.build(K[0, :, h], V[0, :, h], km, vm) for h in range(2)]]
    q = _q(1, 1, 2, 4, 128).to(device)
    check(cache, ref, q, fragment_decode_attention(q, cache, max_seq_len=100))


def test_a_wrong_token_breaks_the_tier(device):
    """The tier has teeth: complementing one token's value codes (a layout or indexing slip) fails it."""
    cache, ref = build(device, 128, 4, 4, [64], heads=1, sink=0, window=0)
    q = _q(1, 1, 1, 4, 128).to(device)
    check(cache, ref, q, fragment_decode_attention(q, cache))
    c = ref[0][0]
    codes = c.values.arrays["codes"].copy()
    codes[40] = ~codes[40]  # the value codes of token 40, every one changed
    bad = dataclasses.replace(c, values=dataclasses.replace(c.values, arrays={**c.values.arrays, "codes": codes}))
    with pytest.raises(AssertionError):
        check(cache, [[bad]], q, fragment_decode_attention(q, cache))


def test_bad_arguments_are_refused(monkeypatch):
    monkeypatch.setenv(HOST_EMULATION_ENV, "1")
    km, vm = TurboQuantMSE(128, 2), TurboQuantMSE(128, 3)
    with pytest.raises(ValueError, match="power of two >= 32"):
        FragmentKVCache.allocate(km, vm, 1, 1, 2, 48, 1)
    with pytest.raises(ValueError, match="head_dim"):
        FragmentKVCache.allocate(TurboQuantMSE(96, 2), TurboQuantMSE(96, 2), 1, 1, 2, 32, 1)
    with pytest.raises(ValueError, match="2, 3 or 4 bits"):
        FragmentKVCache.allocate(TurboQuantMSE(128, 1), vm, 1, 1, 2, 32, 1)
    with pytest.raises(ValueError, match="Hadamard"):
        FragmentKVCache.allocate(TurboQuantMSE(128, 2, rotation="haar"), vm, 1, 1, 2, 32, 1)
    cache = FragmentKVCache.allocate(km, vm, 2, 2, 4, 32, 2)
    with pytest.raises(ValueError, match=r"T \* G must be <= 8"):
        fragment_decode_attention(torch.zeros(2, 3, 2, 3, 128), cache)
    with pytest.raises(ValueError, match="shape"):
        fragment_decode_attention(torch.zeros(2, 1, 3, 4, 128), cache)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        fragment_decode_attention(torch.zeros(2, 1, 2, 4, 128, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        fragment_decode_attention(torch.zeros(2, 1, 2, 4, 128), cache, max_seq_len=65)
    with pytest.raises(ValueError, match="finite"):
        fragment_decode_attention(torch.zeros(2, 1, 2, 4, 128), cache, scale=float("nan"))
    with pytest.raises(TypeError, match="dependent_launch must be a bool"):
        fragment_decode_attention(torch.zeros(2, 1, 2, 4, 128), cache, dependent_launch=1)
    with pytest.raises(TypeError, match="float16 or float32"):
        append_fragment(cache, torch.zeros(2, 1, 2, 128, dtype=torch.int32), torch.zeros(2, 1, 2, 128))
    with pytest.raises(ValueError, match="shape"):
        append_fragment(cache, torch.zeros(2, 1, 2, 64), torch.zeros(2, 1, 2, 64))
