"""The plan artifact (``kvq_eval.planfile``): round trip, refusal when corrupted or mismatched, the
evaluation's ``plan:<name>`` method and its stored bits. No model is loaded."""

from __future__ import annotations

import json

import pytest

from kvq_eval.planfile import (Plan, check_candidate, load_plan, plan_spec, plan_tables, register_plan, save_plan,
                               stored_bits)

SMOL_LAYERS = 30


def _plan(name="p", key="tq_mse5", value="tq_mse3", **kw):
    layers = [(key, value)] * SMOL_LAYERS
    layers[0] = ("tq_mse8", "tq_mse4")
    return Plan(name, "smollm2", layers, 0, 64, 8192, 0.01, kw.pop("record", {"quality": {"dppl": 0.5}}), **kw)


def test_round_trip_is_byte_identical(tmp_path):
    plan = _plan()
    a = save_plan(plan, tmp_path / "a.json")
    back = load_plan(a, model="smollm2")
    assert back == plan and back.record == plan.record
    b = save_plan(back, tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    obj = json.loads(a.read_text())
    assert obj["schema"] == "kvq-plan" and obj["version"] == 1
    assert sorted(obj["tables"]) == ["sphere_d64_b3", "sphere_d64_b4", "sphere_d64_b5", "sphere_d64_b8"]
    assert obj["seeds"]["key"][2] == [2000, 2010, 2020] and obj["seeds"]["value"][2] == [2001, 2011, 2021]
    assert back.bits("key")[:2] == [8, 5] and back.bits("value")[:2] == [4, 3]


def test_the_plans_tables_are_the_shipped_table_sets_arrays():
    """The digests a plan records are those of the shipped table files' manifest (what gpu/ loads)."""
    from codebooks.build import SHIPPED_DIR

    manifest = json.loads((SHIPPED_DIR / "manifest.json").read_text())
    shipped = {e["name"]: {k: v["sha256"] for k, v in e["arrays"].items()} for e in manifest["entries"]}
    for name, t in plan_tables([("tq_mse1", "tq_mse8"), ("tq_mse4", "tq_mse4")], 64).items():
        assert t["arrays"] == shipped[name]


def test_stored_bits_are_the_accountings():
    """A uniform plan stores what the registered uniform method stores (README: TurboQuantMSE-4 with a
    64-token window, 4.43 bits at 8K), and a mixed plan's rate is the mean of its layers' rates."""
    from kvq_eval.accounting import pair_weighted_bits, spec_rates
    from kvq_eval.methods import make_spec

    uni = Plan("u", "smollm2", [("tq_mse4", "tq_mse4")] * SMOL_LAYERS, 0, 64, 8192, 0.01)
    r = spec_rates(make_spec("tq_mse4"), SMOL_LAYERS, 3, 64)
    want = pair_weighted_bits(8192, 0, 64, 1, r["rate"], 0, SMOL_LAYERS, 3, 64)["bits"]
    assert stored_bits(uni)["bits_per_element"] == want == pytest.approx(4.4329, abs=1e-4)
    mixed = stored_bits(_plan())
    # keys 5.25 bits (4 + 0.25 norm bits... per layer: b + 16/64), values b + 0.25
    key = (8.25 + 29 * 5.25) / 30
    value = (4.25 + 29 * 3.25) / 30
    assert mixed["key_rate"] == pytest.approx(key) and mixed["value_rate"] == pytest.approx(value)
    assert mixed["rate"] == pytest.approx((key + value) / 2)
    # a uniform plan's quantizers are the registered method's (same seeds): same simulation
    spec, tq = plan_spec(uni), make_spec("tq_mse4")
    assert spec.key(7, 2, 64) == tq.key(7, 2, 64) and spec.value(7, 2, 64) == tq.value(7, 2, 64)


def _corrupt(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _redigest(obj):
    from codebooks.artifacts import canonical_json, sha256

    obj["digest"] = sha256(canonical_json({k: v for k, v in obj.items() if k != "digest"}))


@pytest.mark.parametrize("edit, match", [
    (lambda o: o["layers"][3].update(key="tq_mse7"), "digest does not match"),
    (lambda o: o.update(digest="0" * 64), "digest does not match"),
    (lambda o: (o.update(version=2), _redigest(o)), "version 2"),
    (lambda o: (o.update(schema="other"), _redigest(o)), "schema must be 'kvq-plan'"),
    (lambda o: (o["layers"].pop(), _redigest(o)), "30 \\(key, value\\) candidate pairs"),
    (lambda o: (o["layers"][3].update(key="zip"), _redigest(o)), "unknown method 'zip'"),
    (lambda o: (o["layers"][3].update(key="kivi4"), _redigest(o)), "keeps a band of its own"),
    (lambda o: (o["layers"][3].update(key="nova"), _redigest(o)), "needs calibration tables"),
    (lambda o: (o["tables"]["sphere_d64_b5"]["arrays"].update({"sphere_d64_b5.levels.f32": "0" * 64}), _redigest(o)),
     "tables differ from this toolkit's \\(sphere_d64_b5\\)"),
    (lambda o: (o["stored_bits"].update(bits_per_element=3.0), _redigest(o)), "stored bits"),
    (lambda o: (o["seeds"]["key"][0].__setitem__(0, 7), _redigest(o)), "seeds"),
    (lambda o: (o["model"].update(head_dim=128), _redigest(o)), "geometry"),
    (lambda o: (o.update(extra=1), _redigest(o)), "fields must be"),
    (lambda o: (o["band"].update(window=-1), _redigest(o)), "window must be an integer >= 0"),
    (lambda o: (o.update(target=2.0), _redigest(o)), "target must be"),
    (lambda o: (o.pop("band"), _redigest(o)), "fields must be"),
])
def test_corrupted_or_mismatched_plans_are_refused(tmp_path, edit, match):
    path = save_plan(_plan(), tmp_path / "p.json")
    _corrupt(path, edit)
    with pytest.raises(ValueError, match=match) as info:
        load_plan(path)
    assert str(path) in str(info.value)


def test_unreadable_files_and_other_models_are_refused(tmp_path):
    path = save_plan(_plan(), tmp_path / "p.json")
    with pytest.raises(ValueError, match="a plan for smollm2, not for gemma3"):
        load_plan(path, model="gemma3")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="unreadable JSON"):
        load_plan(path)
    with pytest.raises(ValueError, match="file not found"):
        load_plan(tmp_path / "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a plan is a JSON object"):
        load_plan(path)


@pytest.mark.parametrize("kw, match", [
    (dict(name="bad name"), "name must match"),
    (dict(model="llama"), "model must be one of"),
    (dict(layers=[("tq_mse4", "tq_mse4")] * 3), "30 \\(key, value\\)"),
    (dict(layers=[("tq_mse9", "tq_mse4")] * 30), "unknown method 'tq_mse9'"),
    (dict(sink=True), "sink must be an integer"),
    (dict(context=8), "context must be an integer >= 16"),
    (dict(target=0.0), "target must be"),
    (dict(record=[1]), "record must be a dict"),
])
def test_plan_fields_are_validated(kw, match):
    base = dict(name="p", model="smollm2", layers=[("tq_mse4", "tq_mse4")] * 30, sink=0, window=64, context=8192,
                target=0.01, record={})
    with pytest.raises(ValueError, match=match):
        Plan(**{**base, **kw})


def test_candidates():
    assert check_candidate("tq_mse1", 64) == "tq_mse1" and check_candidate("quarot4", 64) == "quarot4"
    for bad, match in [("tq_mse4:keys", "candidate must be"), ("qjl", "keeps a band"), ("tq_split3.5", "calibration"),
                       ("plan:x", "candidate must be"), (3, "candidate must be"), ("tq_mse0", "unknown method")]:
        with pytest.raises(ValueError, match=match):
            check_candidate(bad, 64)


def test_registered_plan_is_a_method_with_its_own_band(tmp_path):
    """``plan:<name>`` resolves in the method registry, the grid runs it with its own band only, and an
    entry made from another plan file of the same name is stale."""
    from kvq_eval.grid import _entry_stale, parse_entry, plan
    from kvq_eval.methods import method_info

    p = _plan("reg-test")
    assert register_plan(p) == "plan:reg-test" and register_plan(p) == "plan:reg-test"
    with pytest.raises(ValueError, match="already registered"):
        register_plan(_plan("reg-test", key="tq_mse6"))
    info = method_info("plan:reg-test")
    assert (info["sink"], info["window"]) == (0, 64) and not info.get("calibrated")
    assert parse_entry(p.entry) == ("plan:reg-test", parse_entry("tq_mse4@0,64")[1], "exact")
    units = plan("smollm2", ["tq_mse4", "plan:reg-test"], tmp_path, tasks=("ppl", "niah", "layers"),
                 bands=("none", "4,32"), contexts=(1024,), variants=("single",), depths=(0.5,), samples=1,
                 ppl_windows=((1024, 2),))
    ppl = sorted(u["entry"] for u in units if u["task"] == "ppl")
    assert ppl == ["plan:reg-test@0,64", "tq_mse4@4,32", "tq_mse4@none"]
    assert [u["entry"] for u in units if u["task"] == "layers"].count("plan:reg-test@0,64") == 1
    niah = [u for u in units if u["task"] == "niah"][0]["entries"]
    assert "plan:reg-test@0,64" in niah and not any(e.startswith("plan:reg-test@none") for e in niah)
    digest = json.loads(save_plan(p, tmp_path / "p.json").read_text())["digest"]
    assert not _entry_stale(p.entry, {"provenance": {"artifacts": {"plan": digest}}}, 1024)
    assert _entry_stale(p.entry, {"provenance": {"artifacts": {"plan": "0" * 64}}}, 1024)
    assert _entry_stale(p.entry, {}, 1024)
    with pytest.raises(ValueError, match="unknown method 'plan:never'.*plans: .*plan:reg-test"):
        parse_entry("plan:never@none")


_FRESH = """
import sys, torch
from kvq_eval.cli import _plans
assert torch.get_num_threads() == 1
_plans([sys.argv[1]], "smollm2")  # as kvq-eval run --plan does before any model is loaded
print(torch.get_num_threads())
"""


def test_loading_a_plan_keeps_torchs_thread_count(tmp_path):
    """Checking and registering a plan builds kvq_ref quantizers; if Numba's threading layer started
    there, before ``models.share_threads``, it moved torch from OMP_NUM_THREADS=1 to every core (a
    Ray worker registering the driver's plans then computed other float32 sums than the serial run:
    tests/kvq_eval/test_ray.py failed after test_planner.py's end-to-end search). A fresh process,
    since Numba's layer starts once per process."""
    import os
    import subprocess
    import sys

    path = save_plan(Plan("fresh", "smollm2", [("tq_mse4", "tq_mse3")] * 30, 0, 8, 32, 0.01), tmp_path / "p.json")
    done = subprocess.run([sys.executable, "-c", _FRESH, str(path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"
