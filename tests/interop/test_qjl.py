"""QJL against the official golden cases (``<interop>/qjl/golden*.json``).

Tolerances (facts.json): outlier indices (order included: stable descending sort), sign bits, key and
outlier norms, and the 9 largest channel norms of every group are bit-exact (the golden inputs keep
every stored bit and float16 norm away from rounding boundaries); the other channel norms may differ
by one float16 ulp (float32 accumulation order). Estimates: we evaluate the official formula in
float64, like the golden; each is a sum of at most m + m_out <= 1024 products, so its rounding error
is below 1024 * 2^-53 ~ 1.2e-13 of the sum of magnitudes ``sqrt(pi/2) (norm_in sum|qin|/m + norm_out
sum|qo|/m_out)``; we allow 1e-12 of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvq_ref.qjl import official_estimate, official_sketch
from kvq_ref.sketch import QJLSketch

from .golden_format import golden_params, same_bits


@pytest.mark.parametrize("case,shared", golden_params("qjl"))
def test_case(case, shared):
    p, out = case["params"], case["outputs"]
    S = shared[p["sketch"]]
    m, m_out, g = p["m"], p["m_out"], p["group_size"]
    keys, queries = case["inputs"]["keys_f16"], case["inputs"]["queries_f16"]
    got = official_sketch(keys, S, m, m_out, p["n_outliers"], g)
    same_bits(got["outlier_idx"], out["outlier_idx_u8"])
    same_bits(got["bits_in"], out["bits_in_u8"])
    same_bits(got["bits_out"], out["bits_out_u8"])
    same_bits(got["key_norm"], out["key_norm_f16"])
    same_bits(got["outlier_norm"], out["outlier_norm_f16"])
    ours, ref = got["channel_norms"], out["channel_norms_f16"]
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    top = np.argsort(-ref.astype(np.float64), axis=-1, kind="stable")[:, :9]
    same_bits(np.take_along_axis(ours, top, -1), np.take_along_axis(ref, top, -1))
    ulp = np.abs(np.spacing(ref.astype(np.float16))).astype(np.float64)
    assert np.all(np.abs(ours.astype(np.float64) - ref.astype(np.float64)) <= ulp)
    est = official_estimate(queries, S, m, m_out, got, g)
    # the error scale of the bound (module docstring), per (query, key)
    idx = got["outlier_idx"].astype(np.intp)
    S64, q = np.asarray(S, np.float64), queries.astype(np.float64)
    nk, no = got["key_norm"].astype(np.float64), got["outlier_norm"].astype(np.float64)
    scale = np.empty_like(est)
    for j in range(keys.shape[0]):
        qo = q[:, idx[j // g]] @ S64[:, idx[j // g]].T
        qin = q @ S64[:m].T - qo[:, :m]
        scale[:, j] = np.sqrt(np.pi / 2) * (np.sqrt(nk[j] ** 2 - no[j] ** 2) * np.abs(qin).sum(1) / m
                                            + no[j] * np.abs(qo[:, :m_out]).sum(1) / m_out)
    assert np.all(np.abs(est - out["estimate_f64"]) <= 1e-12 * scale)


def test_official_constant_option():
    """``constant="official"`` is the released ``sqrt(pi/2)/m``; ours divides by the rows' own kappa."""
    ours, official = QJLSketch(256, 128, "orthogonal"), QJLSketch(256, 128, "orthogonal", constant="official")
    assert official.kappa == pytest.approx(np.sqrt(2 / np.pi), rel=1e-15)
    assert ours.kappa / official.kappa == pytest.approx(1.00196, abs=5e-5)
    gauss = QJLSketch(256, 128, "gaussian", constant="official")
    assert gauss.kappa == QJLSketch(256, 128, "gaussian").kappa
    with pytest.raises(ValueError, match="constant"):
        QJLSketch(8, 8, constant="biased")
