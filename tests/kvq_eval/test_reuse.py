"""``kvq-eval run --reuse``: stored cells of an older folder are reused only on the same inputs, and a
reused cell is what a fresh run computes (SmolLM2, tiny windows)."""

from __future__ import annotations

import json

import pytest


def _strip(obj):
    """A result without what differs between two runs of the same numbers (timings and when, provenance,
    where it was reused from)."""
    drop = {"seconds", "wall_seconds", "finished", "reused_from", "provenance", "windows_reused", "prefills"}
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


@pytest.mark.model
def test_reused_cells_equal_fresh_ones(tmp_path, monkeypatch):
    import kvq_eval.text as text
    from kvq_eval.runner import run_grid

    # 64-token windows stand in for the long (8K) ones: consecutive from the start of heldout
    monkeypatch.setattr(text, "SHORT_WINDOW_MAX", 32)
    kw = dict(contexts=(384,), tasks=("ppl", "niah"), variants=("single",), depths=(0.5,), samples=1,
              bands=("none",), progress=False)
    old, new, fresh = tmp_path / "old", tmp_path / "new", tmp_path / "fresh"
    run_grid("smollm2", ["tq_mse2"], old, ppl_windows=((64, 2),), **kw)
    s = run_grid("smollm2", ["tq_mse2"], new, ppl_windows=((64, 3),), reuse=old, **kw)
    # the needle cell came whole (fp32 and tq_mse2); the perplexity cell had 2 of its 3 windows
    assert s["reused"] == {"niah": 2, "ppl": 2, "layers": 0, "decode": 0} and s["ran"] == 1
    run_grid("smollm2", ["tq_mse2"], fresh, ppl_windows=((64, 3),), **kw)
    for f in sorted(p.relative_to(fresh) for p in fresh.rglob("*.json")):
        a, b = (json.loads((root / f).read_text()) for root in (new, fresh))
        assert _strip(a) == _strip(b), f
    # a needle cell copied whole ran nothing here: no wall time, no prefill record
    (needle,) = (json.loads(p.read_text()) for p in (new / "smollm2" / "niah").glob("*.json"))
    assert needle["prefills"] == [] and needle["wall_seconds"] == 0.0
    cell = json.loads(next((new / "smollm2" / "ppl").glob("*.json")).read_text())
    assert [("reused_from" in w) for w in cell["windows"]] == [True, True, False]
    assert len({w["ids_sha256"] for w in cell["windows"]}) == 3 and cell["text"] == "heldout"
    prov = cell["provenance"]
    assert prov["protocol"] == 3 and prov["threads"]["torch"] >= 1 and "artifacts" not in prov
    # short windows moved to their own text: nothing of an old short cell is reused
    monkeypatch.setattr(text, "SHORT_WINDOW_MAX", 4096)
    s = run_grid("smollm2", ["tq_mse2"], tmp_path / "short", ppl_windows=((64, 2),), reuse=old,
                 **dict(kw, tasks=("ppl",)))
    assert s["reused"]["ppl"] == 0 and s["ran"] == 1
    with pytest.raises(ValueError, match="other than --out"):
        run_grid("smollm2", ["tq_mse4"], old, ppl_windows=((64, 2),), reuse=old, **dict(kw, tasks=("ppl",)))
    with pytest.raises(FileNotFoundError, match="no results folder"):
        run_grid("smollm2", ["tq_mse4"], new, ppl_windows=((64, 2),), reuse=tmp_path / "nope",
                 **dict(kw, tasks=("ppl",)))
