"""The Ray path: a tiny grid on a local two-worker Ray instance writes what the serial run writes."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")


def _strip(obj):
    """A result without its timings (and when they were finished) and provenance (the workers' OMP_NUM_THREADS is recorded there)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("seconds", "wall_seconds", "finished", "provenance")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


@pytest.mark.model
def test_ray_grid_matches_serial(tmp_path):
    import torch

    from kvq_eval.runner import run_grid

    kw = dict(contexts=(384,), tasks=("ppl", "niah"), variants=("single",), depths=(0.5,), samples=2,
              bands=("none", "16,32"), ppl_windows=((64, 1),), progress=False)
    # float32 reductions depend on torch's thread count: run serially on one thread, as the workers do
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = run_grid("smollm2", ["tq_mse2"], tmp_path / "serial", **kw)
    finally:
        torch.set_num_threads(threads)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        assert ray.cluster_resources()["CPU"] == 2
        parallel = run_grid("smollm2", ["tq_mse2"], tmp_path / "ray", ray="local", **kw)
    finally:
        ray.shutdown()
    assert serial == parallel == {"cells": 4, "done_before": 0, "ran": 4}
    files = sorted(p.relative_to(tmp_path / "serial") for p in (tmp_path / "serial").rglob("*.json"))
    assert files == sorted(p.relative_to(tmp_path / "ray") for p in (tmp_path / "ray").rglob("*.json"))
    for f in files:
        a = json.loads((tmp_path / "serial" / f).read_text())
        b = json.loads((tmp_path / "ray" / f).read_text())
        assert _strip(a) == _strip(b), f


def test_cli_ray_auto_without_a_cluster_says_what_to_do(tmp_path, capsys, monkeypatch):
    """``--ray auto`` with no running cluster: one clear error naming ``--ray local``, before any model
    is loaded, and no result written."""
    import kvq_eval.runner as runner
    from kvq_eval.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(runner, "Evaluator", lambda *a, **k: pytest.fail("model loaded"))
    rc = main(["run", "--ray", "auto", "--methods", "tq_mse2", "--tasks", "ppl", "--ppl-windows", "64x1",
               "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--ray auto: no Ray cluster to join" in err and "--ray local" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.model
def test_cli_ray_local_runs_the_grid(tmp_path, capsys):
    """``kvq-eval run --ray local`` starts a Ray instance on this machine and writes the cells."""
    from kvq_eval.cli import main

    assert main(["run", "--ray", "local", "--methods", "tq_mse2", "--tasks", "ppl", "--ppl-windows", "64x2",
                 "--out", str(tmp_path)]) == 0
    assert "1 cell(s) run" in capsys.readouterr().out
    cell = json.loads(next((tmp_path / "smollm2" / "ppl").glob("*.json")).read_text())
    assert len(cell["windows"]) == 2 and cell["text"] == "short" and cell["provenance"]["protocol"] == 3
    assert json.loads((tmp_path / "smollm2" / "runs.jsonl").read_text())["command"].startswith("kvq-eval run --ray local")
