"""``make plan-study`` regenerates every committed cell of ``results/plan/``: the sensitivity and joint
cells are committed as they arrive (the study takes CPU-days, and a run resumes from them on any
machine), so each must be a cell of the Makefile's study with that study's settings."""

from __future__ import annotations

import shlex
from pathlib import Path

from kvq_eval.plancli import _config, _parser
from kvq_eval.sensitivity import _read, joint_units, layer_units, read_cell
from tests.make_recipe import ROOT, recipe, tool_args


def _study_configs():
    """(config, out folder) of each ``kvq-plan study`` command of ``make plan-study``'s recipe."""
    found = []
    for argv in tool_args(recipe("plan-study"), "kvq-plan", "study"):
        args = _parser().parse_args(["study", *argv])
        target = float(args.targets.split(",")[0])  # every target shares the cells
        found.append((_config(args, target), ROOT / args.out))
    return found


def test_make_plan_study_names_both_models():
    models = sorted(cfg.model for cfg, _ in _study_configs())
    assert models == ["gemma3", "smollm2"]


def test_make_plan_study_plans_every_committed_cell():
    committed = sorted((ROOT / "results" / "plan").glob("*/cells/**/*.json"))
    assert len(committed) >= 33  # SmolLM2's study, filling (a moved folder must not pass this vacuously)
    planned: dict[Path, dict] = {}
    joint_folders: dict[Path, tuple] = {}
    for cfg, out in _study_configs():
        for u in layer_units(cfg.model, out, cfg.band, cfg.measured, cfg.context, cfg.calib_windows, cfg.stride):
            planned[u["path"]] = u
        # a joint cell's folder is one of the validation or model-check windows; its table is its own
        for text, count, spread in (("long_haystack", cfg.valid_windows, True), ("calibration", cfg.calib_windows, False)):
            for u in joint_units(cfg.model, out, cfg.band, [], cfg.context, count, cfg.stride, text=text, spread=spread):
                joint_folders[u["path"].parent] = (cfg, out, text, count, spread, u["window"]["index"])
    stray = []
    for f in committed:
        if f in planned:
            read_cell(planned[f])  # ValueError naming the file when its settings are not the study's
        elif f.name.startswith("joint-") and f.parent in joint_folders:
            cfg, out, text, count, spread, index = joint_folders[f.parent]
            layers = _read(f)["layers"]
            u = joint_units(cfg.model, out, cfg.band, layers, cfg.context, count, cfg.stride, text=text,
                            spread=spread)[index]
            assert u["path"] == f, f"{f}: its table's digest is not its name"
            read_cell(u)
        else:
            stray.append(str(f.relative_to(ROOT)))
    assert not stray, f"committed cells that make plan-study would not regenerate: {stray}"


def test_make_plan_study_runs_one_thread_per_process():
    study = [line for line in recipe("plan-study") if "kvq-plan study" in line]
    assert len(study) == 2 and all(shlex.split(line)[0] == "OMP_NUM_THREADS=1" for line in study), study
