"""QuaRot against the official golden cases (``<interop>/quarot/golden*.json``).

Tolerance: none (facts.json: codes, scales, zeros and outputs bit-exact given y_f16; y from x
bit-exact with the exact product rounded once to float16 on the golden data). The paths: the INT
KV-cache kernel (``kernel_b*``, the QuaRot class's default rule) and the fake-quant K/V paths
(``fakequant_{k,v}_b*_clip*``, ``kvq_ref.official``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvq_ref import QuaRot
from kvq_ref.official import (QUAROT_RANGE_FLOOR, dequant_f16, dequant_kernel, minmax_f16, quarot_fakequant_k,
                              quarot_fakequant_v)
from kvq_ref.packing import pack_codes, unpack_codes

from .golden_format import golden_params, same_bits


@pytest.mark.parametrize("case,shared", golden_params("quarot"))
def test_case(case, shared):
    p, out = case["params"], case["outputs"]
    d, g = p["head_dim"], p["group_size"]
    y = out["y_f16"]
    if case["family"] == "rotated":
        H = case["inputs"]["hadamard_pm1_i8"].astype(np.float64)
        idx = np.arange(d)
        sylvester = (-1.0) ** np.array([[bin(i & j).count("1") for j in idx] for i in idx])
        np.testing.assert_array_equal(H, sylvester)  # the official matrix is the plain Sylvester one
        x = case["inputs"]["x_f16"]
        same_bits(QuaRot(d, 2, group=g).rotate(x).astype(np.float16), y)
    paths = [k for k in out if k != "y_f16"]
    assert paths and all(re.fullmatch(r"kernel_b\d|fakequant_[kv]_b\d_clip[\d.]+", k) for k in paths), paths
    for path in paths:
        o = out[path]
        bits = int(re.search(r"_b(\d)", path).group(1))
        if path.startswith("kernel"):
            codes, scale, mn = minmax_f16(y, bits, g, range_floor=QUAROT_RANGE_FLOOR)
            same_bits(codes, o["codes_u8"])
            same_bits(scale.reshape(-1), o["scale_f16"])
            same_bits(-mn.reshape(-1), o["zero_f16"])
            same_bits(dequant_kernel(codes, scale, mn, g), o["deq_kernel_f32"])
            same_bits(dequant_f16(codes, scale, mn, g), o["deq_torch_ref_f16"])
            if "packed_u8" in o:  # 4 bits: byte j = code[2j] | code[2j+1] << 4, kvq_ref.packing's order
                same_bits(pack_codes(codes, bits), o["packed_u8"])
            if case["family"] != "rotated":
                continue
            # the QuaRot class end to end from x (its default: plain Hadamard in float16, kernel rule)
            q = QuaRot(d, bits, group=g)
            enc = q.encode(case["inputs"]["x_f16"])
            same_bits(unpack_codes(enc.arrays["codes"], bits, d), o["codes_u8"])
            same_bits(enc.arrays["scales"].reshape(-1), o["scale_f16"])
            same_bits(-enc.arrays["minima"].reshape(-1), o["zero_f16"])
            same_bits(q._rotated(enc).astype(np.float32), o["deq_kernel_f32"])
        else:
            clip = float(path.rsplit("clip", 1)[1])
            fn = quarot_fakequant_k if path.startswith("fakequant_k") else quarot_fakequant_v
            codes, scale, zero, res = fn(y, bits, clip)
            same_bits(codes, o["codes_u8"])
            same_bits(scale, o["scale_f32" if "scale_f32" in o else "scale_f16"])
            same_bits(zero, o["zero_f32" if "zero_f32" in o else "zero_f16"])
            same_bits(res, o["out_f16"])
