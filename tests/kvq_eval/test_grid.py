"""The grid's bookkeeping (``kvq_eval.grid``), without a model: entry names, the units a run plans,
which entries a stored cell still needs, and how needle cells merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_eval.band import Band
from kvq_eval.grid import (PREFILL_MODES, _merge_niah, _missing, _read, _write, entry_id, parse_entry,
                           plan)
from kvq_eval.methods import METHODS

bands = st.one_of(st.none(), st.builds(Band, st.integers(0, 4096), st.integers(0, 4096)))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(METHODS)), bands, st.sampled_from(PREFILL_MODES))
def test_entry_names_round_trip(method, band, prefill):
    name = entry_id(method, band, prefill)
    assert parse_entry(name) == (method, band, prefill)
    assert name.endswith("+qprefill") == (prefill == "quantized")


def test_entry_names_refuse_what_they_do_not_name():
    assert entry_id("fp32", Band(64, 256), "quantized") == "fp32"
    assert parse_entry("fp32") == ("fp32", Band(), "exact")
    with pytest.raises(ValueError, match="is not fp32 or <method>@<band>"):
        parse_entry("tq_mse3")
    with pytest.raises(ValueError, match="tq_mse9"):
        parse_entry("tq_mse9@none")
    with pytest.raises(ValueError, match="band must be"):
        parse_entry("tq_mse3@64")


def test_plan_units_and_paths(tmp_path):
    units = plan("smollm2", ["tq_mse3", "kivi2"], tmp_path, contexts=(1024, 4096), tasks=("ppl", "niah", "layers"),
                 variants=("single",), depths=(0.1, 0.5), samples=3, bands=("none", "64,256"),
                 ppl_windows=((1024, 8), (8192, 4)))
    ppl = [u for u in units if u["task"] == "ppl"]
    niah = [u for u in units if u["task"] == "niah"]
    layers = [u for u in units if u["task"] == "layers"]
    assert len(ppl) == 2 * 2 * 2 and len(layers) == 2 * 2 and len(niah) == 2 * 2 * 3
    assert {u["path"].name for u in ppl} >= {"tq_mse3__none__T1024x8.json", "kivi2__64-256__T8192x4.json"}
    # every needle unit holds fp32 and every (method, band) entry; one file per sample
    assert all(u["entries"] == ["fp32", "tq_mse3@none", "tq_mse3@64,256", "kivi2@none", "kivi2@64,256"]
               for u in niah)
    assert len({u["path"] for u in niah}) == len(niah)
    assert (tmp_path / "smollm2" / "niah" / "single_ctx4096_d0.5_s2.json") in {u["path"] for u in niah}
    assert len({u["path"] for u in units}) == len(units)


@pytest.mark.parametrize("kw, match", [
    (dict(methods=["tq_mse7"]), "tq_mse7"),
    (dict(tasks=("ppl", "speed")), r"unknown task\(s\) \['speed'\]"),
    (dict(prefill=("exact", "lazy")), "prefill must be among"),
    (dict(variants=("multikey",)), "variants must be among"),
    (dict(samples=0), "samples must be a positive integer"),
    (dict(samples=True), "samples must be a positive integer"),
    (dict(bands=()), "bands must name at least one band"),
    (dict(bands=("64",)), "band must be"),
])
def test_plan_refuses_bad_settings(tmp_path, kw, match):
    args = dict(methods=["tq_mse3"]) | kw
    with pytest.raises(ValueError, match=match):
        plan("smollm2", args.pop("methods"), tmp_path, **args)


def _cell(keys="jolly-river", results=None):
    return {"keys": [keys], "values": ["5343902"], "prompt_tokens": 1000, "offset": 12,
            "results": results or {}}


def test_missing_entries_of_stored_cells(tmp_path):
    (unit,) = plan("smollm2", ["tq_mse3", "nova"], tmp_path, tasks=("niah",), variants=("single",),
                   depths=(0.5,), samples=1)
    assert _missing(unit, 8192) == ["fp32", "tq_mse3@none", "nova@none"]  # no file yet
    _write(unit["path"], _cell(results={"fp32": {}, "tq_mse3@none": {}, "nova@none": {"calib_tokens": 1024}}))
    # a calibrated entry made with another calibration length is computed again, nothing else
    assert _missing(unit, 8192) == ["nova@none"]
    assert _missing(unit, 1024) == []
    ppl = plan("smollm2", ["nova"], tmp_path, tasks=("ppl",))[0]
    assert _missing(ppl, 8192) == ["nova@none"]
    _write(ppl["path"], {"entry": "nova@none", "calib_tokens": 8192})
    assert _missing(ppl, 8192) == [] and _missing(ppl, 2048) == ["nova@none"]
    # another calibration seed is another calibration: an entry without calib_seed has seed 0
    assert _missing(ppl, 8192, calib_seed=1) == ["nova@none"]
    _write(ppl["path"], {"entry": "nova@none", "calib_tokens": 8192, "calib_seed": 1})
    assert _missing(ppl, 8192, calib_seed=1) == [] and _missing(ppl, 8192) == ["nova@none"]
    assert _missing(unit, 1024, calib_seed=2) == ["nova@none"]  # tq_mse3 has no calibration


def test_needle_cells_merge_only_the_same_sample(tmp_path):
    path = tmp_path / "cell.json"
    assert _merge_niah(path, _cell(results={"fp32": {"exact": 1}})) == _cell(results={"fp32": {"exact": 1}})
    _write(path, _cell(results={"fp32": {"exact": 1}}))
    merged = _merge_niah(path, {**_cell(results={"tq_mse3@none": {"exact": 0}}), "prefills": [{"seconds": 3.0}]})
    assert merged["results"] == {"fp32": {"exact": 1}, "tq_mse3@none": {"exact": 0}}
    assert merged["prefills"] == [{"seconds": 3.0}]  # each run's prefill is kept (an older cell has none)
    _write(path, {**_cell(results={"fp32": {"exact": 1}}), "prefills": [{"seconds": 2.0}]})
    merged = _merge_niah(path, {**_cell(results={"tq_mse3@none": {"exact": 0}}), "prefills": [{"seconds": 3.0}]})
    assert merged["prefills"] == [{"seconds": 2.0}, {"seconds": 3.0}]
    _write(path, _cell(results={"fp32": {"exact": 1}}))
    with pytest.raises(ValueError, match="stored needle sample differs"):
        _merge_niah(path, _cell(keys="daring-island", results={"tq_mse3@none": {"exact": 0}}))
    assert json.loads(path.read_text()) == _cell(results={"fp32": {"exact": 1}})  # left as it was


def test_files_are_written_whole_and_read_with_a_clear_error(tmp_path):
    path = tmp_path / "a" / "b.json"
    _write(path, {"x": 1})
    assert _read(path) == {"x": 1} and [p.name for p in path.parent.iterdir()] == ["b.json"]
    assert _read(tmp_path / "absent.json") is None
    path.write_text('{"x": ')
    with pytest.raises(ValueError, match=r"b\.json: not a readable result file"):
        _read(path)


def _fill(path: str, tag: str, count: int) -> None:
    from kvq_eval.runner import _finish

    for i in range(count):
        _finish("smollm2", {"task": "niah", "path": Path(path)}, _cell(results={f"{tag}{i}@none": {"exact": i}}),
                0.0)


def test_two_runs_filling_one_needle_cell_lose_no_entry(tmp_path):
    # two `kvq-eval run` processes on one --out merge different entries into the same cell; the
    # cell lock makes each read-merge-write whole, so every entry of both survives (without it,
    # one process's write drops what the other merged in between its read and its write)
    import multiprocessing as mp

    path = tmp_path / "cell.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_fill, args=(str(path), tag, 400)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = json.loads(path.read_text())["results"]
    assert sorted(got) == sorted(f"{t}{i}@none" for t in "ab" for i in range(400))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_estimate_seconds_uses_the_folders_recorded_speeds(tmp_path):
    """The dry run's estimate: missing perplexity windows x the median recorded window time (complete
    and partial cells), missing needle entries x the median entry time plus, per prompt that lacks an
    entry, the median time of its shared prefill, missing layers cells x the median cell time, each of
    the same method where it has records, else of every method; a kind without any record is counted
    apart."""
    import json

    from kvq_eval.grid import _partial_path, estimate_seconds, plan

    units = plan("smollm2", ["tq_mse4", "tq_mse3"], tmp_path, contexts=(1024,), tasks=("ppl", "niah", "layers"),
                 variants=("single",), depths=(0.5,), samples=2, ppl_windows=((1024, 4),))
    by = {(u["task"], u.get("entry"), u.get("cell")): u for u in units}
    assert estimate_seconds(units, 1024) == (0.0, len(units))  # nothing recorded yet

    def put(path, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    put(by["ppl", "tq_mse4@none", None]["path"], {"windows": [{"seconds": 10.0}] * 4})
    put(_partial_path(by["ppl", "tq_mse3@none", None]), {"rows": [{"seconds": 30.0}]})  # 3 windows to go
    niah = [u for u in units if u["task"] == "niah"]
    put(niah[0]["path"], {"results": {"fp32": {"seconds": 2.0}, "tq_mse4@none": {"seconds": 4.0}}})
    put(by["layers", "tq_mse4@none", None]["path"], {"wall_seconds": 7.0})
    # ppl: tq_mse3's own record, 3 windows x 30 = 90; needles: tq_mse3 has none, so it takes every
    # method's median(2, 4) = 3 in both cells, and the second cell's fp32 and tq_mse4 their own 2 and
    # 4: 3 + 3 + 2 + 4 = 12; layers: tq_mse3 takes tq_mse4's 7. No prompt recorded its shared
    # prefill: both needle cells are counted apart (their entries are in the 109 s)
    assert estimate_seconds(units, 1024) == (109.0, 2)
    # the prefill is recorded once per run; the prompts that lack an entry add the median, 20 s each
    put(niah[0]["path"], {"prefills": [{"seconds": 30.0}, {"seconds": 10.0}, {"seconds": 20.0}],
                          "results": {"fp32": {"seconds": 2.0}, "tq_mse4@none": {"seconds": 4.0}}})
    assert estimate_seconds(units, 1024) == (109.0 + 2 * 20.0, 0)
    put(niah[0]["path"], {"prefills": [{"seconds": 20.0}], "results": {
        "fp32": {"seconds": 2.0}, "tq_mse4@none": {"seconds": 4.0}, "tq_mse3@none": {"seconds": 40.0}}})
    # the first cell is complete; the second needs its prefill (20), fp32 (2), tq_mse4 (4) and
    # tq_mse3 (its own 40)
    assert estimate_seconds(units, 1024) == (90.0 + 20.0 + 46.0 + 7.0, 0)


def test_estimates_price_from_the_newest_dated_records():
    """Where records carry when they were finished, the estimate is the median of the newest
    ``RECENT`` of them: older ones were made by slower code or on a busier machine. Undated records
    (made before the time was kept) count only where nothing is dated."""
    from kvq_eval.grid import RECENT, recent_median

    old = [(None, 100.0)] * 9
    assert recent_median(old) == 100.0
    dated = [(f"2026-12-0{d}T10:00:00Z", s) for d, s in ((1, 90.0), (2, 80.0), (3, 9.0), (4, 8.0), (5, 7.0),
                                                          (6, 6.0), (7, 5.0))]
    # the newest 5 (days 3-7) out of order among the undated ones; days 1 and 2 are older
    mixed = old[:4] + dated[::-1] + old[4:]
    assert RECENT == 5 and recent_median(mixed) == 7.0
    assert recent_median(mixed, latest=7) == 8.0
    # the time is text that sorts in time order: a later hour of the same day is newer
    assert recent_median([("2026-12-06T09:59:59Z", 50.0), ("2026-12-06T10:00:00Z", 1.0)], latest=1) == 1.0


def test_dated_records_replace_older_undated_ones_in_the_estimate(tmp_path):
    """A folder whose first windows ran on slower code (undated) and whose latest are dated is priced
    at the latest speed, for the method's own records and for the every-method fallback."""
    import json

    from kvq_eval.grid import estimate_seconds, plan

    units = plan("smollm2", ["tq_mse4", "tq_mse3"], tmp_path, contexts=(1024,), tasks=("ppl",),
                 ppl_windows=((1024, 4),))
    by = {u["entry"]: u for u in units}

    def put(path, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    put(by["tq_mse4@none"]["path"], {"windows": [{"seconds": 100.0}] * 2 + [
        {"seconds": 10.0, "finished": "2026-12-06T10:00:00Z"}, {"seconds": 12.0, "finished": "2026-12-06T11:00:00Z"}]})
    # tq_mse3's 4 windows take every method's newest records: median(10, 12) = 11, not the 100 s ones
    assert estimate_seconds(units, 1024) == (4 * 11.0, 0)
