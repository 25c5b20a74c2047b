"""``gpu.plan``: a plan file's per-layer quantizers and device tables, refused when they do not match."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvq_eval.planfile import Plan, plan_json, save_plan


def _plan(name, key, value):
    layers = [(key, value)] * 30
    layers[0] = ("tq_mse8", "tq_mse4")
    return Plan(name, "smollm2", layers, 0, 64, 8192, 0.01, {})


def test_gpu_plan_layers_read_the_tables_and_refuse_mismatches(tmp_path):
    """``gpu.plan.plan_layers``: per layer and head the evaluation's TurboQuantMSE (same seed) and the
    DeviceTable of its bits; a table set without the plan's arrays is refused."""
    from codebooks import SphereMarginal, lloyd_max, save_tables
    from gpu.plan import plan_layers
    from gpu.tables import TableMismatchError
    from kvq_eval.methods import make_spec

    plan = _plan("gpu-test", key="tq_mse3", value="tq_mse2")
    path = save_plan(plan, tmp_path / "p.json")
    layers = plan_layers(path)
    assert len(layers) == 30 and layers[1].key_candidate == "tq_mse3"
    q, table = layers[1].key[2]
    assert q == make_spec("tq_mse3").key(1, 2, 64) and table.bits == 3 and table.dim == 64
    assert np.array_equal(table.levels.numpy(), q.table.levels)
    assert layers[0].key[0][1].bits == 8 and layers[0].value[0][0] == make_spec("tq_mse4").value(0, 0, 64)
    # a table set missing one of the plan's tables
    folder = save_tables([lloyd_max(SphereMarginal(64), b, exact=True) for b in (2, 3, 4, 8)], tmp_path / "set")
    with pytest.raises(TableMismatchError, match="sphere_d64_b5|does not hold"):
        plan_layers(plan_json(_plan("gpu-test2", key="tq_mse5", value="tq_mse2")), folder)
    # the plan itself corrupted
    obj = json.loads(path.read_text())
    obj["layers"][1]["key"] = "tq_mse4"
    with pytest.raises(ValueError, match="digest does not match"):
        plan_layers(obj)

