"""The planner's study: its pieces without a model (the uniform baseline, the paired window test, the
chart), and `kvq-plan study` end to end on a tiny slice of SmolLM2."""

from __future__ import annotations

import json
import math

import pytest

from kvq_eval.planstudy import _baseline_calib, _cheapest, _paired, baseline_gaps, plot_study, uniform_settings


def _window(dnll, n=100, ids=None):
    w = {"n": n, "nll_q": 3.0 * n + dnll * n, "nll_f": 3.0 * n, "kl": 0.0, "top1": n}
    if ids is not None:
        w["ids_sha256"] = ids
    return w


def _cell(folder, entry, tokens, dnlls, bits, ids=None):
    name = entry.replace(":", "_").replace("@", "__").replace(",", "-")
    path = folder / "smollm2" / "ppl" / f"{name}__T{tokens}x{len(dnlls)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [_window(d, ids=None if ids is None else ids[i]) for i, d in enumerate(dnlls)]
    path.write_text(json.dumps({"entry": entry, "tokens": tokens, "windows": rows, "bits_per_element": bits,
                                "band": {"sink": 0, "window": 0}, "band_pairs": 0.0, "text": "heldout"}))
    return rows


def test_cheapest_uniform_setting_meets_the_target_at_the_upper_bound(tmp_path):
    # t interval over 3 windows: mean +- 4.303 * sd / sqrt(3)
    _cell(tmp_path, "a@none", 8192, [0.004, 0.005, 0.006], 4.25)      # ~0.5 % +- 0.25: upper ~0.75 %
    _cell(tmp_path, "b@none", 8192, [0.001, 0.008, 0.012], 3.25)      # mean 0.7 %, wide: upper ~1.4 %
    _cell(tmp_path, "c@0,64", 8192, [0.0080, 0.0085, 0.0090], 3.5)    # upper ~0.98 %
    _cell(tmp_path, "d@none", 1024, [0.0, 0.0, 0.0], 2.0)             # another context: ignored
    uni = uniform_settings(tmp_path, "smollm2", 8192)
    assert [u["entry"] for u in uni] == ["b@none", "c@0,64", "a@none"]
    assert _cheapest(uni, 1.0)["entry"] == "c@0,64"
    assert _cheapest(uni, 0.8)["entry"] == "a@none"
    assert _cheapest(uni, 0.1) is None
    # d@none has a 1K cell but no 8K one: the comparison cannot see it yet, and says so
    assert baseline_gaps(tmp_path, "smollm2", 8192) == ["d@none"]
    assert baseline_gaps(tmp_path, "smollm2", 1024) == ["a@none", "b@none", "c@0,64"]
    c = next(u for u in uni if u["entry"] == "c@0,64")
    assert c["ci"][1] == pytest.approx(100 * math.expm1(0.0085 + 4.302652729911275 * 0.0005 / math.sqrt(3)), rel=1e-9)


def test_baseline_needles_use_the_calibration_of_its_cells():
    res = {"ppl": {"tq_mse4@none": {8192: {}}, "tq_split3.5@none": {8192: {"calib_tokens": 8192}},
                   "oscar@none": {8192: {"calib_tokens": 1024}}}}
    assert _baseline_calib(res, ["tq_mse4@none"], 8192, "b") == 1024  # nothing calibrated: the default
    assert _baseline_calib(res, ["tq_mse4@none", "tq_split3.5@none"], 8192, "b") == 8192
    with pytest.raises(ValueError, match=r"b: the uniform baselines were calibrated on \[1024, 8192\] tokens"):
        _baseline_calib(res, ["oscar@none", "tq_split3.5@none"], 8192, "b")


def test_paired_windows_check_text_and_token_ids():
    a = {"text": "heldout", "windows": [_window(0.01, ids="x"), _window(0.02, ids="y"), _window(0.03, ids="z")]}
    b = {"text": "heldout", "windows": [_window(0.00, ids="x"), _window(0.01, ids="y")]}
    got = _paired(a, b, "plan:p@0,64", "u@none", 8192)
    assert got["windows"] == 2 and got["dnll"] == pytest.approx(0.01) and got["ids_checked"]
    assert "token ids differ" in _paired(a, {**b, "windows": [_window(0.0, ids="q"), _window(0.0, ids="y")]},
                                         "p", "u", 8192)["error"]
    assert "different texts" in _paired(a, {**b, "text": "short"}, "p", "u", 8192)["error"]
    unchecked = _paired(a, {"text": "heldout", "windows": [_window(0.0), _window(0.0)]}, "p", "u", 8192)
    assert unchecked["windows"] == 2 and not unchecked["ids_checked"]


def test_plot_reads_only_the_study_json(tmp_path):
    row = {"target_pct": 1.0, "plan": {"key_bits": [5, 4, None], "value_bits": [3, 3, 4], "bits": 4.1,
                                      "heldout": {"dppl": 0.6, "ci": [0.3, 0.9]}}}
    study = {"model": "smollm2", "context": 8192, "targets": [row],
             "uniform": [{"entry": "tq_mse4@0,64", "bits": 4.43, "dppl": 0.77, "ci": [0.5, 0.99]}]}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    (png,) = plot_study(path, tmp_path / "out" / "study")
    assert png.is_file() and png.stat().st_size > 1000
    path.write_text(json.dumps({**study, "targets": []}))
    with pytest.raises(ValueError, match="no target"):
        plot_study(path, tmp_path / "x")


def _ppl_cell(folder, entry):
    """The raw perplexity cell of ``entry`` under a results folder (read as JSON, not through the library)."""
    cells = [json.loads(p.read_text()) for p in (folder / "smollm2" / "ppl").glob("*.json")]
    (cell,) = [c for c in cells if c["entry"] == entry]
    return cell


@pytest.mark.model
def test_kvq_plan_study_end_to_end_on_a_tiny_slice(tmp_path, capsys):
    """``kvq-plan study`` on SmolLM2 with 32-token windows, two targets and a baseline made by ``kvq-eval
    run``: the targets share the sensitivity cells, every number of study.json is checked against the
    plan files and the raw cells (the held-out change, the paired window differences, the needles),
    the uniform pick is the cheapest baseline entry whose interval meets the target and its needles
    (and fp32's) are copied from the baseline folder, a second run computes nothing and writes the
    same bytes, and the table and chart come from the JSON."""
    from kvq_eval.cli import main as eval_main
    from kvq_eval.planfile import load_plan, stored_bits
    from kvq_eval.plancli import main
    from kvq_eval.planstudy import study_table

    base = tmp_path / "base"
    assert eval_main(["run", "--model", "smollm2", "--methods", "tq_mse2,tq_mse4", "--band", "none", "--band", "0,8",
                      "--tasks", "ppl,niah", "--ppl-windows", "32x2", "--ctx", "384", "--variants", "single",
                      "--depths", "0.1,0.3,0.5,0.7,0.9", "--samples", "1", "--out", str(base)]) == 0
    for f in (base / "smollm2" / "niah").glob("*.json"):  # one run made every entry: one timed shared prefill
        (pre,) = json.loads(f.read_text())["prefills"]
        assert pre["seconds"] > 0 and pre["finished"].endswith("Z")
    out = tmp_path / "plan"
    argv = ["study", "--model", "smollm2", "--targets", "20,100", "--band", "0,8", "--candidates", "tq_mse2,tq_mse4",
            "--context", "32", "--calib-windows", "1", "--valid-windows", "2", "--rounds", "2", "--eval-windows", "2",
            "--needles", "5", "--needle-contexts", "384", "--baseline", str(base), "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "(120 run now, 0 stored)" in log and "(0 run now, 120 stored)" in log  # cells shared by the targets
    path = out / "smollm2" / "study.json"
    raw = path.read_bytes()
    study = json.loads(raw)
    assert (study["model"], study["context"], study["eval_windows"], study["baseline_missing"]) == ("smollm2", 32, 2, [])
    assert sorted(u["entry"] for u in study["uniform"]) == ["tq_mse2@0,8", "tq_mse2@none", "tq_mse4@0,8", "tq_mse4@none"]
    assert [r["target_pct"] for r in study["targets"]] == [20.0, 100.0]
    for row in study["targets"]:
        plan = load_plan(row["plan"]["file"], model="smollm2")
        assert row["plan"]["entry"] == plan.entry and row["plan"]["layers"] == [list(p) for p in plan.layers]
        assert row["plan"]["bits"] == stored_bits(plan)["bits_per_element"]
        assert row["plan"]["key_bits"] == [int(k.removeprefix("tq_mse")) for k, _ in plan.layers]
        assert row["plan"]["value_bits"] == [int(v.removeprefix("tq_mse")) for _, v in plan.layers]
        # held-out change from the raw windows: 100 (exp(sum dNLL / tokens) - 1)
        cell = _ppl_cell(out / "eval", plan.entry)
        w = cell["windows"]
        held = row["plan"]["heldout"]
        assert held["windows"] == len(w) == 2
        dnll = sum(x["nll_q"] - x["nll_f"] for x in w) / sum(x["n"] for x in w)
        assert held["dppl"] == pytest.approx(100 * math.expm1(dnll), rel=1e-12, abs=1e-12)
        assert row["plan"]["heldout_meets_target"] == (held["ci"][1] <= row["target_pct"])
        # the uniform pick: meets the target at the upper end of its interval, and nothing cheaper does
        meets = [u for u in study["uniform"] if u["ci"][1] <= row["target_pct"]]
        pick = row["uniform"]
        if pick is None:
            assert not meets
            continue
        assert pick in meets and all(u["bits"] >= pick["bits"] for u in meets)
        assert row["uniform_bits_saved"] == pytest.approx(pick["bits"] - row["plan"]["bits"], abs=1e-12)
        # paired: per window, the plan's NLL change per token minus the baseline's, on the same token ids
        bw = _ppl_cell(base, pick["entry"])["windows"]
        diffs = [(a["nll_q"] - a["nll_f"]) / a["n"] - (b["nll_q"] - b["nll_f"]) / b["n"] for a, b in zip(w, bw)]
        assert [a["ids_sha256"] for a in w] == [b["ids_sha256"] for b in bw[:2]]
        assert row["paired"]["windows"] == 2 and row["paired"]["ids_checked"]
        assert row["paired"]["window_dnll"] == pytest.approx(diffs, rel=1e-9, abs=1e-12)
        assert row["paired"]["dnll"] == pytest.approx(sum(diffs) / 2, rel=1e-9, abs=1e-12)
        # needles: both on the same 5 prompts at 384 tokens
        assert {e: r["384"]["n"] for e, r in row["needles"].items()} == {plan.entry: 5, pick["entry"]: 5}
        assert row["needles_paired"]["384"]["n"] == 5
        # the baseline's needle entries (and fp32's) were copied from the baseline folder, not recomputed
        for f in sorted((out / "eval" / "smollm2" / "niah").glob("*.json")):
            got, old = json.loads(f.read_text())["results"], json.loads((base / "smollm2" / "niah" / f.name).read_text())
            for e in ("fp32", pick["entry"]):
                assert got[e].pop("reused_from").endswith(f.name) and got[e] == old["results"][e]
            assert "reused_from" not in got[plan.entry]
    # resumable: both plans are read back, nothing is computed again, and the file is the same
    assert main(argv) == 0
    assert capsys.readouterr().out.count("the plan of this search, read back") == 2 and path.read_bytes() == raw
    table = study_table(study)
    assert table.count("\n") == 3 and "needle exact 384: plan / uniform (n)" in table
    assert all(line.split(" | ")[5] == "4" for line in table.splitlines()[2:])  # 4 compared, none lacking
    assert main(["plot", str(path), "-o", str(tmp_path / "chart" / "study")]) == 0
    assert (tmp_path / "chart" / "study.png").stat().st_size > 1000
