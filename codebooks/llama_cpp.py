"""Rewrite the turbo2/3/4 tables of a llama.cpp TurboQuant fork checkout to the exact Lloyd-Max levels.

Notes
-----
The fork (TheTom/llama-cpp-turboquant) repeats its turbo tables in its CPU reference, CUDA, Metal and
Vulkan sources, and hard-codes thresholds as if-chains and function-local arrays, so a header with
the exact tables (``kvq-codebooks export --format llama.cpp --out``) is not drop-in. Instead
``kvq-codebooks export --format llama.cpp --apply-to FORK_DIR`` edits the checkout in place (or,
with ``--patch FILE``, writes a unified diff). What it edits is data: a *fork profile* per fork
revision in ``codebooks/data/llama_cpp/forks.json``::

    name, repository, revision, dim       which revision (dim: its rotation group, 128)
    files: {path: {"requires": [text], "definitions": [definition]}}
    definition:
      name      what the fork calls it (messages only)
      anchor    code text that starts the definition (comments and strings never match)
      count     how many times the anchor occurs in the file (default 1); each is rewritten
      end       the code text that ends it (";" for an array, "}" for an if-chain function body)
      bits      2, 3 or 4;  values: "levels" or "thresholds";  select: [start, stop] (default all)
      type      "float" (float32 literals) or "half" (float16 literals)
      holds     the decimal literals, as written, that the revision holds there (in order)

Every floating literal (``-0.133462f``, ``0.0``, ``0.117832h``) between an anchor and its end is
one entry of the table slice, in order. The rewrite replaces exactly those literals whose value
changes (the middle threshold 0 stays) and touches no other byte: not comments, not whitespace.

Refusals (one ``ForkMismatch`` listing every problem; nothing is written):

* a profile file is missing, a symlink or not UTF-8; a ``requires`` text is absent;
* an anchor occurs another number of times than ``count``, or has no ``end``;
* a definition holds other literals than ``holds`` (or than the exact values: already rewritten);
* a profile file holds a literal equal to one of the fork's non-zero table values outside its
  definitions, or any other source file under ``ggml/`` does (a table the profile does not know).

New literals: the shortest decimal that reads back as the target value however a compiler reads it
(directly rounded to the type, or through double, or for half through float as well), with the
token's own suffix (``f``, ``h`` or none); where no short decimal is safe, the exact decimal
expansion of the value. Targets: the float32 rounding of the exact levels of SphereMarginal(dim)
and of their float64 midpoints (``Codebook.thresholds``), or the float16 rounding of the float64
values for ``half`` tables. Those are the tables of the ``kvq_ref`` TurboBlock profile
``fork@69d8e4be+exact``, so the rewritten CPU reference writes its bytes.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from ._atomic import write_file
from .export import llama_cpp_codebooks

__all__ = ["ForkMismatch", "ForkProfile", "ForkRewrite", "FORK_PROFILES", "load_fork_profiles", "plan_rewrite",
           "exact_values", "scan_literals", "mask_comments"]

FORK_PROFILES = Path(__file__).resolve().parent / "data" / "llama_cpp" / "forks.json"
#: source files the stray-table scan reads under <checkout>/ggml
SOURCE_SUFFIXES = {".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".metal", ".m", ".mm", ".comp", ".glsl",
                   ".cl", ".wgsl", ".sycl"}
_LITERAL = re.compile(r"(?<![\w.])(-?)(\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?([fFhH]?)(?![\w.])")
_DTYPES = {"float": np.float32, "half": np.float16}


class ForkMismatch(ValueError):
    """The checkout is not the profile's revision (or was edited): every problem, one per line."""


def mask_comments(text: str) -> str:
    """``text`` with C/C++/GLSL/Metal comments and string literals blanked (same length, newlines kept)."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def scan_literals(masked: str, start: int = 0, stop: int | None = None) -> list[re.Match]:
    """Floating literals (with an adjacent minus sign) of ``masked[start:stop]``."""
    return list(_LITERAL.finditer(masked, start, len(masked) if stop is None else stop))


def _value(token: str) -> Fraction:
    return Fraction(token.rstrip("fFhH"))


def _nearest(x: Fraction, dtype) -> np.generic:
    """``x`` rounded once to ``dtype`` (float16 or float32), ties to even."""
    f = dtype(float(x))
    cands = [c for c in (np.nextafter(f, dtype(-np.inf)), f, np.nextafter(f, dtype(np.inf))) if np.isfinite(c)]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(f"u{c.itemsize}")) & 1))


def _reads_back(text: str, value: np.generic) -> bool:
    """Every way a compiler may read ``text`` into ``value``'s type gives ``value``."""
    dtype = type(value)
    x = Fraction(text)
    paths = [_nearest(x, dtype), dtype(float(text))]
    if dtype is np.float16:
        paths.append(np.float16(np.float32(float(text))))
    return all(p == value for p in paths)


def literal(value: np.generic, suffix: str) -> str:
    """The C/GLSL literal of a float32 or float16 ``value`` (module Notes), with ``suffix``."""
    short = np.format_float_positional(value, unique=True, trim="0")
    if short.endswith("."):
        short += "0"
    text = short if _reads_back(short, value) else _exact_decimal(value)
    return text + suffix


def _exact_decimal(value: np.generic) -> str:
    fr = Fraction(float(value))
    sign, fr = ("-" if fr < 0 else ""), abs(fr)
    digits = 0
    while (fr * 10**digits).denominator != 1:
        digits += 1
    if not digits:
        return f"{sign}{int(fr)}.0"
    whole = str(int(fr * 10**digits)).rjust(digits + 1, "0")
    return f"{sign}{whole[:-digits]}.{whole[-digits:]}"


def exact_values(bits, dim: int) -> dict[tuple[int, str], np.ndarray]:
    """``{(bits, "levels"|"thresholds"): float64 array}`` of SphereMarginal(dim) (correctly rounded)."""
    out = {}
    for cb in llama_cpp_codebooks(list(bits), dim):
        out[cb.bits, "levels"], out[cb.bits, "thresholds"] = cb.levels, cb.thresholds
    return out


# --- profiles ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Definition:
    name: str
    anchor: str
    end: str
    bits: int
    values: str
    select: tuple[int, int]
    type: str
    holds: tuple[str, ...]
    count: int = 1


@dataclass(frozen=True)
class ForkProfile:
    """One validated fork profile record (module Notes)."""

    name: str
    repository: str
    revision: str
    dim: int
    files: dict  # path -> (requires tuple, definitions tuple)

    def fork_values(self) -> set[Fraction]:
        """Absolute values of every non-zero literal the profile's definitions hold."""
        return {abs(_value(t)) for _, defs in self.files.values() for d in defs for t in d.holds} - {0}


def _bad(where: str, what: str):
    raise ValueError(f"llama.cpp fork profile {where}: {what}")


def _definition(where: str, rec) -> Definition:
    keys = {"name", "anchor", "end", "bits", "values", "select", "type", "holds", "count"}
    if not isinstance(rec, dict) or not {"name", "anchor", "end", "bits", "values", "type", "holds"} <= set(rec) \
            or set(rec) - keys:
        _bad(where, f"a definition must have name, anchor, end, bits, values, type, holds [, select, count]; got "
                    f"{sorted(rec) if isinstance(rec, dict) else rec!r}")
    where = f"{where} definition {rec['name']!r}"
    for key in ("name", "anchor", "end"):
        if not isinstance(rec[key], str) or not rec[key].strip():
            _bad(where, f"{key} must be a non-empty string")
    if rec["bits"] not in (2, 3, 4) or isinstance(rec["bits"], bool):
        _bad(where, f"bits must be 2, 3 or 4, got {rec['bits']!r}")
    if rec["values"] not in ("levels", "thresholds"):
        _bad(where, f"values must be 'levels' or 'thresholds', got {rec['values']!r}")
    if rec["type"] not in _DTYPES:
        _bad(where, f"type must be one of {sorted(_DTYPES)}, got {rec['type']!r}")
    size = (1 << rec["bits"]) - (rec["values"] == "thresholds")
    sel = rec.get("select", [0, size])
    if not (isinstance(sel, list) and len(sel) == 2 and all(type(v) is int for v in sel) and 0 <= sel[0] < sel[1] <= size):
        _bad(where, f"select must be [start, stop] within 0..{size}, got {sel!r}")
    holds = rec["holds"]
    if not isinstance(holds, list) or len(holds) != sel[1] - sel[0] or \
            not all(isinstance(t, str) and _LITERAL.fullmatch(t) for t in holds):
        _bad(where, f"holds must be {sel[1] - sel[0]} floating literals, got {holds!r}")
    count = rec.get("count", 1)
    if type(count) is not int or count < 1:
        _bad(where, f"count must be a positive integer, got {count!r}")
    return Definition(rec["name"], rec["anchor"], rec["end"], rec["bits"], rec["values"], tuple(sel), rec["type"],
                      tuple(holds), count)


def _profile(rec) -> ForkProfile:
    if not isinstance(rec, dict) or set(rec) != {"name", "repository", "revision", "dim", "files"}:
        _bad(repr(rec.get("name") if isinstance(rec, dict) else rec),
             "a record has exactly name, repository, revision, dim and files")
    where = repr(rec["name"])
    if not all(isinstance(rec[k], str) and rec[k] for k in ("name", "repository", "revision")):
        _bad(where, "name, repository and revision must be non-empty strings")
    if type(rec["dim"]) is not int or rec["dim"] < 2:
        _bad(where, f"dim must be an integer >= 2, got {rec['dim']!r}")
    if not isinstance(rec["files"], dict) or not rec["files"]:
        _bad(where, "files must map paths to {requires, definitions}")
    files = {}
    for path, spec in rec["files"].items():
        p = Path(path)
        if p.is_absolute() or ".." in p.parts or not isinstance(spec, dict) or set(spec) != {"requires", "definitions"}:
            _bad(where, f"files[{path!r}] must be a relative path inside the checkout with requires and definitions")
        if not isinstance(spec["requires"], list) or not all(isinstance(t, str) and t for t in spec["requires"]):
            _bad(where, f"files[{path!r}].requires must be a list of texts")
        defs = tuple(_definition(f"{where} {path}", d) for d in spec["definitions"])
        files[path] = (tuple(spec["requires"]), defs)
    return ForkProfile(rec["name"], rec["repository"], rec["revision"], rec["dim"], files)


def load_fork_profiles(path=None) -> dict[str, ForkProfile]:
    """Every fork profile of a profiles file (default: the shipped ``FORK_PROFILES``), by name."""
    path = Path(FORK_PROFILES if path is None else path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"llama.cpp fork profiles file {path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("forks"), list):
        raise ValueError(f"llama.cpp fork profiles file {path}: expected {{'schema': 1, 'forks': [...]}}")
    out: dict[str, ForkProfile] = {}
    for rec in doc["forks"]:
        prof = _profile(rec)
        if prof.name in out:
            raise ValueError(f"llama.cpp fork profiles file {path}: {prof.name!r} is defined twice")
        out[prof.name] = prof
    return out


# --- the rewrite ---------------------------------------------------------------------------------
@dataclass
class ForkRewrite:
    """The checked rewrite of one checkout: new file texts, what changes, what was already exact."""

    folder: Path
    profile: ForkProfile
    old: dict[str, str] = field(default_factory=dict)
    new: dict[str, str] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)   # "path:line name" per rewritten definition
    already: list[str] = field(default_factory=list)   # definitions that already hold the exact values

    @property
    def files_changed(self) -> list[str]:
        return [p for p in self.new if self.new[p] != self.old[p]]

    def patch(self) -> str:
        """A unified diff (``git apply`` / ``patch -p1``) of the rewrite."""
        out = []
        for p in self.files_changed:
            out += difflib.unified_diff(self.old[p].splitlines(keepends=True), self.new[p].splitlines(keepends=True),
                                        f"a/{p}", f"b/{p}")
        return "".join(out)

    def apply(self) -> list[str]:
        """Write the changed files (each atomically, keeping its mode); returns their paths."""
        written = []
        for p in self.files_changed:
            target = self.folder / p
            mode = stat.S_IMODE(target.stat().st_mode)
            write_file(target, self.new[p].encode("utf-8"))
            os.chmod(target, mode)
            written.append(p)
        return written


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _read_source(folder: Path, rel: str, problems: list[str]) -> str | None:
    path = folder / rel
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
    except OSError:
        inside = False
    if path.is_symlink() or not inside:
        problems.append(f"{rel}: a symlink or outside the checkout (refused: the rewrite edits files in place)")
        return None
    if not path.is_file():
        problems.append(f"{rel}: missing (not a regular file)")
        return None
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        problems.append(f"{rel}: not UTF-8 text")
        return None


def _targets(defn: Definition, exact: dict) -> list[np.generic]:
    vals = exact[defn.bits, defn.values][defn.select[0]:defn.select[1]]
    return [_DTYPES[defn.type](v) for v in vals]


def _rewrite_file(rel: str, text: str, requires, defs, exact, bits, prof: ForkProfile, plan: ForkRewrite,
                  problems: list[str]) -> None:
    masked = mask_comments(text)
    for req in requires:
        if req not in masked:
            problems.append(f"{rel}: lacks {req!r}, which {prof.name} has")
    edits, spans = [], []
    for d in defs:
        starts = [m.start() for m in re.finditer(re.escape(d.anchor), masked)]
        if len(starts) != d.count:
            problems.append(f"{rel}: {d.name}: {d.anchor!r} occurs {len(starts)} time(s), {prof.name} has {d.count}")
            continue
        for s in starts:
            stop = masked.find(d.end, s + len(d.anchor))
            if stop < 0:
                problems.append(f"{rel}:{_line(text, s)}: {d.name} has no {d.end!r} after its start")
                continue
            spans.append((s, stop))
            toks = scan_literals(masked, s + len(d.anchor), stop)
            found = [m.group(0) for m in toks]
            targets = _targets(d, exact)
            where = f"{rel}:{_line(text, s)} {d.name}"
            if found == list(d.holds):
                pass
            elif len(found) == len(targets) and all(_nearest(_value(t), type(v)) == v for t, v in zip(found, targets)):
                plan.already.append(where)
                continue
            else:
                problems.append(f"{where} holds {found}: neither {prof.name}'s {list(d.holds)} nor the exact values")
                continue
            if d.bits not in bits:
                continue
            n_edit = 0
            for m, v in zip(toks, targets):
                if _nearest(_value(m.group(0)), type(v)) == v:
                    continue  # unchanged value (the middle threshold 0): the token stays as written
                if (m.group(1) == "-") != bool(v < 0):
                    problems.append(f"{where}: the exact value {float(v)!r} has another sign than {m.group(0)}")
                    continue
                edits.append((m.start(), m.end(), literal(v, m.group(3))))
                n_edit += 1
            if n_edit:
                plan.changed.append(where)
    fork_vals = prof.fork_values()
    for m in scan_literals(masked):
        if not any(a <= m.start() < b for a, b in spans) and abs(_value(m.group(0))) in fork_vals:
            problems.append(f"{rel}:{_line(text, m.start())}: {m.group(0)} (a value of the fork's tables) outside the "
                            f"definitions {prof.name} lists")
    new = text
    for a, b, tok in sorted(edits, reverse=True):
        new = new[:a] + tok + new[b:]
    plan.old[rel], plan.new[rel] = text, new


def _stray_files(folder: Path, prof: ForkProfile, problems: list[str]) -> None:
    """Source files under ggml/ that the profile does not list but that hold a fork table value."""
    root = folder / "ggml"
    if not root.is_dir():
        return
    needles = sorted({str(v).lstrip("-") for _, defs in prof.files.values() for d in defs for v in d.holds
                      if _value(v) != 0 and "." in v})
    needles = [n.rstrip("fFhH").encode() for n in needles]
    listed = {Path(p) for p in prof.files}
    vals = prof.fork_values()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            path = Path(dirpath) / fn
            rel = path.relative_to(folder)
            if rel in listed or path.suffix not in SOURCE_SUFFIXES or path.is_symlink():
                continue
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if not any(n in raw for n in needles):
                continue
            text = raw.decode("utf-8", errors="replace")
            masked = mask_comments(text)
            hits = [m for m in scan_literals(masked) if abs(_value(m.group(0))) in vals]
            if hits:
                problems.append(f"{rel}:{_line(text, hits[0].start())}: {hits[0].group(0)} (a value of the fork's "
                                f"tables) in a file {prof.name} does not list")


def plan_rewrite(folder, bits=(2, 3, 4), profile: str | None = None, profiles_file=None) -> ForkRewrite:
    """Check a fork checkout against a profile and compute the rewrite to the exact tables.

    Parameters
    ----------
    folder : path of the checkout (its root: the profile's paths are relative to it)
    bits : the table widths to rewrite (2, 3, 4 by default: turbo2/3/4); the others are still checked
    profile : a profile name; default: the one profile of the file that the checkout matches

    Returns
    -------
    ForkRewrite (``apply()`` writes it, ``patch()`` is its diff; nothing is written before)

    Raises
    ------
    ForkMismatch
        The checkout does not match (module Notes); the message lists every problem.
    ValueError
        Bad arguments, or a bad profiles file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--apply-to {folder}: not a folder (give the root of a llama.cpp fork checkout)")
    bits = tuple(bits)
    if not bits or any(b not in (2, 3, 4) for b in bits):
        raise ValueError(f"bits must be among 2, 3, 4 (turbo2/3/4) for a fork rewrite, got {list(bits)}")
    profs = load_fork_profiles(profiles_file)
    if profile is not None and profile not in profs:
        raise ValueError(f"fork profile must be one of {list(profs)}, got {profile!r}")
    failures = []
    for name in ([profile] if profile else list(profs)):
        prof = profs[name]
        exact = exact_values((2, 3, 4), prof.dim)
        plan, problems = ForkRewrite(folder, prof), []
        for rel, (requires, defs) in prof.files.items():
            text = _read_source(folder, rel, problems)
            if text is not None:
                _rewrite_file(rel, text, requires, defs, exact, bits, prof, plan, problems)
        _stray_files(folder, prof, problems)
        if not problems:
            return plan
        failures.append(f"not {prof.name} ({prof.repository}@{prof.revision[:12]}):\n  " + "\n  ".join(problems))
    raise ForkMismatch(f"{folder}: nothing was changed; the checkout does not match a known fork revision, "
                       "or its files were edited:\n" + "\n".join(failures))
