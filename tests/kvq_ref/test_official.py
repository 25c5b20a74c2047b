"""kvq_ref.official.bf16_matmul: OSCAR's bfloat16 GEMM, float32 accumulation in index order.

Checked against the rule written as plain loops (every product exact in float32, one float32
rounding per addition, k = 0 first, then bfloat16); the fast path (float64 product plus an error
bound) must equal it everywhere, including entries next to a bfloat16 rounding midpoint.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvq_ref.official import bf16_matmul, to_bf16


def _loops(x, R) -> np.ndarray:
    xb, rb = to_bf16(x), to_bf16(R)
    out = np.zeros((xb.shape[0], rb.shape[1]), np.float32)
    for i in range(xb.shape[0]):
        acc = np.zeros(rb.shape[1], np.float32)
        for k in range(xb.shape[1]):
            acc = acc + np.float32(xb[i, k]) * rb[k]
        out[i] = acc
    return to_bf16(out)


def test_in_order_float32_not_the_exact_product():
    """Terms 2^10, 2^-23, -2^10, 1, 2^-8: exactly 1 + 2^-8 + 2^-23, above the bfloat16 midpoint
    1 + 2^-8, so the rounded exact product is 1 + 2^-7. Summed in order in float32, 2^-23 is lost
    against 2^10 and the sum is the midpoint itself, a tie that rounds to even: 1.0 (the hidden OSCAR
    value, row 7 column 52, was of this kind: 1.2e-8 above a midpoint, below it in float32)."""
    x = np.ones((1, 5), np.float32)
    R = np.array([[2.0**10], [2.0**-23], [-(2.0**10)], [1.0], [2.0**-8]], np.float32)
    assert bf16_matmul(x, R)[0, 0] == 1.0 == _loops(x, R)[0, 0]
    assert to_bf16(x.astype(np.float64) @ R.astype(np.float64))[0, 0] == 1.0078125  # the rule used before
    assert bf16_matmul(x, R[[0, 2, 3, 4, 1]])[0, 0] == 1.0078125  # 2^-23 added last: the order is the rule


@pytest.mark.parametrize("seed,d,scale", [(0, 128, 1.0), (1, 64, 1e-3), (2, 96, 30.0), (3, 128, 1e-36)])
def test_equals_the_loops(seed, d, scale):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((300, d)) * scale
    R = np.linalg.qr(rng.standard_normal((d, d)))[0]
    ours, loops = bf16_matmul(x, R), _loops(x, R)
    np.testing.assert_array_equal(ours.view(np.uint32), loops.view(np.uint32))
    if scale == 1.0:  # the order matters on ordinary data: some entries differ from the rounded exact product
        assert np.any(ours != to_bf16(to_bf16(x).astype(np.float64) @ to_bf16(R).astype(np.float64)))


def test_equals_the_loops_next_to_midpoints():
    """Entries built to sit on or next to bfloat16 midpoints (small dyadic sums with cancellation)."""
    rng = np.random.default_rng(5)
    x = to_bf16(rng.integers(-8, 9, (200, 32)) * 2.0 ** rng.integers(-9, 1, (200, 32)))
    R = to_bf16(rng.integers(-8, 9, (32, 24)) * 2.0 ** rng.integers(-12, 0, (32, 24)) + 2.0**-20)
    np.testing.assert_array_equal(bf16_matmul(x, R).view(np.uint32), _loops(x, R).view(np.uint32))
