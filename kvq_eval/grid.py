"""The grid: entry names, the cells a run plans (one result file each) and what is stored of them.

An entry is ``fp32`` or ``<method>@<band>[+qprefill]`` (``entry_id``/``parse_entry``); a unit is one
result file (a perplexity, layers or decode cell of one entry, or a needle sample holding every
entry). ``_missing`` says which entries a unit still needs, so a run computes only those; files are
written whole (``_write``: a temporary file, then a rename), so an interrupted run never leaves a
partial cell behind.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

from .band import Band, parse_band
from .methods import method_info
from .models import slug
from .niah import VARIANTS

__all__ = ["entry_id", "parse_entry", "plan", "PREFILL_MODES", "TASKS"]

PREFILL_MODES = ("exact", "quantized")
TASKS = ("ppl", "niah", "decode", "layers")
#: How many of the newest dated records of a kind a dry-run estimate takes the median of.
RECENT = 5


def entry_id(method: str, band: Band | None, prefill: str = "exact") -> str:
    """``fp32``, or ``<method>@<band>`` (``none``, ``S,W`` or ``own``), ``+qprefill`` when the
    prefill was quantized: the name of a needle/decode entry in tables and ``kvq-eval compare``."""
    if method == "fp32":
        return "fp32"
    out = f"{method}@{'own' if band is None else band.label}"
    return out + ("+qprefill" if prefill == "quantized" else "")


def parse_entry(name: str) -> tuple[str, Band | None, str]:
    """Inverse of ``entry_id``."""
    if name == "fp32":
        return "fp32", Band(), "exact"
    prefill = "quantized" if name.endswith("+qprefill") else "exact"
    base = name[: -len("+qprefill")] if prefill == "quantized" else name
    method, sep, band = base.partition("@")
    if not sep:
        raise ValueError(f"entry {name!r} is not fp32 or <method>@<band>[+qprefill]")
    method_info(method)
    return method, parse_band(band), prefill


@contextmanager
def cell_lock(path: Path):
    """Hold an exclusive ``flock`` on ``<folder>/.<name>.lock`` while a cell is read, merged and written.

    Two runs (two ``kvq-eval run`` processes on one ``--out``) may fill different entries of the same
    needle cell; without the lock one run's read-merge-write can drop the other's entries. The kernel
    drops the lock if the process dies; lock files match ``.*.lock`` in ``.gitignore``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: never a shared temp file
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _check_calib_seed(calib_seed) -> None:
    if isinstance(calib_seed, bool) or not isinstance(calib_seed, int) or calib_seed < 0:
        raise ValueError(f"calib_seed must be a non-negative integer (the calibration's k-means seed), "
                         f"got {calib_seed!r}")


def _check_calib_tokens(calib_tokens) -> None:
    if isinstance(calib_tokens, bool) or not isinstance(calib_tokens, int) or not 256 <= calib_tokens <= 8192:
        raise ValueError(f"calib_tokens must be an integer in 256..8192 (two calibration sequences), "
                         f"got {calib_tokens!r}")


def _calibrated(method: str) -> bool:
    return method != "fp32" and bool(method_info(method).get("calibrated"))


def _file_name(method: str) -> str:
    """``nova``; ``nova_keys`` for ``nova:keys`` (no colon in file names)."""
    return method.replace(":", "_")


def _entry_file(name: str) -> str:
    return name.replace(":", "_").replace("@", "__").replace(",", "-").replace("+", "_")


def _own_band(method: str) -> Band:
    info = method_info(method)
    return Band(info.get("sink", 0), info.get("window", 0))


def _entry_stale(name: str, entry: dict, calib_tokens: int, calib_seed: int = 0) -> bool:
    method = parse_entry(name)[0]
    if method.startswith("plan:"):  # a plan's entry is of the plan file with that digest only
        from .planfile import registered_plans

        have = registered_plans().get(method)
        return have is None or ((entry.get("provenance") or {}).get("artifacts") or {}).get("plan") != have[1]
    # an entry without calib_seed was calibrated with seed 0 (the default, recorded only when not 0)
    return _calibrated(method) and (entry.get("calib_tokens") != calib_tokens or
                                    entry.get("calib_seed", 0) != calib_seed)


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a readable result file ({exc}); delete it to recompute the cell") from None


def _missing(unit: dict, calib_tokens: int, calib_seed: int = 0) -> list[str]:
    """Entries a unit still needs (all of them when its file is absent)."""
    stored = _read(unit["path"])
    if unit["task"] != "niah":
        if stored is None:
            return [unit["entry"]]
        return [unit["entry"]] if _entry_stale(unit["entry"], stored, calib_tokens, calib_seed) else []
    if stored is None:
        return list(unit["entries"])
    have = stored["results"]
    return [e for e in unit["entries"] if e not in have or _entry_stale(e, have[e], calib_tokens, calib_seed)]


def _merge_niah(path: Path, new: dict) -> dict:
    """``new`` (a needle cell for some entries) merged into the cell stored at ``path``, if any. The
    stored sample must be the one just made, never a silent mix of two samples."""
    old = _read(path)
    if old is None:
        return new
    fields = ("keys", "values", "prompt_tokens", "offset")
    if tuple(old.get(f) for f in fields) != tuple(new.get(f) for f in fields):
        raise ValueError(f"{path}: the stored needle sample differs from the one the generator now makes "
                         f"(keys {old.get('keys')!r} vs {new['keys']!r}); write to a fresh --out folder")
    old["results"].update(new["results"])
    old["prefills"] = old.get("prefills", []) + new.get("prefills", [])  # one per run that made entries
    return old


def plan(model: str, methods, out, contexts=(1024,), tasks=("ppl", "niah"), variants=VARIANTS,
         depths=(0.25, 0.5, 0.75), samples: int = 10, bands=("none",), prefill=("exact",),
         ppl_windows=((1024, 8),), decode=(1024, 512, 1), layers_tokens: int = 1024) -> list[dict]:
    """The grid's units (one per result file), before looking at what is stored."""
    methods = [m for m in dict.fromkeys(["fp32", *methods])]
    for m in methods:
        if m != "fp32":
            method_info(m)  # ValueError naming the known methods
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; known: {', '.join(TASKS)}")
    bad = set(prefill) - set(PREFILL_MODES)
    if bad:
        raise ValueError(f"prefill must be among {PREFILL_MODES}, got {sorted(bad)}")
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise ValueError(f"variants must be among {VARIANTS}, got {sorted(bad)}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    parsed = [parse_band(b) if isinstance(b, str) else b for b in bands]
    if not parsed:
        raise ValueError("bands must name at least one band")
    quant = [m for m in methods if m != "fp32"]
    root = Path(out) / slug(model)
    units = []
    # a plan (kvq_eval.planfile) is a whole setting: it runs with its own band only
    bands_of = {m: [_own_band(m)] if m.startswith("plan:") else parsed for m in quant}
    entries = ["fp32"] + [entry_id(m, b, p) for m in quant for b in bands_of[m] for p in prefill]
    if "ppl" in tasks:
        for tokens, count in ppl_windows:
            for m in quant:
                for b in bands_of[m]:
                    e = entry_id(m, b)
                    units.append({"task": "ppl", "entry": e, "tokens": tokens, "windows": count,
                                  "path": root / "ppl" / f"{_entry_file(e)}__T{tokens}x{count}.json"})
    if "layers" in tasks:
        for m in quant:
            for b in bands_of[m]:
                e = entry_id(m, b)
                units.append({"task": "layers", "entry": e, "tokens": layers_tokens,
                              "path": root / "layers" / f"{_entry_file(e)}__T{layers_tokens}.json"})
    if "decode" in tasks:
        prefix, new, count = decode
        for e in entries:
            units.append({"task": "decode", "entry": e, "prefix": prefix, "new_tokens": new, "windows": count,
                          "path": root / "decode" / f"{_entry_file(e)}__P{prefix}_N{new}x{count}.json"})
    if "niah" in tasks:
        for c in contexts:
            for v in variants:
                for d in depths:
                    for s in range(samples):
                        units.append({"task": "niah", "entries": entries, "cell": (v, c, float(d), s),
                                      "path": root / "niah" / f"{v}_ctx{c}_d{float(d):g}_s{s}.json"})
    return units


def recent_median(records, latest: int = RECENT) -> float:
    """Median seconds of the ``latest`` newest of ``records``, ``(finished, seconds)`` pairs.

    ``finished`` is ``provenance.finished()``'s UTC time (text that sorts in time order), or None for
    a record made before it was kept. Where any record is dated only dated ones count: records
    made by older code (an 8K perplexity window took about twice as long before e19507b) or while the
    machine ran something else would overstate what is left.
    Undated records are all used where none is dated.
    """
    import statistics

    dated = sorted((r for r in records if r[0]), key=lambda r: r[0])
    return statistics.median(s for _, s in (dated[-latest:] if dated else records))


def estimate_seconds(units: list[dict], calib_tokens: int, calib_seed: int = 0) -> tuple[float, int]:
    """(seconds, units without an estimate) of what ``units`` still need, at the speeds the folder's
    own cells recorded: per perplexity window of each length, per needle entry at each context and
    per needle prompt's shared exact prefill at each context (recorded in ``prefills`` by runs since
    it was added; a prompt without any such record at its context counts as unestimated), per
    layers cell. Each is ``recent_median`` of the stored records of that kind for the same method
    (NOVA-KV's needle entries take 3-6x TurboQuantMSE's), or of every method where that method has
    none yet, partial cells included. A kind with no record at all counts its units as unestimated.
    The machine and its load are those of the recorded runs: an estimate, for planning, not a
    benchmark."""
    records: dict[tuple, list[tuple]] = {}

    def record(kind, method, rows):
        timed = [(r.get("finished"), r["seconds"]) for r in rows if "seconds" in r]
        for key in (kind, (*kind, method)):
            records.setdefault(key, []).extend(timed)

    need_of = []  # (unit index, kind, method, count)
    for i, u in enumerate(units):
        need = _missing(u, calib_tokens, calib_seed)
        stored = _read(u["path"])
        if u["task"] == "ppl":
            kind, method = ("ppl", u["tokens"]), parse_entry(u["entry"])[0]
            partial = _read(_partial_path(u)) if stored is None else None
            rows = (stored or {}).get("windows") or (partial or {}).get("rows") or []
            record(kind, method, rows)
            need_of.append((i, kind, method, (u["windows"] - len(rows)) if need else 0))
        elif u["task"] == "niah":
            kind = ("niah", u["cell"][1])
            for name, r in (stored or {}).get("results", {}).items():
                record(kind, parse_entry(name)[0], [r])
            need_of.extend((i, kind, parse_entry(e)[0], 1) for e in need)
            # the exact prefill every entry of a run shares, once per prompt that lacks an entry
            prefill = ("niah-prefill", u["cell"][1])
            record(prefill, "", (stored or {}).get("prefills", []))
            need_of.append((i, prefill, "", 1 if need else 0))
        else:
            kind, method = (u["task"],), parse_entry(u["entry"])[0]
            if stored is not None and "wall_seconds" in stored:
                record(kind, method, [{"finished": stored.get("finished"), "seconds": stored["wall_seconds"]}])
            need_of.append((i, kind, method, 1 if need else 0))
    total, unknown = 0.0, set()
    for i, kind, method, n in need_of:
        known = records.get((*kind, method)) or records.get(kind)
        if n and known:
            total += n * recent_median(known)
        elif n:
            unknown.add(i)
    return total, len(unknown)


def _partial_path(unit: dict) -> Path:
    """Where a perplexity cell keeps its finished windows until the cell is complete (not ``*.json``:
    tables never read it)."""
    return unit["path"].with_name(unit["path"].name + ".partial")
