"""kvq_ref.uniform: the asymmetric min/max group quantizer shared by KIVI, QuaRot and QJL values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvq_ref.uniform import RESOLUTION, dequantize, group_range, quantize, stored_params

F16 = np.float16


def slow_rule(group_values: np.ndarray, bits: int, clip: float = 1.0):
    """The module docstring's rule for one group, written out with scalars (an independent spec)."""
    L = 2**bits - 1
    lo, hi = clip * float(np.min(group_values)), clip * float(np.max(group_values))

    def code(v, m, s):
        return math.floor((v - m) / s + 0.5)

    def scale_for(m):
        s = F16(max(hi - float(m), 0.0) / L)
        if s > 0 and code(hi, float(m), float(s)) < L:
            s = np.nextafter(s, F16(0))
        return s

    def flat(m, s):
        return L * float(s) <= RESOLUTION * max(abs(float(m)), abs(float(m) + L * float(s)))

    m = F16(lo) + F16(0)
    s = scale_for(m)
    if hi == lo or flat(m, s):
        s = F16(0)
    elif code(lo, float(m), float(s)) > 0:
        m = np.nextafter(m, F16(np.inf))
        s = scale_for(m)
        if flat(m, s):
            s = F16(0)
    codes = [0 if s == 0 else min(max(code(float(v), float(m), float(s)), 0), L) for v in group_values]
    return np.array(codes, np.uint8), s, m


def _groups(n, G):
    return [slice(a, min(a + G, n)) for a in range(0, n, G)]


# values with both ordinary and adversarial structure: offsets far larger than the spread
# (spread below the float16 step of the minimum), subnormal scales, exact float16 grids
@st.composite
def grouped_arrays(draw, max_rows=4, max_n=70):
    rows = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_n))
    G = draw(st.integers(1, 40))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0, 1000.0, -5000.0, 1e-3, 1e-6]))
    spread = draw(st.sampled_from([1e-9, 1e-6, 1e-4, 1e-2, 1.0, 30.0, 1000.0]))
    unit = draw(hnp.arrays(np.float64, (rows, n), elements=st.floats(-1, 1, allow_subnormal=False)))
    return offset + spread * unit, G


@given(grouped_arrays(), st.integers(1, 8))
def test_matches_the_written_rule_group_by_group(data, bits):
    x, G = data
    codes, s, m = quantize(x, bits, G)
    assert codes.dtype == np.uint8 and s.dtype == F16 and m.dtype == F16
    assert s.shape == m.shape == (x.shape[0], -(-x.shape[1] // G))
    for r in range(x.shape[0]):
        for g, sl in enumerate(_groups(x.shape[1], G)):
            c_ref, s_ref, m_ref = slow_rule(x[r, sl], bits)
            assert np.array_equal(codes[r, sl], c_ref)
            assert s[r, g] == s_ref and m[r, g] == m_ref


@given(grouped_arrays(), st.integers(1, 8))
def test_round_trip_error_bound(data, bits):
    """|x - x_hat| <= s/2 for codes 1..L-1; <= max(s/2, m - lo, hi - m - L s) for every element."""
    x, G = data
    L = 2**bits - 1
    codes, s, m = quantize(x, bits, G)
    err = np.abs(x - dequantize(codes, s, m, G))
    lo, hi = group_range(x, G)
    rep = lambda a: np.repeat(a.astype(np.float64), np.diff(np.append(np.arange(0, x.shape[1], G), x.shape[1])), axis=1)
    s64, m64, lo, hi = rep(s), rep(m), rep(lo), rep(hi)
    # float64 round-off of x - (m + s c): a few ulps of the operands
    tol = 4 * np.finfo(float).eps * (np.abs(x) + np.abs(m64) + L * s64)
    bound = np.maximum.reduce([s64 / 2, m64 - lo, hi - m64 - L * s64])
    assert np.all(err <= bound + tol)
    inner = (codes > 0) & (codes < L)
    assert np.all(err[inner] <= s64[inner] / 2 + tol[inner])


@given(grouped_arrays(), st.integers(1, 8), st.booleans())
def test_requantizing_the_dequantized_values_is_exact(data, bits, through_float32):
    """clip_ratio = 1: same codes, scales and minima, also after rounding the values to float32."""
    x, G = data
    codes, s, m = quantize(x, bits, G)
    y = dequantize(codes, s, m, G)
    if through_float32:
        y = y.astype(np.float32).astype(np.float64)
    c2, s2, m2 = quantize(y, bits, G)
    assert np.array_equal(c2, codes) and np.array_equal(s2, s) and np.array_equal(m2, m)


@given(st.integers(1, 8), st.integers(2, 50), st.data())
def test_values_on_a_float16_grid_are_reproduced_exactly(bits, G, data):
    """x = m + s c with float16 m, s, codes spanning 0..L, and a resolvable spread: stored as is."""
    L = 2**bits - 1
    m = F16(data.draw(st.floats(-100, 100, width=16)))
    s = F16(data.draw(st.floats(2.0**-10, 10, width=16)))
    c = np.array(data.draw(st.lists(st.integers(0, L), min_size=G - 2, max_size=G - 2)) + [0, L])
    x = float(m) + float(s) * c
    if L * float(s) <= RESOLUTION * max(abs(float(m)), abs(x.max())):
        return  # spread within one float16 step: stored as a constant by design (tested below)
    codes, s2, m2 = quantize(x[None], bits, G)
    assert np.array_equal(codes[0], c) and s2[0, 0] == s and m2[0, 0] == m
    assert np.array_equal(dequantize(codes, s2, m2, G)[0], x)


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -2.5, 1e-7, 3.14159, 65504.0, -65504.0])
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_constant_groups_store_scale_zero(value, bits):
    x = np.full((2, 10), value)
    codes, s, m = quantize(x, bits, 4)
    assert np.all(codes == 0) and np.all(s == 0) and np.all(m == F16(value))
    assert not np.signbit(m).any() or value < 0  # -0 is stored as +0
    y = dequantize(codes, s, m, 4)
    assert np.all(np.isfinite(y)) and np.all(y == float(F16(value)))


def test_spread_below_float16_resolution_is_a_constant():
    x = np.array([[1000.0, 1000.0 + 1e-3, 1000.0 + 2e-3]])  # float16 step at 1000 is 0.5
    codes, s, m = quantize(x, 4, 3)
    assert s[0, 0] == 0 and m[0, 0] == F16(1000.0) and np.all(codes == 0)


def test_minimum_raised_when_the_spread_is_finer_than_its_float16_step():
    """lo = 1000.24 rounds to 1000.0 (step 0.5); at 8 bits s ~ 0.39 < 2*0.24, so m -> 1000.5."""
    x = np.array([[1000.24, 1050.0, 1100.24]])
    codes, s, m = quantize(x, 8, 3)
    assert m[0, 0] == F16(1000.5) and codes[0, 0] == 0 and codes[0, 2] == 255
    assert abs(dequantize(codes, s, m, 3)[0, 0] - 1000.24) < 0.5


def test_subnormal_scale_lowered_so_the_maximum_takes_the_top_code():
    x = np.array([[0.0, 1e-4]])
    s_nearest = F16(1e-4 / 255)  # subnormal: 7 * 2^-24, 7% above 1e-4 / 255
    assert 1e-4 / float(s_nearest) + 0.5 < 255  # nearest rounding alone would miss code 255
    codes, s, m = quantize(x, 8, 2)
    assert s[0, 0] == np.nextafter(s_nearest, F16(0)) and codes[0, 1] == 255


def test_axis_and_short_last_group():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7, 3))
    codes, s, m = quantize(x, 3, 3, axis=1)
    assert s.shape == (5, 3, 3)
    ref_c, ref_s, ref_m = quantize(np.moveaxis(x, 1, -1), 3, 3, axis=-1)
    assert np.array_equal(np.moveaxis(codes, 1, -1), ref_c)
    assert np.array_equal(np.moveaxis(s, 1, -1), ref_s) and np.array_equal(np.moveaxis(m, 1, -1), ref_m)
    c_last, s_last, m_last = slow_rule(x[2, 6:, 1], 3)  # the one-element last group
    assert s_last == 0 and codes[2, 6, 1] == c_last[0] and m[2, 2, 1] == m_last


@given(st.integers(1, 8), st.floats(0.5, 0.99))
def test_clipping_scales_the_range(bits, clip):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((50, 64))
    codes, s, m = quantize(x, bits, 64, clip_ratio=clip)
    L = 2**bits - 1
    lo, hi = x.min(1), x.max(1)
    assert np.allclose(m[:, 0], clip * lo, rtol=2**-10)
    assert np.allclose(L * s[:, 0].astype(float), clip * (hi - lo), rtol=2**-9)
    assert np.all(codes[np.arange(50), x.argmin(1)] == 0) and np.all(codes[np.arange(50), x.argmax(1)] == L)


def test_uniform_error_law_at_high_rate():
    """Theory: interior rounding errors are ~ Uniform(-s/2, s/2): E[e/s] = 0, E[(e/s)^2] = 1/12."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4000, 32))
    codes, s, m = quantize(x, 8, 32)
    e = (x - dequantize(codes, s, m, 32)) / s.astype(float)
    keep = np.ones_like(e, bool)
    keep[np.arange(4000), x.argmin(1)] = keep[np.arange(4000), x.argmax(1)] = False  # exact ends
    u = e[keep]
    assert abs(u.mean()) < 4 * u.std() / math.sqrt(u.size)
    u2 = u**2
    assert abs(u2.mean() - 1 / 12) < 4 * u2.std() / math.sqrt(u2.size)


def test_zeros_and_empty_axis():
    codes, s, m = quantize(np.zeros((3, 8)), 2, 4)
    assert np.all(dequantize(codes, s, m, 4) == 0)
    codes, s, m = quantize(np.zeros((3, 0)), 2, 4)
    assert codes.shape == (3, 0) and s.shape == (3, 0) and dequantize(codes, s, m, 4).shape == (3, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=2.0), "bits"), (dict(bits=True), "bits"),
    (dict(group=0), "group"), (dict(group=1.5), "group"),
    (dict(clip_ratio=0.0), "clip_ratio"), (dict(clip_ratio=1.01), "clip_ratio"), (dict(clip_ratio="1"), "clip_ratio"),
])
def test_bad_parameters(kwargs, match):
    args = dict(bits=2, group=4) | kwargs
    with pytest.raises(ValueError, match=match):
        quantize(np.ones((2, 8)), **args)


def test_overflow_refused():
    with pytest.raises(ValueError, match="minima overflow"):
        quantize(np.array([[7e4, 8e4]]), 2, 2)
    with pytest.raises(ValueError, match="scales overflow"):
        quantize(np.array([[-6e4, 6e4]]), 1, 2)  # (max - min) / 1 = 1.2e5 > 65504
    with pytest.raises(ValueError, match="minima"):
        # fp16(65510) = 65504 < lo and s ~ 3.9 < 2 * 6, so step 5 raises m past 65504
        stored_params(np.array([65510.0]), np.array([66504.0]), 8)


def test_dequantize_refuses_mismatched_parameters():
    codes, s, m = quantize(np.ones((2, 8)), 2, 4)
    with pytest.raises(ValueError, match="shape"):
        dequantize(codes, s[:, :1], m, 4)
    with pytest.raises(ValueError, match="shape"):
        dequantize(codes, s, m, 3)
