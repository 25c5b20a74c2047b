"""kvq_ref.kivi: per-channel keys, per-token values, float16 residual tokens.

Most laws here are those of ``rule="exact"`` with ``value_window="block"`` (``ExactKIVI``); the official
defaults are checked bit for bit against KIVI's own code in tests/interop/test_kivi.py and for their
window and re-encoding laws at the end of this file.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvq_ref.common import Encoded
from kvq_ref.kivi import KIVI
from kvq_ref.packing import unpack_codes
from tests.kvq_ref.test_uniform import slow_rule

F16 = np.float16


def ExactKIVI(*args, **kw):
    """KIVI with our exact (idempotent) rule and the block value window."""
    return KIVI(*args, **{"rule": "exact", "value_window": "block", **kw})


def gaussian(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@st.composite
def configs_and_inputs(draw):
    role = draw(st.sampled_from(["key", "value"]))
    bits = draw(st.integers(1, 8))
    group = draw(st.sampled_from([1, 3, 8, 32]))
    residual = group * draw(st.integers(1, 4))
    dim = draw(st.integers(1, 40))
    n = draw(st.integers(1, 3 * residual + 5))
    lead = draw(st.sampled_from([(), (2,), (2, 1)]))
    offset = draw(st.sampled_from([0.0, 1.0, -700.0, 1e-4]))
    spread = draw(st.sampled_from([1e-7, 1e-3, 1.0, 50.0]))
    unit = draw(hnp.arrays(np.float64, lead + (n, dim), elements=st.floats(-1, 1)))
    return ExactKIVI(dim, bits, role, group, residual), offset + spread * unit


@given(configs_and_inputs())
def test_idempotent_exactly(case):
    q, x = case
    enc = q.encode(x)
    y = q.decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert q.idempotent and q.encode(y) == enc


@given(configs_and_inputs())
def test_rate_is_what_is_stored(case):
    q, x = case
    enc = q.encode(x)
    n, dim = x.shape[-2:]
    nq, nr = n - n % q.residual, n % q.residual
    rows = math.prod(x.shape[:-2])
    if q.role == "key":
        code_bits = (nq // q.group) * dim * 8 * math.ceil(q.group * q.bits / 8)
        side_bits = (nq // q.group) * dim * 32
    else:
        code_bits = nq * 8 * math.ceil(dim * q.bits / 8)
        side_bits = nq * math.ceil(dim / q.group) * 32
    total = rows * (code_bits + side_bits + nr * dim * 16)
    assert 8 * enc.nbytes == total
    assert enc.bits_per_element == 8 * enc.nbytes / enc.elements == total / x.size


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group", [8, 32, 64, 128])
def test_published_rate_when_n_is_a_multiple_of_residual(role, bits, group):
    q = ExactKIVI(128, bits, role, group, 128)
    for n in (128, 384):
        enc = q.encode(gaussian((2, n, 128)))
        assert enc.bits_per_element == bits + 32 / group
    assert KIVI(128).encode(gaussian((256, 128))).bits_per_element == 3.0  # 2 bits, G = 32


@pytest.mark.parametrize("role", ["key", "value"])
def test_residual_tokens_cost_16_bits(role):
    q = ExactKIVI(128, 2, role, 32, 128)
    enc = q.encode(gaussian((300, 128)))  # 256 quantized + 44 float16
    assert enc.bits_per_element == (256 * 3.0 + 44 * 16) / 300
    assert q.encode(gaussian((97, 128))).bits_per_element == 16.0


@pytest.mark.parametrize("role", ["key", "value"])
def test_residual_is_the_float16_input_and_only_the_prefix_is_quantized(role):
    q = ExactKIVI(16, 2, role, 4, 8)
    x = gaussian((3, 21, 16), 1)  # 16 quantized tokens, 5 residual
    enc = q.encode(x)
    y = q.decode(enc)
    assert np.array_equal(enc.arrays["residual"], x[:, 16:].astype(F16))
    assert np.array_equal(y[:, 16:], x[:, 16:].astype(F16).astype(np.float32))
    x2 = x.copy()
    x2[:, 16:] += 100.0  # residual tokens do not affect the quantized prefix
    assert np.array_equal(q.decode(q.encode(x2))[:, :16], y[:, :16])


def test_keys_are_grouped_per_channel_over_tokens():
    q = ExactKIVI(5, 3, "key", 4, 8)
    x = gaussian((16, 5), 2) * np.array([1, 10, 0.1, 3, 100])  # channel scales differ a lot
    enc = q.encode(x)
    codes = unpack_codes(enc.arrays["codes"], 3, 4)  # (groups, dim, tokens)
    for g in range(4):
        for j in range(5):
            c, s, m = slow_rule(x[4 * g:4 * g + 4, j], 3)
            assert np.array_equal(codes[g, j], c)
            assert enc.arrays["scales"][g, j] == s and enc.arrays["minima"][g, j] == m


def test_values_are_grouped_per_token_over_channels():
    q = ExactKIVI(10, 3, "value", 4, 8)  # groups of channels 0-3, 4-7, 8-9
    x = gaussian((8, 10), 3) * np.linspace(0.1, 10, 8)[:, None]  # token scales differ
    enc = q.encode(x)
    codes = unpack_codes(enc.arrays["codes"], 3, 10)
    for t in range(8):
        for g, sl in enumerate([slice(0, 4), slice(4, 8), slice(8, 10)]):
            c, s, m = slow_rule(x[t, sl], 3)
            assert np.array_equal(codes[t, sl], c)
            assert enc.arrays["scales"][t, g] == s and enc.arrays["minima"][t, g] == m


@pytest.mark.parametrize("role", ["key", "value"])
def test_error_matches_the_uniform_rounding_law(role):
    """Theory at 8 bits: errors of non-extreme entries ~ Uniform(-s/2, s/2), E[(e/s)^2] = 1/12."""
    q = ExactKIVI(64, 8, role, 32, 128)
    x = gaussian((4, 256, 64), 4)
    enc = q.encode(x)
    e = x - q.decode(enc)
    s = enc.arrays["scales"].astype(float)
    if role == "key":  # (4, 8 groups, 64) -> per token; extremes are per (group, channel)
        xs = x.reshape(4, 8, 32, 64)
        ext = (xs == xs.max(2, keepdims=True)) | (xs == xs.min(2, keepdims=True))
        u = (e.reshape(4, 8, 32, 64) / s[:, :, None, :])[~ext]
    else:
        xs = x.reshape(4, 256, 2, 32)
        ext = (xs == xs.max(3, keepdims=True)) | (xs == xs.min(3, keepdims=True))
        u = (e.reshape(4, 256, 2, 32) / s[:, :, :, None])[~ext]
    # float32 decode moves e by <= 2^-24 |x| ~ 3e-7 << s ~ 0.02: negligible against the SE
    u2 = u**2
    assert abs(u.mean()) < 4 * u.std() / math.sqrt(u.size)
    assert abs(u2.mean() - 1 / 12) < 4 * u2.std() / math.sqrt(u2.size)


@pytest.mark.parametrize("role", ["key", "value"])
def test_inner_product_is_against_the_decoded_vectors(role):
    q = ExactKIVI(32, 2, role, 8, 16)
    enc = q.encode(gaussian((2, 40, 32), 5))
    qs = gaussian((3, 32), 6)
    ip = q.inner_product(qs, enc)
    assert ip.shape == (3, 2, 40)
    assert np.allclose(ip, np.einsum("md,bnd->mbn", qs, q.decode(enc).astype(float)), rtol=1e-12, atol=1e-12)
    assert q.inner_product(qs[0], enc).shape == (2, 40)


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("n", [1, 54, 97])
def test_odd_token_counts_and_zero_vectors(role, n):
    q = ExactKIVI(24, 2, role, 8, 32)
    x = gaussian((3, n, 24), n)
    y = q.decode(q.encode(x))
    assert y.shape == x.shape and np.all(np.isfinite(y))
    nq = n - n % 32
    enc = q.encode(x)
    s = enc.arrays["scales"].astype(float)
    err = np.abs(x - y)[:, :nq]
    bound = (s.max() if s.size else 0) * 0.5 + 2e-3  # s/2 plus float16 rounding of m (|x| < 5)
    assert np.all(err <= bound)
    z = q.decode(q.encode(np.zeros((2, n, 24))))
    assert np.array_equal(z, np.zeros((2, n, 24), np.float32))


def _corruptions(enc):
    a = enc.arrays
    yield "missing", {k: v for k, v in a.items() if k != "scales"}
    yield "extra", a | {"norms": np.zeros(1, F16)}
    yield "dtype", a | {"scales": a["scales"].astype(np.float32)}
    yield "shape", a | {"codes": a["codes"][..., :-1]}
    yield "nan", a | {"minima": np.full_like(a["minima"], np.nan)}


@pytest.mark.parametrize("role", ["key", "value"])
def test_corrupted_encodings_are_refused(role):
    q = ExactKIVI(8, 3, role, 4, 8)
    enc = q.encode(gaussian((20, 8), 7))
    for what, arrays in _corruptions(enc):
        with pytest.raises(ValueError):
            q.decode(Encoded(enc.method, enc.config, enc.shape, arrays))
    with pytest.raises(ValueError, match="config"):
        ExactKIVI(8, 2, role, 4, 8).decode(enc)
    with pytest.raises(ValueError, match="made by"):
        q.decode(dataclasses.replace(enc, method="quarot"))
    with pytest.raises(ValueError):
        q.decode(dataclasses.replace(enc, shape=(21, 8)))


def test_set_padding_bits_are_refused():
    q = ExactKIVI(5, 3, "value", 4, 8)  # 15 bits per token: one padding bit per row
    enc = q.encode(gaussian((8, 5), 8))
    codes = enc.arrays["codes"].copy()
    codes[0, -1] |= 0x80
    with pytest.raises(ValueError, match="padding"):
        q.decode(dataclasses.replace(enc, arrays=enc.arrays | {"codes": codes}))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=0), "dim"), (dict(dim=4.0), "dim"), (dict(bits=0), "bits"), (dict(bits=9), "bits"),
    (dict(role="query"), "role"), (dict(group=0), "group"), (dict(residual=0), "residual"),
    (dict(group=32, residual=48), "residual"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExactKIVI(**(dict(dim=8) | kwargs))


def test_value_residual_need_not_be_a_multiple_of_group():
    assert ExactKIVI(8, role="value", group=32, residual=48).residual == 48


def test_bad_inputs():
    q = ExactKIVI(8, 2, "key", 4, 8)
    x = gaussian((8, 8))
    x[3, 2] = np.nan
    with pytest.raises(ValueError, match="x contains NaN"):
        q.encode(x)
    with pytest.raises(ValueError, match="last dimension 8"):
        q.encode(gaussian((8, 7)))
    with pytest.raises(ValueError, match="at least 2"):
        q.encode(gaussian(8))
    with pytest.raises(TypeError):
        q.encode(np.ones((8, 8), int))
    with pytest.raises(ValueError, match="overflow"):
        q.encode(np.full((3, 8), 1e6))  # residual tokens beyond float16


def test_float16_and_float32_inputs():
    x = gaussian((64, 16), 9)
    q = ExactKIVI(16, 4, "key", 8, 32)
    for dt in (np.float16, np.float32):
        assert q.encode(x.astype(dt)) == q.encode(x.astype(dt).astype(np.float64))


# --- the official defaults ----------------------------------------------------------------------------
@pytest.mark.parametrize("n,kept_k,kept_v", [(100, 100, 100), (128, 0, 128), (300, 44, 128), (301, 45, 128),
                                             (400, 16, 128)])
def test_default_windows_are_kivis(n, kept_k, kept_v):
    """Keys: the newest n mod R stay float16; values: the newest min(n, R), a sliding window."""
    x = gaussian((n, 32), 3)
    for role, kept in (("key", kept_k), ("value", kept_v)):
        q = KIVI(32, 2, role)
        assert q.split(n) == (n - kept, kept)
        enc = q.encode(x)
        assert np.array_equal(enc.arrays["residual"], x[n - kept:].astype(F16))
        assert np.array_equal(q.decode(enc)[n - kept:], x[n - kept:].astype(F16).astype(np.float32))
    assert ExactKIVI(32, 2, "value").split(300) == (256, 44)  # the block window keeps n mod R


def test_default_rule_is_float16_arithmetic_and_reencoding_moves_codes_by_at_most_one():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 256, 64)) * np.exp(rng.uniform(-3, 3, (1, 1, 64))) + rng.uniform(-5, 5, 64)
    for role in ("key", "value"):
        q = KIVI(64, 2, role, residual=128)
        assert not q.idempotent
        enc = q.encode(x)
        exact = ExactKIVI(64, 2, role, residual=128, value_window="sliding").encode(x)
        codes = lambda e: unpack_codes(e.arrays["codes"], 2, e.arrays["codes"].shape[-1] * 4)
        a, b = codes(enc).astype(int), codes(exact).astype(int)
        assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 0.02  # the two rules differ only near boundaries
        again = codes(q.encode(q.decode(enc))).astype(int)
        assert np.abs(again - a).max() <= 1
        err = q.decode(enc) - x
        scale = np.repeat(enc.arrays["scales"].astype(np.float64), 32, axis=-2 if role == "key" else -1)
        nq = q.split(256)[0]
        # half a step, plus the float16 roundings of x, x - mn and (x - mn)/scale (each <= 2^-11 relative,
        # of values <= L * scale = 3 * scale) and of the decoded float32
        slack = 2.0**-11 * (np.abs(x[..., :nq, :]) + 2 * 3 * scale) + 1e-6
        assert np.all(np.abs(err[..., :nq, :]) <= 0.5 * scale + slack)


def test_constant_group_official_rule_decodes_to_its_float16_value():
    x = np.full((64, 8), 0.3)
    for role in ("key", "value"):
        q = KIVI(8, 2, role, group=8, residual=64, value_window="block")
        enc = q.encode(x)
        assert np.all(enc.arrays["scales"] == 0)
        assert np.array_equal(q.decode(enc), np.full((64, 8), F16(0.3), np.float32))


def test_official_rule_refuses_value_groups_that_do_not_divide_dim():
    with pytest.raises(ValueError, match="divide dim"):
        KIVI(10, 2, "value", group=4)
    with pytest.raises(ValueError, match="rule"):
        KIVI(8, rule="float16")
    with pytest.raises(ValueError, match="value_window"):
        KIVI(8, value_window="fixed")
