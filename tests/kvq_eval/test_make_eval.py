"""``make eval`` is the one command that regenerates every committed evaluation result, and
``kvq-eval run --dry-run`` says what a grid still lacks. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from kvq_eval.cli import _parser, grid_kwargs, main
from kvq_eval.grid import _write, plan
from tests.make_recipe import ROOT, recipe, tool_args
TASK_FOLDERS = ("ppl", "niah", "decode", "layers")


def _make_eval_runs() -> list[list[str]]:
    """The ``kvq-eval run`` argument lists of ``make eval``'s recipe."""
    return tool_args(recipe("eval"), "kvq-eval", "run")


def test_make_eval_plans_every_committed_cell():
    """Every committed cell file of results/eval_v3, and every entry inside a needle sample, is a
    unit of ``make eval``'s grid: the target regenerates all of them (a cell run by hand with other
    settings would fail here until the Makefile names it)."""
    runs = _make_eval_runs()
    assert len(runs) >= 10, runs  # both models' grids, the decodes and the key-error studies
    planned: dict[Path, set[str]] = {}
    for argv in runs:
        kw = grid_kwargs(_parser().parse_args(["run", *argv]))
        assert Path(kw["out"]) == Path("results/eval_v3"), argv
        for u in plan(**{**kw, "out": ROOT / kw["out"]}):
            planned.setdefault(u["path"], set()).update(u["entries"] if u["task"] == "niah" else [u["entry"]])
    committed = [f for f in sorted((ROOT / "results" / "eval_v3").glob("*/*/*.json"))
                 if f.parent.name in TASK_FOLDERS]
    assert len(committed) > 300  # the committed grid, still filling (a moved folder must not pass this vacuously)
    unplanned = [str(f.relative_to(ROOT)) for f in committed if f not in planned]
    assert not unplanned, f"committed cells that make eval would not regenerate: {unplanned}"
    extra = {}
    for f in committed:
        if f.parent.name == "niah":
            if stray := set(json.loads(f.read_text())["results"]) - planned[f]:
                extra[str(f.relative_to(ROOT))] = sorted(stray)
    assert not extra, f"needle entries that make eval would not regenerate: {extra}"


def test_make_eval_dry_run_computes_nothing():
    """``make eval DRY=1`` passes --dry-run to every run and skips the sink and plot steps."""
    lines = recipe("eval", "DRY=1")
    runs = [line for line in lines if "kvq-eval run" in line]
    assert runs and all("--dry-run" in line for line in runs)
    others = [line for line in lines if "kvq-eval run" not in line and
              ("kvq-eval sink" in line or "kvq-eval plot" in line)]
    assert len(others) == 3 and all(line.startswith('[ -n "1" ] ||') for line in others), others


def test_dry_run_lists_what_is_missing_and_writes_nothing(tmp_path, capsys):
    args = ["run", "--model", "smollm2", "--methods", "tq_mse3,nova", "--band", "none", "--band", "64,256",
            "--tasks", "ppl,niah", "--variants", "single", "--depths", "0.5", "--samples", "2",
            "--calib-tokens", "8192", "--out", str(tmp_path), "--dry-run"]
    kw = grid_kwargs(_parser().parse_args(args))
    units = plan(**kw)
    ppl = {u["entry"]: u for u in units if u["task"] == "ppl"}
    needles = [u for u in units if u["task"] == "niah"]
    _write(ppl["tq_mse3@none"]["path"], {"entry": "tq_mse3@none"})
    # a calibrated entry stored with another calibration length is still missing
    _write(ppl["nova@none"]["path"], {"entry": "nova@none", "calib_tokens": 1024})
    _write(needles[0]["path"], {"results": {"fp32": {}, "tq_mse3@none": {}, "nova@64,256": {"calib_tokens": 8192}}})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "smollm2: 6 cell(s) planned, 1 complete, 5 missing an entry"
    assert out[-1] == "  no time estimate: no cell of these kinds in this folder has a recorded time yet"
    rows = {tuple(line.split()[1:]) for line in out[1:-1]}
    assert rows == {("ppl", "1024x8", "tq_mse3@64,256", "1"), ("ppl", "1024x8", "nova@none", "1"),
                    ("ppl", "1024x8", "nova@64,256", "1"),
                    ("niah", "single", "1024", "fp32", "1"), ("niah", "single", "1024", "tq_mse3@none", "1"),
                    ("niah", "single", "1024", "nova@64,256", "1"),
                    ("niah", "single", "1024", "tq_mse3@64,256", "2"), ("niah", "single", "1024", "nova@none", "2")}
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no log, no cell


def test_make_eval_runs_one_thread_per_process():
    """Every computing line of ``make eval`` pins OMP_NUM_THREADS=1 (the Makefile says why): the
    entries added to a committed needle prompt must be computed as its other entries were."""
    lines = [line for line in recipe("eval") if "kvq-eval run" in line or "kvq-eval sink" in line]
    assert len(lines) >= 10
    for line in lines:
        assert line.split("do ", 1)[-1].split()[0] == "OMP_NUM_THREADS=1", line
