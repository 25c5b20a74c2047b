"""KIVI against the official golden cases (``<interop>/kivi/golden*.json``).

Tolerance: none. Codes, packed words, float16 scales and minima, and both dequantizations are
compared bit for bit: the official rule is float16 arithmetic with one rounding per operation, which
kvq_ref.official reproduces operation by operation, and the kernel dequantization ``f32(scale * code
+ mn)`` is exact in float64 before its single rounding to float32 (facts.json: "bit-exact").
"""

from __future__ import annotations

import numpy as np
import pytest

from kvq_ref import KIVI
from kvq_ref.official import dequant_f16, dequant_kernel, minmax_f16
from kvq_ref.packing import unpack_codes

from .golden_format import golden_params, same_bits



@pytest.mark.parametrize("case,shared", golden_params("kivi", "quantizer"))
def test_quantizer(case, shared):
    p, x, out = case["params"], case["inputs"]["x_f16"], case["outputs"]
    role, bits, g = p["role"], p["bits"], p["group_size"]
    axis = -2 if role == "key" else -1
    codes, scale, mn = minmax_f16(x, bits, g, axis=axis)
    same_bits(codes, out["codes_u8"])
    same_bits(scale, out["scale_f16"])
    same_bits(mn, out["mn_f16"])
    same_bits(dequant_kernel(codes, scale, mn, g, axis), out["deq_kernel_f32"])
    same_bits(dequant_f16(codes, scale, mn, g, axis), out["deq_torch_ref_f16"])
    # the KIVI quantizer end to end: codes, bytes (the official int32 words), scales, minima, decode
    heads, t, d = x.shape
    q = KIVI(d, bits, role, group=g, residual=t, value_window="block")  # every token quantized
    enc = q.encode(x)
    a = enc.arrays
    words = out["packed_i32"].astype("<i4").view(np.uint8)  # little-endian bytes of the int32 words
    if role == "key":
        # ours (heads, T/G, D, G*b/8) along tokens; official (heads, D, T*b/32) words along tokens
        same_bits(a["codes"].transpose(0, 2, 1, 3).reshape(heads, d, -1), words.reshape(heads, d, -1))
        got = unpack_codes(a["codes"], bits, g).swapaxes(-1, -2).reshape(heads, t, d)
    else:
        same_bits(a["codes"], words.reshape(heads, t, -1))
        got = unpack_codes(a["codes"], bits, d)
    same_bits(got, out["codes_u8"])
    same_bits(a["scales"], out["scale_f16"])
    same_bits(a["minima"], out["mn_f16"])
    same_bits(q.decode(enc), out["deq_kernel_f32"])


@pytest.mark.parametrize("case,shared", golden_params("kivi", "cache"))
def test_cache(case, shared):
    p, out = case["params"], case["outputs"]
    T, P, R, g = p["tokens"], p["prefill_tokens"], p["residual_length"], p["group_size"]
    k, v = case["inputs"]["k_f16"], case["inputs"]["v_f16"]
    kq = KIVI(p["head_dim"], p["k_bits"], "key", group=g, residual=R)
    vq = KIVI(p["head_dim"], p["v_bits"], "value", group=g, residual=R)
    assert kq.split(T)[0] == out["n_key_quantized"] and vq.split(T)[0] == out["n_value_quantized"]
    same_bits(kq.decode(kq.encode(k)), out["k_read_f32"])
    same_bits(vq.decode(vq.encode(v)), out["v_read_f32"])
    # the streaming trace: the prefill reads all P tokens in float16; a decode step at n tokens reads
    # the ones not yet quantized before it, n - split(n - 1); after every step split(n) are quantized
    trace = out["trace_i32"]
    assert trace.shape == (T - P + 1, 5)
    for row in trace:
        n = int(row[0])
        before_k, before_v = (0, 0) if n == P else (kq.split(n - 1)[0], vq.split(n - 1)[0])
        assert tuple(row[1:]) == (n - before_k, n - before_v, kq.split(n)[0], vq.split(n)[0]), row
