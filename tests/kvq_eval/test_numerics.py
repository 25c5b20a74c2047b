"""Numeric paths and the agreement of two runs (issue 56: cells that reproduce across machines).

``provenance.numerics`` names the path an entry was computed on, ``kvq-eval run --portable`` moves a
run onto the portable one (a fresh process: the libraries read their settings when they load), the
portable calibration has a cache folder of its own, and ``kvq-eval reproduce`` pairs two runs of a
grid: its numbers are checked against direct formulas on crafted folders. No model is loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

from kvq_eval import provenance
from kvq_eval.cli import main
from kvq_eval.reproduce import compare_runs, format_comparison
from tests.make_recipe import ROOT, recipe, tool_args


def test_numerics_names_the_path_and_portable_environ_sets_every_knob():
    assert provenance.numerics({}) == "native"
    env = provenance.portable_environ({"PATH": "/bin", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "MKL_CBWR": "AVX2"})
    assert provenance.numerics(env) == "portable"
    assert env["PATH"] == "/bin" and "MKL_ENABLE_INSTRUCTIONS" not in env  # a knob that moves the path is dropped
    for k, v in provenance.PORTABLE.items():
        assert env[k] == v
        partial = dict(env)
        partial.pop(k)
        assert provenance.numerics(partial) == "native", k  # every knob is needed
    assert set(provenance.PORTABLE) <= set(provenance.NUMERIC_KNOBS)


def test_environment_records_the_numeric_path(monkeypatch):
    for k in provenance.NUMERIC_KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    env = provenance.environment()
    assert env["numerics"] == "native" and env["numeric_env"] == {"MKL_CBWR": "AVX2"}
    for k, v in provenance.PORTABLE.items():
        monkeypatch.setenv(k, v)
    env = provenance.environment()
    assert env["numerics"] == "portable" and env["numeric_env"] == provenance.PORTABLE


def test_the_portable_calibration_has_its_own_cache_folder(monkeypatch):
    from kvq_eval.calib import calibration_folder

    for k in provenance.NUMERIC_KNOBS:
        monkeypatch.delenv(k, raising=False)
    native = calibration_folder("smollm2", length=8192)
    # the native key is the one every earlier calibration cache was written under
    import hashlib

    assert native.name == "smollm2-" + hashlib.sha256(b"smollm2|2|8192|25|0|v2").hexdigest()[:12]
    for k, v in provenance.PORTABLE.items():
        monkeypatch.setenv(k, v)
    portable = calibration_folder("smollm2", length=8192)
    assert portable.parent == native.parent and portable != native


def test_run_portable_reruns_itself_in_a_fresh_process_on_the_portable_path(monkeypatch):
    """From a process on the native path, ``run --portable`` runs the same arguments again as
    ``python -m kvq_eval.cli`` with the portable settings, and returns its exit status."""
    import subprocess

    for k in provenance.NUMERIC_KNOBS:
        monkeypatch.delenv(k, raising=False)
    calls = []

    def fake_run(cmd, env):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 7)

    monkeypatch.setattr(subprocess, "run", fake_run)
    argv = ["run", "--portable", "--model", "smollm2", "--methods", "tq_mse3", "--dry-run", "--out", "x"]
    assert main(argv) == 7
    (cmd, env), = calls
    assert cmd[1:] == ["-m", "kvq_eval.cli", *argv]
    assert provenance.numerics(env) == "portable"


def _needle_cell(path: Path, results: dict, **inputs) -> None:
    cell = {"keys": ["k"], "values": ["1"], "offset": 3, "prompt_tokens": 90, "context": 1024, "depth": 0.5,
            "variant": "single", "haystack": "haystack", "task": "niah", "model": "m", **inputs, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell))


def _entry(logprob, exact, answer="1", cpu_model="X", calibration=None):
    prov = {"cpu": "AVX512", "cpu_model": cpu_model, "numerics": "native"}
    if calibration:
        prov["artifacts"] = {"calibration": calibration}
    return {"logprob": logprob, "exact": exact, "answer": answer, "provenance": prov}


def test_compare_runs_against_direct_formulas(tmp_path):
    rng = np.random.default_rng(3)
    n = 12
    la = -np.abs(rng.normal(1.0, 0.5, n))
    lb = la + rng.normal(0.0, 0.1, n)
    lb[:4] = la[:4]  # four samples bit-identical
    ea = (rng.random(n) < 0.6).astype(int)
    eb = ea.copy()
    eb[5] = 1 - eb[5]
    eb[6] = 1 - eb[6]
    for i in range(n):
        _needle_cell(tmp_path / "a" / "m" / "niah" / f"single_s{i}.json",
                     {"q@none": _entry(float(la[i]), int(ea[i]), calibration="c1"), "fp32": _entry(-0.1, 1)})
        _needle_cell(tmp_path / "b" / "m" / "niah" / f"single_s{i}.json",
                     {"q@none": _entry(float(lb[i]), int(eb[i]), cpu_model="Y", calibration="c2" if i else "c1")})
    # a cell only one side holds is not paired
    _needle_cell(tmp_path / "a" / "m" / "niah" / "single_only_a.json", {"q@none": _entry(-9.0, 0)})
    r = compare_runs(tmp_path / "a", tmp_path / "b", "m")
    assert set(r["niah"]) == {"q@none"} and r["ppl"] == {}
    s = r["niah"]["q@none"]["single@1024"]
    d = lb - la
    assert s["n"] == n and s["identical"] == 4
    assert s["exact_a"] == ea.sum() and s["exact_b"] == eb.sum()
    assert s["mcnemar"]["a_only"] + s["mcnemar"]["b_only"] == 2
    assert s["max_abs_logprob_diff"] == pytest.approx(np.abs(d).max(), rel=1e-12)
    half = st.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n)
    assert s["logprob_diff"]["mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert s["logprob_diff"]["ci"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-9)
    assert s["logprob_diff"]["p_t"] == pytest.approx(st.ttest_rel(lb, la).pvalue, rel=1e-9)
    assert [e["cpu_model"] for e in s["environments_a"]] == ["X"]
    assert sorted(e["artifacts"]["calibration"] for e in s["environments_b"]) == ["c1", "c2"]
    table = format_comparison(r)
    assert "| q@none | needle single@1024 | 12 | 4 |" in table


def test_compare_runs_pairs_perplexity_windows_by_their_tokens(tmp_path):
    def cell(side, windows):
        p = tmp_path / side / "m" / "ppl" / "q__none__T8192x7.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"windows": windows, "provenance": {"cpu_model": side}}))

    wa = [{"ids_sha256": f"w{i}", "n": 100, "nll_q": 250.0 + i, "nll_f": 240.0 + i} for i in range(4)]
    wb = [dict(w, nll_q=w["nll_q"] + 0.5 * (i % 2)) for i, w in enumerate(wa)][::-1]  # another order
    wb.append({"ids_sha256": "only-b", "n": 100, "nll_q": 1.0, "nll_f": 1.0})
    cell("a", wa)
    cell("b", wb)
    s = compare_runs(tmp_path / "a", tmp_path / "b", "m")["ppl"]["q__none__T8192x7"]
    d = np.array([0, 0.005, 0, 0.005])
    assert s["n"] == 4 and s["identical"] == 2 and s["tokens"] == 100
    assert s["max_abs_nll_diff"] == pytest.approx(0.005) and s["max_abs_fp32_nll_diff"] == 0.0
    assert s["nll_diff"]["mean"] == pytest.approx(d.mean())
    assert s["nll_diff"]["ci"][0] < d.mean() < s["nll_diff"]["ci"][1]


def test_compare_runs_refuses_what_is_not_two_runs_of_one_grid(tmp_path):
    _needle_cell(tmp_path / "a" / "m" / "niah" / "c.json", {"q@none": _entry(-1.0, 1)})
    _needle_cell(tmp_path / "b" / "m" / "niah" / "c.json", {"q@none": _entry(-1.0, 1)}, offset=4)
    with pytest.raises(ValueError, match="different prompts"):
        compare_runs(tmp_path / "a", tmp_path / "b", "m")
    with pytest.raises(ValueError, match="no results for model"):
        compare_runs(tmp_path / "a", tmp_path / "b", "other")
    _needle_cell(tmp_path / "c" / "m" / "niah" / "d.json", {"q@none": _entry(-1.0, 1)})
    with pytest.raises(ValueError, match="share no needle sample"):
        compare_runs(tmp_path / "a", tmp_path / "c", "m")
    assert main(["reproduce", str(tmp_path / "a"), str(tmp_path / "b"), "--model", "m"]) == 2


NUMERICS = ROOT / "results" / "numerics"


def _make_numerics_runs() -> list[list[str]]:
    """The ``kvq-eval`` argument lists of ``make numerics``'s recipe (``make -n``: printed, not run)."""
    return tool_args(recipe("numerics"), "kvq-eval")


@pytest.mark.skipif(not (NUMERICS / "smollm2.json").exists(), reason="results/numerics is not committed yet")
def test_make_numerics_regenerates_the_committed_study():
    """The committed cells are the cells of ``make numerics``'s two runs (one native, one portable,
    the same grid), every entry was computed on the path its folder names, and the committed
    comparison is ``kvq-eval reproduce`` of the two folders, recomputed here."""
    from kvq_eval.cli import _parser, grid_kwargs
    from kvq_eval.grid import plan

    runs = _make_numerics_runs()
    assert [r[0] for r in runs] == ["run", "run", "reproduce", "run", "reproduce", "run", "reproduce"], runs
    kws = [grid_kwargs(_parser().parse_args(r)) for r in runs[:2]]
    assert {**kws[0], "out": None} == {**kws[1], "out": None}  # the same grid on both paths
    assert "--portable" in runs[1] and "--portable" not in runs[0]
    for kw, path in zip(kws, ("native", "portable")):
        assert Path(kw["out"]) == Path("results/numerics") / path
        units = plan(**{**kw, "out": ROOT / kw["out"]})
        for u in units:
            cell = json.loads(Path(u["path"]).read_text())  # every cell of the grid is committed ...
            assert set(cell["results"]) == set(u["entries"]), u["path"]  # ... with every entry
            for name, entry in cell["results"].items():
                assert entry["provenance"]["numerics"] == path, (u["path"], name)
        assert len(units) == len(list((ROOT / kw["out"] / "smollm2" / "niah").glob("*.json")))
    # NOVA-KV with calibration seed 1 on the same prompts, and the rerun of committed eval_v3 cells:
    # every cell of their grids, on the native path, with the committed cell's prompt (compare_runs
    # refuses other prompts); the seeded entries record their seed and name another calibration
    seeded = _parser().parse_args(runs[3])
    assert seeded.calib_seed == 1 and {**grid_kwargs(seeded), "out": None, "methods": None} == \
        {**kws[0], "out": None, "methods": None}
    native_digest = json.loads(next((ROOT / kws[0]["out"] / "smollm2" / "niah").glob("*.json")).read_text())[
        "results"]["nova@none"]["provenance"]["artifacts"]["nova_kv"]
    for argv, out in ((runs[3], "seed1"), (runs[5], "eval_v3_rerun")):
        kw = grid_kwargs(_parser().parse_args(argv))
        assert Path(kw["out"]) == Path("results/numerics") / out
        for u in plan(**{**kw, "out": ROOT / kw["out"]}):
            cell = json.loads(Path(u["path"]).read_text())
            assert set(cell["results"]) == set(u["entries"]), u["path"]
            assert all(e["provenance"]["numerics"] == "native" for e in cell["results"].values()), u["path"]
            if out == "seed1":
                nova = cell["results"]["nova@none"]
                assert nova["calib_seed"] == 1 and nova["provenance"]["artifacts"]["nova_kv"] != native_digest
    for argv, name in ((runs[2], "smollm2.json"), (runs[4], "smollm2_seed1.json"), (runs[6], "smollm2_eval_v3.json")):
        a, b = argv[1], argv[2]
        assert argv[argv.index("-o") + 1] == f"results/numerics/{name}"
        stored = json.loads((NUMERICS / name).read_text())
        fresh = compare_runs(ROOT / a, ROOT / b, "smollm2")
        assert json.loads(json.dumps(fresh, sort_keys=True).replace(str(ROOT) + "/", "")) == stored, name
