"""OSCAR against the official golden cases (``<interop>/oscar/golden*.json``).

Tolerance: none. Given the golden rotated rows y, threshold, codes, packed bytes, scale, zero and
dequantized rows are bit-exact (facts.json: float32 arithmetic in a fixed order). Our y from x is
bit-exact too: the official bfloat16 GEMM accumulates in float32, and ``kvq_ref.official.bf16_matmul``
accumulates in index order (the float64 product rounded once to bfloat16, used before, missed one
hidden value by one bfloat16 ulp). The quantizer end to end (from x) is then bit-exact on every case.
"""

from __future__ import annotations

import numpy as np
import pytest

from codebooks.nova import NovaHead
from codebooks.transforms import KeyTransform, ValueTransform
from kvq_ref.nova import Oscar
from kvq_ref.official import clip_index, oscar_dequantize, oscar_quantize, oscar_threshold, pack_strided

from .golden_format import golden_params, same_bits



def head_with(R: np.ndarray) -> NovaHead:
    """A NovaHead whose OSCAR rotations are ``R`` (the NOVA-KV parts are identities, unused here)."""
    d = R.shape[0]
    eye, groups = np.eye(d), np.arange(d).reshape(d // 4, 4)
    cents = np.zeros((d // 4, 256, 4), np.float32)
    return NovaHead(KeyTransform(np.zeros(d), eye, eye, np.ones(d), 0.0, 0), ValueTransform(np.zeros(d), eye, np.ones(d)),
                    groups, groups, cents, cents, R, R, R, 2, 4)


@pytest.mark.parametrize("case,shared", golden_params("oscar"))
def test_case(case, shared):
    p, out = case["params"], case["outputs"]
    d, g, ratio = p["head_dim"], p["group_size"], p["clip_ratio"]
    c = clip_index(ratio, d)
    assert c == out["clip_index"]
    if case["family"] == "rotated":
        R = np.asarray(shared["R_f32"], np.float64)
        y = out["y_bf16_as_f32"]
        ours = Oscar(head_with(R), p["role"], clip=ratio).rotate(case["inputs"]["x_bf16_as_f32"]).astype(np.float32)
        same_bits(ours, y)
        x = case["inputs"]["x_bf16_as_f32"]
    else:
        R = np.eye(d)
        y = x = case["inputs"]["y_bf16_as_f32"]
    for tag, method in (("", "sort"), ("_bsearch", "bisect")):
        thr = oscar_threshold(y, c, method)
        same_bits(thr, out[f"threshold{tag}_f32"])
        codes, scale, zero = oscar_quantize(y, 2, g, thr)
        same_bits(codes, out[f"codes{tag}_u8"])
        same_bits(pack_strided(codes, 2), out[f"packed{tag}_u8"])
        same_bits(scale, out[f"scale{tag}_f32"])
        same_bits(zero, out[f"zero{tag}_f32"])
        same_bits(oscar_dequantize(codes, scale, zero, g), out[f"deq{tag}_f32"])
        # the Oscar quantizer end to end (from x; rotated cases reproduce y exactly, checked above)
        q = Oscar(head_with(R), p["role"], clip=ratio, group=g, threshold=method)
        enc = q.encode(x)
        same_bits(enc.arrays["codes"], out[f"packed{tag}_u8"])
        same_bits(enc.arrays["scales"], out[f"scale{tag}_f32"])
        same_bits(enc.arrays["zeros"], out[f"zero{tag}_f32"])
        same_bits(q._rotated(enc).astype(np.float32), out[f"deq{tag}_f32"])
