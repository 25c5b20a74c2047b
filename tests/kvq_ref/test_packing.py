"""Bit packing: round trips, the documented bit order, corrupted padding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq_ref.packing import pack_codes, packed_size, unpack_codes


@given(st.integers(1, 8), st.integers(1, 97), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_round_trip_all_widths_and_odd_lengths(bits, k, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(rows, k), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (rows, packed_size(k, bits))
    assert packed.nbytes * 8 - rows * k * bits < 8 * rows  # at most one partial byte per row
    assert np.array_equal(unpack_codes(packed, bits, k), codes)


@given(st.integers(1, 8), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_bit_order_is_a_little_endian_stream(bits, k, seed):
    """Independent model: concatenate each code's bits LSB first, then read bytes LSB first."""
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=k)
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    expected = [sum(stream[8 * i + j] << j for j in range(8)) for i in range(len(stream) // 8)]
    assert pack_codes(codes, bits).tolist() == expected


def test_known_layouts():
    # 4-bit: element j at bits 4*(j%2) of byte j/2; 2-bit: element j at bits 2*(j%4) of byte j/4
    assert pack_codes(np.array([0x3, 0xA]), 4).tolist() == [0xA3]
    assert pack_codes(np.array([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    # 3-bit straddles: codes 7, 0, 5 -> stream 111 000 101 -> byte0 = 0b01000111, byte1 = 0b1
    assert pack_codes(np.array([7, 0, 5]), 3).tolist() == [0b01000111, 0b1]


def test_leading_dims_are_kept():
    codes = np.arange(2 * 3 * 10).reshape(2, 3, 10) % 8
    packed = pack_codes(codes, 3)
    assert packed.shape == (2, 3, 4)
    assert np.array_equal(unpack_codes(packed, 3, 10), codes)


def test_errors():
    with pytest.raises(ValueError, match="codes must be in 0..3"):
        pack_codes(np.array([4]), 2)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        pack_codes(np.array([0]), 9)
    with pytest.raises(ValueError, match="bytes per row"):
        unpack_codes(np.zeros((1, 3), np.uint8), 3, 10)
    bad = pack_codes(np.array([1, 2, 3]), 3)
    bad[-1] |= 0x80  # set a padding bit
    with pytest.raises(ValueError, match="padding bits"):
        unpack_codes(bad, 3, 3)
