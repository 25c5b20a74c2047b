"""The streaming simulation (``kvq_eval.hooks._simulate``) against its dense definition, and the
linearity in the query it rests on, for every registered method."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq_eval.hooks as hooks
from kvq_eval.band import Band
from kvq_eval.hooks import effective_keys
from kvq_eval.methods import METHODS, make_spec


def _spec(name, tables, band=None):
    info = METHODS[name]
    spec = make_spec(name, tables=tables if info.get("calibrated") or name.endswith("-mc") else None)
    if band is not None:
        spec = dataclasses.replace(spec, sink=band.sink, window=band.window)
    return spec


def test_scores_are_linear_in_the_query_for_every_method(small_tables):
    """``scores(prepare_query(q)) == q @ effective_keys.T`` for every registered key quantizer.

    Tolerance: both sides are float64 sums of 64 products (plus a rotation), |error| <= ~1e-13 of
    the largest score; 1e-10 leaves room and still fails for any nonlinearity (a query
    quantizer, a norm of q) by orders of magnitude.
    """
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 64)) * np.exp(rng.normal(0, 0.5, 64))
    qs = rng.standard_normal((7, 64)) * 3.0
    for name in METHODS:
        km = _spec(name, small_tables).key(0, 0, 64)
        enc = km.encode(x)
        direct = km.scores(km.prepare_query(qs), enc)
        keys = effective_keys(km, enc, 64)
        assert keys.shape == (40, 64) and keys.dtype == np.float64
        assert np.abs(qs @ keys.T - direct).max() <= 1e-10 * np.abs(direct).max(), name


def test_accumulate_is_weights_times_the_reconstruction_for_every_method(small_tables):
    """``accumulate(p) == p @ decode`` up to the float32 rounding of ``decode`` (2^-24 relative per
    element, summed with weights of total mass 1 per row: bound 1e-6 of the largest value)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 64)) * np.exp(rng.normal(0, 0.5, 64))
    p = rng.dirichlet(np.ones(40), size=5)
    for name in METHODS:
        vm = _spec(name, small_tables).value(0, 0, 64)
        enc = vm.encode(x)
        dec = vm.decode(enc).astype(np.float64)
        assert np.abs(p @ dec - vm.accumulate(p, enc)).max() <= 1e-6 * np.abs(dec).max(), name


CASES = [("identity", Band(0, 0)), ("tq_mse3", Band(0, 0)), ("tq_mse3", Band(4, 16)), ("tq_prod3", Band(3, 10)),
         ("kivi2", Band(0, 0)), ("kivi2", Band(2, 40)), ("qjl", Band(5, 7)), ("polarquant", Band(0, 33)),
         ("tq_split2.5", Band(8, 0)), ("quarot2_official", Band(4, 16)), ("nova", Band(0, 0)), ("nova", Band(6, 20)),
         ("oscar", Band(4, 16)), ("tq_mse4-mc", Band(4, 16))]


@pytest.mark.parametrize("kernel", ["flash", "dense"])
@pytest.mark.parametrize("sliding", [None, 45])
@pytest.mark.parametrize("name,band", CASES)
def test_fast_simulation_equals_the_dense_definition(small_tables, monkeypatch, name, band, sliding, kernel):
    """Blocks of 32 queries over 150 tokens (the last block partial), GQA 3:1, every band shape,
    with torch's flash kernel and with the matrix-product fallback: the middle/band split merged by
    log-sum-exp equals the dense definition.

    Tolerance: the fast form reads values through their float32 reconstruction where the dense
    one accumulates in float64 (see test above): 1e-6 of the largest output value.
    """
    monkeypatch.setattr(hooks, "QUERY_BLOCK", 32)
    if kernel == "dense":
        monkeypatch.setattr(hooks, "_partial_attention", hooks._dense_lse)
    elif hooks._FLASH is None:
        pytest.skip("this torch build has no CPU flash-attention kernel")
    spec = _spec(name, small_tables, band)
    rng = np.random.default_rng(4)
    t, d = 150, 64
    scale = torch.from_numpy(np.exp(rng.normal(0, 0.5, d)))
    query = torch.from_numpy(rng.standard_normal((1, 3, t, d))).float()
    key = (torch.from_numpy(rng.standard_normal((1, 1, t, d))) * scale + 0.5).float()
    value = torch.from_numpy(rng.standard_normal((1, 1, t, d))).float()
    module = SimpleNamespace(layer_idx=0, sliding_window=sliding)
    fast, _ = hooks._simulate(module, query, key, value, 0.125, spec)
    assert fast.shape == (1, t, 3, d) and fast.dtype == torch.float32
    ref = hooks.simulate_dense(module, query, key, value, 0.125, spec)[0]
    assert np.abs((fast - ref).numpy()).max() <= 1e-6 * np.abs(ref.numpy()).max()


@pytest.mark.parametrize("kv_block", [512, 16])
@pytest.mark.parametrize("name,band", [("tq_mse3", Band(0, 0)), ("kivi2", Band(2, 40)), ("tq_mse4", Band(4, 16))])
def test_sliding_layers_read_only_the_key_blocks_they_can_see(small_tables, monkeypatch, name, band, kv_block):
    """A sliding-window layer's query block reads keys from the block boundary before its first visible
    key (hooks.FLASH_KV_BLOCK; 16 here as well, to skip blocks at a small size): the result is the
    same bytes as reading every key from 0 (the skipped keys are masked for every row of the block),
    and no key it can see is skipped. 1,300 tokens, window 300, query blocks of 256, GQA 2:1."""
    if hooks._FLASH is None:
        pytest.skip("this torch build has no CPU flash-attention kernel")
    monkeypatch.setattr(hooks, "QUERY_BLOCK", 256)
    monkeypatch.setattr(hooks, "FLASH_KV_BLOCK", kv_block)
    spec = _spec(name, small_tables, band)
    rng = np.random.default_rng(6)
    t, d = 1300, 32
    query = torch.from_numpy(rng.standard_normal((1, 2, t, d))).float()
    key = torch.from_numpy(rng.standard_normal((1, 1, t, d)) * 2).float()
    value = torch.from_numpy(rng.standard_normal((1, 1, t, d))).float()
    module = SimpleNamespace(layer_idx=0, sliding_window=300)
    starts = [hooks._first_key_block(lo, 300) for lo in range(0, t, 256)]
    assert starts[0] == 0 and starts[-1] > 0 and all(s <= max(0, lo - 299) for s, lo in zip(starts, range(0, t, 256)))
    assert all(s % kv_block == 0 for s in starts) and hooks._first_key_block(700, None) == 0
    fast, _ = hooks._simulate(module, query, key, value, 0.2, spec)
    monkeypatch.setattr(hooks, "_first_key_block", lambda lo, sliding: 0)
    every, _ = hooks._simulate(module, query, key, value, 0.2, spec)
    assert torch.equal(fast, every)


@pytest.mark.parametrize("causal", [False, True])
def test_partial_attention_kernels_agree_and_empty_rows_are_neutral(causal):
    """The flash kernel and the fallback give the same output and log-sum-exp (float64: 1e-12),
    including rows with no allowed key (output 0, log-sum-exp -inf), which the flash kernel alone
    would report as log-sum-exp 0; merging a set with such rows leaves the other set's result."""
    if hooks._FLASH is None:
        pytest.skip("this torch build has no CPU flash-attention kernel")
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((3, 40, 16), (40, 16), (40, 16)))
    mask = torch.from_numpy(rng.random((40, 40)) < 0.4)
    mask[7] = False
    a = hooks._flash_lse(q, k, v, 0.3, causal=causal, mask=None if causal else mask)
    b = hooks._dense_lse(q, k, v, 0.3, causal=causal, mask=None if causal else mask)
    for x, y in zip(a, b):
        fin = torch.isfinite(y)
        assert torch.equal(fin, torch.isfinite(x)) and (x - y)[fin].abs().max() <= 1e-12
    if not causal:
        assert torch.isneginf(a[1][:, 7]).all() and (a[0][:, 7] == 0).all()
        other = hooks._dense_lse(q, k, v, 0.3, mask=~mask)
        merged = hooks._merge([a, other])
        assert torch.allclose(merged[:, 7], other[0][:, 7], rtol=0, atol=1e-12)
        full = hooks._dense_lse(q, k, v, 0.3)[0]
        assert torch.allclose(merged, full, rtol=0, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1.0, 30.0, 1e3]), masked=st.floats(0.0, 0.95))
def test_masked_softmax_in_place_is_bitwise_the_definition(rows, cols, seed, scale, masked):
    """``QuantizedCache.attend``'s in-place softmax gives the bits of the expression it replaced,
    ``_softmax(np.where(ok, z * scaling, -inf))``: the same elementwise operations and row
    reductions, so equality is exact (no tolerance). Every row keeps at least one allowed column,
    as a query always sees itself."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, cols)) * scale
    ok = rng.random((rows, cols)) >= masked
    ok[np.arange(rows), rng.integers(0, cols, rows)] = True
    want = hooks._softmax(np.where(ok, z * 0.125, -np.inf))
    got = hooks._masked_softmax(z.copy(), ok, 0.125)
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("name,d", [("tq_mse3", 64), ("tq_k5v3", 256), ("tq_mse2", 96), ("tq_prod3", 64)])
def test_the_fused_encode_path_stores_the_same_bytes(name, d, monkeypatch):
    """The quantized store (and the simulation) encode TurboQuantMSE with ``kvq_ref.fast``'s fused
    kernels; its codes, norms and decoded rows must be those of the spec path, byte for byte, for
    the key and value sides, a non-power-of-two head (96: blocks of 32 behind a permutation) and
    a method whose values only are TurboQuantMSE (tq_prod3)."""
    spec = make_spec(name)
    rng = np.random.default_rng(d)
    k = rng.standard_normal((2, 300, d)) * np.exp(rng.normal(0, 0.5, d))
    v = rng.standard_normal((2, 300, d))
    k[0, 7] = 0.0  # a zero key: norm 0, codes of the zero vector

    def store(fused):
        monkeypatch.setattr(hooks, "_fused", lambda q: fused and type(q) is hooks.TurboQuantMSE and q.rotation == "hadamard")
        s = hooks._Store(spec, 0, 2, d)
        s.write(k[:, :170], v[:, :170])
        s.write(k[:, 170:], v[:, 170:])  # a second call appends to the encoded arrays
        return s

    fast, slow = store(True), store(False)
    assert hooks._fused(spec.value(0, 0, d)) is False  # the patch is still in place: slow path
    for h in range(2):
        for a, b in ((fast.enc_k[h], slow.enc_k[h]), (fast.enc_v[h], slow.enc_v[h])):
            assert a.arrays.keys() == b.arrays.keys()
            for key in a.arrays:
                assert a.arrays[key].dtype == b.arrays[key].dtype and np.array_equal(a.arrays[key], b.arrays[key])
        for a, b in ((fast.dec_k[h], slow.dec_k[h]), (fast.dec_v[h], slow.dec_v[h])):
            assert np.array_equal(a.rows, b.rows)
    monkeypatch.undo()
    assert hooks._fused(spec.value(0, 0, d))  # and the real path does take the fused kernel
