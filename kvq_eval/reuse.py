"""Reuse of stored cells from an older results folder (``kvq-eval run --reuse OLD``).

A cell of the current protocol that an older folder already holds, computed on the same inputs by
the same simulation, need not be computed again. In the environment that made it, its numbers
would come out bit for bit the same (``tests/kvq_eval/test_reproduce.py`` checks this on a committed
cell). In another one (v2's cells were made on another machine and record no environment), the
forward's last bits differ and a quantizer can turn them into other codes, so a reused entry is a
draw from the same distribution, not the same draw (docs/evaluation.md, reproducibility). What may
be reused:

* needle entries of a sample the generator still makes identically (same keys, values, haystack
  offset and prompt length);
* perplexity windows of the same text read the same way (consecutive long windows from the start
  of ``heldout``), with the same simulation version: they seed the cell's finished windows, and
  the run computes only the windows that are missing (7 windows of 8K from a cell of 4);
* ``layers`` and ``decode`` cells of the same settings.

Calibrated methods are reused only when the stored entry's ``provenance`` names the same
calibration artifacts (``CalibrationTables.digests``) as the ones on this machine: a calibration
made on another machine may differ (``docs``: reproducibility). Every reused entry records
``reused_from`` (the older file) and keeps everything it stored.
"""

from __future__ import annotations

from pathlib import Path

from .grid import _calibrated, _partial_path, _read, _write, cell_lock, parse_entry
from .hooks import SIMULATION
from .niah import haystack_part
from .text import ppl_text

__all__ = ["reuse_cells"]


def _artifacts_match(entry: dict, current: dict | None) -> bool:
    stored = (entry.get("provenance") or {}).get("artifacts")
    return bool(stored) and current is not None and stored == current


def _usable(name: str, entry: dict, digests) -> bool:
    method = parse_entry(name)[0]
    return not _calibrated(method) or _artifacts_match(entry, digests(method))


def _old_path(unit: dict, out: Path, old: Path) -> Path:
    return old / unit["path"].relative_to(out)


def _reuse_niah(unit, need, old_path, digests) -> int:
    stored = _read(old_path)
    if stored is None or haystack_part(unit["cell"][1]) != stored.get("haystack", "haystack"):
        return 0
    take = {e: dict(stored["results"][e], reused_from=str(old_path)) for e in need
            if e in stored["results"] and _usable(e, stored["results"][e], digests)}
    if not take:
        return 0
    with cell_lock(unit["path"]):
        cur = _read(unit["path"])
        if cur is None:
            cur = {k: v for k, v in stored.items() if k != "results"}
            # nothing ran here: no wall time, no prefill (the old cell's runs are its own records)
            cur.update(results={}, haystack=haystack_part(unit["cell"][1]), wall_seconds=0.0, prefills=[])
        fields = ("keys", "values", "prompt_tokens", "offset")
        if tuple(cur.get(f) for f in fields) != tuple(stored.get(f) for f in fields):
            return 0
        cur["results"].update(take)
        _write(unit["path"], cur)
    return len(take)


def _reuse_ppl(unit, old_dir: Path, window_ids, digests, partial_key) -> int:
    """Seed the unit's finished windows from the longest stored cell of the same entry and length."""
    if ppl_text(unit["tokens"]) != "heldout":  # short windows are spread: their windows moved
        return 0
    stem = unit["path"].name.split("__T")[0]
    best = None
    for f in sorted(old_dir.glob(f"{stem}__T{unit['tokens']}x*.json")):
        row = _read(f)
        if (row is None or row.get("entry") != unit["entry"] or row.get("text") != "heldout"
                or row.get("simulation") != SIMULATION or not _usable(unit["entry"], row, digests)):
            continue
        if best is None or len(row["windows"]) > len(best[1]["windows"]):
            best = (f, row)
    if best is None:
        return 0
    f, row = best
    rows = []
    ids = window_ids(unit["tokens"], min(unit["windows"], len(row["windows"])))
    for w, x in zip(row["windows"], ids):
        if w["n"] != unit["tokens"] - 1 or w.get("ids_sha256", x) != x:
            break
        rows.append(dict(w, ids_sha256=x, reused_from=str(f)))
    if not rows:
        return 0
    key = partial_key(unit)
    if len(rows) < unit["windows"]:
        _write(_partial_path(unit), {"key": key, "rows": rows})
    else:
        res = {k: v for k, v in row.items() if k not in ("windows", "wall_seconds")}
        res.update(windows=rows, windows_reused=len(rows), wall_seconds=sum(w.get("seconds", 0.0) for w in rows))
        _write(unit["path"], res)
    return len(rows)


def _reuse_whole(unit, old_path, digests) -> int:
    stored = _read(old_path)
    if stored is None or stored.get("entry") != unit["entry"] or not _usable(unit["entry"], stored, digests):
        return 0
    if unit["task"] == "decode" and stored.get("simulation") != SIMULATION:
        return 0
    _write(unit["path"], dict(stored, reused_from=str(old_path)))
    return 1


def reuse_cells(todo: list, out, old, window_ids, digests, partial_key) -> dict:
    """Copy what ``old`` holds of the missing cells ``todo`` (``[(unit, need)]``) into ``out``.

    Parameters
    ----------
    todo : list of (unit, list of str)
        Units of ``grid.plan`` and the entries each still needs.
    out, old : path
        The run's results folder and the older one (same layout).
    window_ids : callable (tokens, count) -> list of str
        sha256 of the token ids of the current perplexity windows (``runner.ids_sha256``).
    digests : callable (method) -> dict or None
        The current calibration artifact digests of a calibrated method (None: not on this machine).
    partial_key : callable (unit) -> dict
        The resume key a perplexity cell's finished windows are saved under (``runner._partial_key``).

    Returns
    -------
    dict
        ``{"niah": entries, "ppl": windows, "layers": cells, "decode": cells}`` reused.
    """
    out, old = Path(out), Path(old)
    if not old.is_dir():
        raise FileNotFoundError(f"--reuse: no results folder {old}")
    if old.resolve() == out.resolve():
        raise ValueError("--reuse must name a folder other than --out")
    counts = {"niah": 0, "ppl": 0, "layers": 0, "decode": 0}
    for unit, need in todo:
        old_path = _old_path(unit, out, old)
        if unit["task"] == "niah":
            counts["niah"] += _reuse_niah(unit, need, old_path, digests)
        elif unit["task"] == "ppl":
            counts["ppl"] += _reuse_ppl(unit, old_path.parent, window_ids, digests, partial_key)
        else:
            counts[unit["task"]] += _reuse_whole(unit, old_path, digests)
    return counts
