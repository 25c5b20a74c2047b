"""``kvq-eval readme`` rebuilds the marked tables of README.md and docs/evaluation.md from the JSON,
and ``kvq-eval recommend`` picks the cheapest setting within a target at the upper end of its
interval (crafted results; the committed files must be fixed points of the refresh)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvq_eval.cli import main
from kvq_eval.plot import load_results
from kvq_eval.readme import refresh_file, refresh_markdown
from kvq_eval.recommend import recommend, recommend_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "eval_v3"


@pytest.mark.parametrize("name", ["README.md", "docs/evaluation.md", "docs/plan.md"])
def test_the_committed_files_are_current(name):
    path = ROOT / name
    text = path.read_text()
    assert "<!-- kvq-eval " in text, f"{name} has no generated table"
    assert refresh_markdown(text, RESULTS, name) == text, f"{name}: stale tables, run `kvq-eval readme`"


def _ppl(entry, dnll, bits, tokens=8192):
    windows = [{"n": tokens - 1, "nll_q": (2.0 + d) * (tokens - 1), "nll_f": 2.0 * (tokens - 1), "kl": 0.01 * tokens,
                "top1": tokens - 2, "dnll_bins": [d] * 4} for d in dnll]
    return {"entry": entry, "tokens": tokens, "windows": windows, "bits_per_element": bits, "band_pairs": 0.1,
            "band": {"sink": 0, "window": 0}, "task": "ppl"}


def _write(root, rel, obj):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "smollm2"
    # per-window NLL changes (nats per token): the 4 windows' t interval decides
    _write(root, "ppl/a.json", _ppl("tq_mse3@none", [0.004, 0.005, 0.006, 0.005], 3.1))       # +0.5 %, hi ~ +0.63
    _write(root, "ppl/b.json", _ppl("tq_mse4@none", [0.002, 0.0025, 0.003, 0.0025], 4.1))    # hi ~ +0.31
    _write(root, "ppl/c.json", _ppl("tq_mse2@none", [0.001, 0.05, 0.002, 0.003], 2.1))       # mean ok, hi far
    _write(root, "ppl/d.json", _ppl("tq_mse2@0,64", [0.02, 0.021, 0.019, 0.02], 2.3))        # +2.0 %
    _write(root, "ppl/e.json", _ppl("kivi4@64,256", [0.0, 0.0005, 0.0005, 0.0], 5.9))
    for s in range(6):
        _write(root, f"niah/single_ctx4096_d0.5_s{s}.json", {
            "variant": "single", "context": 4096, "sample": s, "depth": 0.5, "results": {
                "fp32": {"exact": 1, "logprob": -1.0}, "tq_mse3@none": {"exact": int(s < 5), "logprob": -1.2 - 0.01 * s,
                                                                        "bits_per_element": 3.1}}})
    return tmp_path


def test_recommend_uses_the_upper_end_of_the_interval(folder):
    rows = {(r["target"], r["band"]): r for r in recommend(load_results(folder, "smollm2"), (0.5, 1.0, 3.0))}
    # tq_mse2@none averages +1.5 % but its interval reaches far beyond 3 %: never recommended
    assert rows[(1.0, "none")]["entry"] == "tq_mse3@none" and rows[(3.0, "none")]["entry"] == "tq_mse3@none"
    assert rows[(0.5, "none")]["entry"] == "tq_mse4@none"
    # a band allowed: every entry competes, so a cheaper band-free one wins (tq_mse3@none at 1 %, not the
    # dearer kivi4@64,256), and a band setting where it is the cheapest (tq_mse2@0,64 at 3 %)
    assert rows[(3.0, "any")]["entry"] == "tq_mse2@0,64" and rows[(1.0, "any")]["entry"] == "tq_mse3@none"
    assert rows[(0.5, "any")]["entry"] == "tq_mse4@none" and rows[(0.5, "any")]["candidates"] == 5
    assert rows[(0.5, "none")]["candidates"] == 3
    r = rows[(1.0, "none")]
    assert r["ci"][1] <= 1.0 and r["dppl"] == pytest.approx(100 * math.expm1(0.005))
    assert r["needles"][4096]["n"] == 6 and r["needles"][4096]["exact"] == pytest.approx(5 / 6)
    assert rows[(0.5, "none")]["needles"] == {}
    none = recommend(load_results(folder, "smollm2"), (0.01,))
    assert [x["entry"] for x in none] == [None, None]
    with pytest.raises(ValueError, match="targets must be positive"):
        recommend(load_results(folder, "smollm2"), (0.0,))
    assert [(x["entry"], x["candidates"]) for x in recommend(load_results(folder, "smollm2"), (1.0,), tokens=1024)] \
        == [(None, 0), (None, 0)]


def test_the_joint_pick_widens_every_bound_by_the_number_of_entries(tmp_path):
    """The joint pick's bounds are the upper ends of 1 - 0.05 / N t intervals (N: the entries of the
    band class with enough windows), computed here from scipy's t quantile: an entry that meets the
    target at 95 % alone can miss it jointly, and then a dearer one is the joint pick."""
    from scipy.stats import t as student_t

    root = tmp_path / "smollm2"
    near = [0.0073, 0.0088, 0.0068, 0.0083]  # +0.78 %; 95 % upper end +0.93 %, jointly over 3 +1.007 %
    _write(root, "ppl/a.json", _ppl("tq_mse3@none", near, 3.1))
    _write(root, "ppl/b.json", _ppl("tq_mse4@none", [0.001, 0.0012, 0.0008, 0.001], 4.1))
    _write(root, "ppl/c.json", _ppl("tq_mse2@none", [0.05, 0.06, 0.04, 0.05], 2.1))
    rows = {(r["target"], r["band"]): r for r in recommend(load_results(tmp_path, "smollm2"), (1.0,))}
    r = rows[(1.0, "none")]
    d = np.array(near)
    q = student_t.ppf(1 - 0.05 / 3 / 2, 3)
    upper = 100 * math.expm1(d.mean() + q * d.std(ddof=1) / 2)
    assert r["entry"] == "tq_mse3@none" and r["ci"][1] <= 1.0 < upper
    assert r["candidates"] == 3 and r["joint"]["entry"] == "tq_mse4@none" and r["joint"]["bits"] == 4.1
    e = np.array([0.001, 0.0012, 0.0008, 0.001])
    assert r["joint"]["upper"] == pytest.approx(100 * math.expm1(e.mean() + q * e.std(ddof=1) / 2), rel=1e-12)
    table = recommend_table(load_results(tmp_path, "smollm2"), (1.0, 0.01))
    assert "| tq_mse4@none: 4.10, ≤ +0." in table and "(of 3) |" in table and "| none of 3 |" in table


def test_the_joint_pick_keeps_its_error_rate_through_the_selection():
    """Monte Carlo, seed 0: 20 settings whose true perplexity change is exactly the target (7 normal
    windows each). Each passes its own 95 % bound with probability 2.5 %, so the per-setting pick
    names one of them (wrongly: none is within the target) about 1 - 0.975^20 = 40 % of the time;
    the joint pick at most 2.5 % of the time. 1000 trials: the standard error of a 2.5 % rate is
    0.49 %, so the bound checked is 2.5 % + 3 SE, and the per-setting rate must exceed 25 %
    (its expected 40 % less 30 SE of 1.5 %)."""
    from kvq_eval.methods import METHODS

    names = sorted(m for m in METHODS if m != "identity")[:20]
    rng = np.random.default_rng(0)
    tau = 1.0
    mu, sigma, trials = math.log1p(tau / 100), 0.002, 1000
    wrong = np.zeros(2)
    for _ in range(trials):
        res = {"ppl": {}, "niah": []}
        for i, name in enumerate(names):
            d = rng.normal(mu, sigma, 7)
            res["ppl"][f"{name}@none"] = {8192: {
                "windows": [{"n": 8191, "nll_q": (2.0 + x) * 8191, "nll_f": 2.0 * 8191, "kl": 1.0, "top1": 1}
                            for x in d], "bits_per_element": 2.0 + i / 10, "band_pairs": 0.0}}
        r = recommend(res, (tau,))[0]
        wrong += [r["entry"] is not None, r["joint"] is not None]
    rate = wrong / trials
    assert rate[0] > 0.25 and rate[1] <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / trials), rate


def test_recommend_table_says_how_many_cells_missed_the_target(folder):
    """An empty row names the count of cells it looked at, so a grid still filling never reads as
    "no setting can"; without any cell of that window length it says so."""
    res = load_results(folder, "smollm2")
    n = {r["band"]: r["candidates"] for r in recommend(res, (0.01,))}
    table = recommend_table(res, (0.01,))
    assert n["none"] > 0 and f"| ≤ 0.01 % | none | none of {n['none']} entries with 8K cells meets it |" in table
    assert "| ≤ 1 % | none | no 1K cell yet |" in recommend_table(res, (1.0,), tokens=1024)
    # one entry with 8K cells: said in the singular
    from kvq_eval.plot import ppl_summary

    one = next(e for e, by in ppl_summary(res).items() if (by.get(8192) or {}).get("ci") and e != "fp32")
    single = load_results(folder, "smollm2", entries=["fp32", one])
    assert "| ≤ 0.01 % | allowed | the one entry with 8K cells does not meet it |" in recommend_table(single, (0.01,))


MARKED = """# A page

Prose stays.

<!-- kvq-eval recommend smollm2 -->

| stale |
|---|
| x |

<!-- kvq-eval table smollm2 - all -->
| entry | bits @8K | Δppl 8K [95% t-CI] (windows) |
|---|---|---|
| nothing | 1 | 2 |

<!-- kvq-eval compare smollm2 tq_mse3@none tq_mse4@none ppl -->
| x |
|---|

<!-- kvq-eval compare smollm2 tq_mse3@none fp32 needles -->
| x |
|---|

| an unmarked table | stays |
|---|---|
| 1 | 2 |
"""


def test_marked_tables_are_rebuilt_and_others_kept(folder, tmp_path, capsys):
    out = refresh_markdown(MARKED, folder, "page.md")
    assert "Prose stays." in out and "| an unmarked table | stays |\n|---|---|\n| 1 | 2 |" in out
    assert "| ≤ 1 % | none | tq_mse3@none | 3.10 |" in out
    assert "| tq_mse2@none | 2.10 |" in out and "nothing" not in out
    assert "| 8K | 4 | +0.0025 [" in out and "| 4096 | 6 | 0 | 1 | 5 | 0 |" in out
    assert refresh_markdown(out, folder, "page.md") == out  # a fixed point
    page = tmp_path / "page.md"
    page.write_text(MARKED)
    assert main(["readme", str(page), "--results", str(folder), "--check"]) == 1
    assert "tables differ" in capsys.readouterr().out and page.read_text() == MARKED
    assert main(["readme", str(page), "--results", str(folder)]) == 0 and page.read_text() == out
    assert main(["readme", str(page), "--results", str(folder), "--check"]) == 0
    assert refresh_file(page, folder) is False
    assert main(["recommend", str(folder), "--targets", "1"]) == 0
    assert "| ≤ 1 % | none | tq_mse3@none |" in capsys.readouterr().out
    assert main(["recommend", str(folder), "--targets", "1,x"]) == 2
    assert "--targets" in capsys.readouterr().err


@pytest.mark.parametrize("text, match", [
    ("<!-- kvq-eval table smollm2 -->\n\nno table", "must be followed by a table"),
    ("<!-- kvq-eval table smollm2 -->\n| entry | bits @8K |\n|---|---|\n| zip@none | 1 |", "entry 'zip@none' has no results"),
    ("<!-- kvq-eval table smollm2 -->\n| entry | no such column |\n|---|---|", r"columns \['no such column'\]"),
    ("<!-- kvq-eval compare smollm2 a b -->\n| x |\n|---|", "expected '<!-- kvq-eval compare"),
    ("<!-- kvq-eval compare smollm2 tq_mse3@none fp32 ppl -->\n| x |\n|---|", "share no perplexity cell"),
    ("<!-- kvq-eval recommend smollm2 gemma3 -->\n| x |\n|---|", "expected '<!-- kvq-eval recommend MODEL -->'"),
])
def test_what_the_json_cannot_give_is_named(folder, text, match):
    with pytest.raises(ValueError, match=match):
        refresh_markdown(text, folder, "page.md")


def _study():
    """A crafted ``kvq-plan study`` JSON: a plan that beats its uniform baseline at 1 %, and one at
    0.5 % without a held-out cell or a uniform setting meeting the target."""
    needles = {"plan:a": {"4096": {"n": 30, "exact": 0.9}, "8192": {"n": 30, "exact": 0.8}},
               "tq_mse4@0,64": {"4096": {"n": 30, "exact": 0.95}}}
    uniform = [{"entry": e, "bits": b, "dppl": 0.77, "ci": [0.47, 0.99], "windows": 7}
               for e, b in (("tq_mse3@none", 3.25), ("tq_mse4@0,64", 4.43), ("kivi4@none", 5.04))]
    return {"model": "smollm2", "context": 8192, "needles": 30, "needle_contexts": [4096, 8192], "uniform": uniform,
            "baseline_missing": ["tq_k5v3@none", "tq_k8v4@none"], "targets": [
        {"target_pct": 1.0, "plan": {"entry": "plan:a", "bits": 3.4567, "heldout_meets_target": True,
                                     "heldout": {"dppl": 0.5, "ci": [0.25, 0.75], "windows": 7}},
         "uniform": {"entry": "tq_mse4@0,64", "bits": 4.43, "dppl": 0.77, "ci": [0.47, 0.99], "windows": 7},
         "uniform_bits_saved": 4.43 - 3.4567,
         "paired": {"windows": 7, "ratio_pct": -0.2, "ci": [math.log1p(-0.004), math.log1p(0.0)]}, "needles": needles},
        {"target_pct": 0.5, "plan": {"entry": "plan:b", "bits": 5.0, "heldout_meets_target": None, "heldout": None},
         "uniform": None, "needles": {}}]}


def test_the_study_table_comes_from_the_study_json(tmp_path):
    """``<!-- kvq-eval study MODEL -->`` renders ``results/plan/MODEL/study.json`` (beside the results
    folder): every number from the JSON, the paired interval back from nats to %; before the study
    exists it says so; a JSON that is not a study is refused naming the file."""
    results = tmp_path / "eval_v3"
    (results / "smollm2").mkdir(parents=True)
    page = "# P\n\n<!-- kvq-eval study smollm2 -->\n| x |\n|---|\n| stale |\n\nAfter.\n"
    out = refresh_markdown(page, results, "page.md")
    assert "| – | the study has not been run: no smollm2/study.json yet (`make plan-study`) |" in out
    assert out.endswith("\n\nAfter.\n") and "stale" not in out
    path = tmp_path / "plan" / "smollm2" / "study.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_study()))
    out = refresh_markdown(page, results, "page.md")
    rows = _parse_rows(out)
    assert rows[0][:4] == ["target", "plan: stored bits", "plan Δppl 8K held-out [95% t-CI] (windows)", "within target"]
    assert rows[0][4:6] == ["cheapest uniform setting (stored bits)", "uniform settings compared (lacking 8K cells)"]
    # 3 uniform settings compared; 2 baseline entries had no 8K cell yet
    assert rows[1] == ["≤ 1 %", "3.46", "+0.50% [+0.25, +0.75] (7)", "yes", "tq_mse4@0,64 (4.43)", "3 (2)", "+0.97",
                       "-0.20% [-0.40, +0.00] (7)", "0.90 / 0.95 (30)", "0.80 / – (30)"]
    assert rows[2] == ["≤ 0.5 %", "5.00", "–", "–", "none meets it", "3 (2)", "–", "–", "–", "–"]
    assert refresh_markdown(out, results, "page.md") == out  # a fixed point
    path.write_text(json.dumps({"model": "smollm2"}))
    with pytest.raises(ValueError, match="study.json: not a kvq-plan study"):
        refresh_markdown(page, results, "page.md")


def _parse_rows(text):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]


def test_the_sink_table_comes_from_the_sink_reports(tmp_path):
    """``<!-- kvq-eval sink FILE MODELS -->`` renders each model's ``kvq-eval sink`` report: the median
    and largest first-token share over heads, the pooled errors and their ratio, from the JSON alone;
    a model without its file gets a row of "–"; a file that is not a report is refused naming it."""
    results = tmp_path / "eval_v3"
    (results / "smollm2").mkdir(parents=True)
    heads = [{"layer": 0, "head": h, "sink_share": s} for h, s in enumerate([0.10, 0.50, 0.20])]
    report = {"bits": 3, "window": 64, "tokens": 2048, "heads": heads,
              "totals": {"err_plain": 0.02, "err_centred": 0.05, "heads": 3, "heads_centring_worse": 2}}
    (results / "smollm2" / "s.json").write_text(json.dumps(report))
    page = "<!-- kvq-eval sink s.json smollm2,gemma3 -->\n| x |\n|---|\n"
    out = refresh_markdown(page, results, "page.md")
    rows = _parse_rows(out)
    assert rows[0][0] == "model" and rows[0][-1] == "ratio"
    assert rows[1] == ["smollm2", "2048", "64", "3", "3", "20.0 %, 50.0 %", "2 of 3", "0.0200", "0.0500", "2.50x"]
    assert rows[2] == ["gemma3"] + ["–"] * 9
    assert refresh_markdown(out, results, "page.md") == out
    (results / "smollm2" / "s.json").write_text(json.dumps({"bits": 3}))
    with pytest.raises(ValueError, match="not a kvq-eval sink report"):
        refresh_markdown(page, results, "page.md")
    with pytest.raises(ValueError, match="expected '<!-- kvq-eval sink FILE.json"):
        refresh_markdown("<!-- kvq-eval sink smollm2 -->\n| x |\n|---|\n", results, "page.md")


def test_the_reproduce_table_comes_from_a_committed_comparison(tmp_path):
    """``<!-- kvq-eval reproduce FILE.json -->`` renders a ``kvq-eval reproduce -o`` file (the folder
    above the results folder is its root): one row per entry and needle column, the numbers of the
    JSON; a missing file or a bad argument is refused naming the marker."""
    from kvq_eval.reproduce import format_comparison

    results = tmp_path / "eval_v3"
    results.mkdir()
    summary = {"n": 30, "identical": 11, "exact_a": 20, "exact_b": 21,
               "mcnemar": {"a_only": 1, "b_only": 2, "p": 1.0}, "max_abs_logprob_diff": 0.5,
               "logprob_diff": {"mean": 0.01, "ci": [-0.02, 0.04], "p_t": 0.5, "p_signflip": 0.5}}
    cmp = {"a": "x/native", "b": "x/portable", "model": "smollm2", "ppl": {},
           "niah": {"tq_mse3@none": {"single@1024": summary}}}
    (tmp_path / "numerics").mkdir()
    (tmp_path / "numerics" / "s.json").write_text(json.dumps(cmp))
    page = "<!-- kvq-eval reproduce numerics/s.json -->\n| x |\n|---|\n"
    out = refresh_markdown(page, results, "page.md")
    rows = _parse_rows(out)
    assert rows[0][0] == "entry" and rows[1][:5] == ["tq_mse3@none", "needle single@1024", "30", "11", "20 / 21 (1)"]
    assert "+0.010 [-0.020, +0.040] nats" in rows[1]
    assert out.split("\n", 1)[1].strip() == "\n".join(format_comparison(cmp).splitlines()[2:])
    assert refresh_markdown(out, results, "page.md") == out
    with pytest.raises(ValueError, match="expected '<!-- kvq-eval reproduce FILE.json"):
        refresh_markdown("<!-- kvq-eval reproduce numerics/none.json -->\n| x |\n|---|\n", results, "page.md")
