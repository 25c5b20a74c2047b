"""Shared fixtures of the evaluation tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def small_tables():
    """Real calibration tables of one layer and one KV head (d = 64, 320 synthetic tokens)."""
    from codebooks.nova import calibrate
    from kvq_eval.calib import CalibrationTables

    rng = np.random.default_rng(0)
    scales = np.exp(rng.normal(0, 0.7, 64))
    seq = {0: (rng.standard_normal((3, 320, 64)) * scales, rng.standard_normal((1, 320, 64)) * scales,
               rng.standard_normal((1, 320, 64)))}
    stats, model = calibrate([seq], 64, iterations=2)
    return CalibrationTables(model, stats, lambda: calibrate([seq], 64, iterations=2, grouping="round_robin")[1])
