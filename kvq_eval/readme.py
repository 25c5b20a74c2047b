"""Refresh the generated tables of Markdown files from the committed JSON (``kvq-eval readme``).

A generated table follows a marker line (a blank line between them is allowed) and is rebuilt from
the results folder, so that a new result cell never leaves a stale number behind; the prose and
every unmarked table are left as they are. Markers:

- ``<!-- kvq-eval table MODEL [VARIANT] [all|filled] -->``: rows of ``kvq-eval table`` (``VARIANT``
  ``single``, ``multiquery``, ``decode``, or ``-`` for every needle variant). The file's header is
  kept (a table may show a subset of the columns) and each row is recomputed from its entry; with
  ``all`` the rows are every entry, in ``kvq-eval table``'s order, and ``filled`` drops the rows that
  are "–" in every shown column;
- ``<!-- kvq-eval compare MODEL A B ppl -->``: ``kvq-eval compare``'s paired perplexity table (one
  row per window length), and ``<!-- kvq-eval compare MODEL A B needles [VARIANT] -->`` its paired
  needle table (``single`` by default);
- ``<!-- kvq-eval recommend MODEL -->``: ``kvq-eval recommend`` (``kvq_eval.recommend``);
- ``<!-- kvq-eval overlap MODEL CTX[,CTX...] -->``: how much haystack filler the grid's 30 needle
  samples of each context share (``niah.filler_overlap`` with the model's tokenizer, single needle,
  the grid's depths and samples);
- ``<!-- kvq-eval sink FILE MODEL[,MODEL...] -->``: ``sink.sink_table`` of each model's ``kvq-eval
  sink`` report ``<results>/MODEL/FILE`` (a row of "–" while that file is absent);
- ``<!-- kvq-eval reproduce FILE.json -->``: ``reproduce.format_comparison`` of a committed
  ``kvq-eval reproduce -o`` file, ``FILE`` relative to the folder above the results folder
  (``results/numerics/smollm2.json`` is ``numerics/smollm2.json``);
- ``<!-- kvq-eval study MODEL -->``: the planner's study of that model (``planstudy.study_table``),
  read from ``plan/MODEL/study.json`` beside the results folder (``results/plan`` for
  ``results/eval_v3``), or a row saying that the study has not been run while that file is absent.

Anything the JSON cannot give (an entry without results, a column the command does not print) raises
``ValueError`` naming the file and line; the file is then left as it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .plot import (comparison_table, decode_table, load_results, markdown_table, paired_comparison, paired_ppl,
                   ppl_comparison_table)
from .recommend import recommend_table

__all__ = ["refresh_markdown", "refresh_file"]

Results = Callable[[str], dict]  # model -> load_results of that model, loaded once
_MARK = re.compile(r"^<!-- kvq-eval (table|compare|recommend|overlap|study|sink|reproduce) (.+?) -->$")
GRID_DEPTHS, GRID_SAMPLES = (0.1, 0.3, 0.5, 0.7, 0.9), 6  # make eval's needles (30 per context)
_TABLE = re.compile(r"^(\w+)(?: (single|multiquery|decode|-))?(?: (all|filled))?$")
_COMPARE = re.compile(r"^(\w+) (\S+) (\S+) (ppl|needles)(?: (single|multiquery|all))?$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table: header, ``---`` line, rows."""
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [row(header), "|" + "---|" * len(header)] + [row(r) for r in rows]


def _parse(text: str) -> list[list[str]]:
    """A Markdown table's rows (header first, the ``---`` line dropped)."""
    return [_cells(line) for line in text.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]


# the column names kvq-eval table prints for some window length or needle context (plot.markdown_table)
_COLUMN = re.compile(r"^(bits @\w+|Δppl \w+ \[95% t-CI\] \(windows\)|KL \w+|cache bits \w+|"
                     r"exact \w+ \[Wilson 95%\] \(n\)|Δlog-prob \w+ \[95% t-CI\])$")


def _entry_table(old: list[list[str]], gen: list[list[str]], rows_from: str | None, where: str) -> list[str]:
    header, ghead = old[0], gen[0]
    missing = [h for h in header if h not in ghead]
    unknown = [h for h in missing if not _COLUMN.match(h)]
    if unknown:
        raise ValueError(f"{where}: columns {unknown} are not in the kvq-eval table output")
    # a column of a window length or context that has no cell yet shows "–" in every row (pending)
    gen = [list(r) + ["–"] * len(missing) for r in gen]
    ghead = gen[0][:len(ghead)] + missing
    idx = [ghead.index(h) for h in header]
    by_entry: dict[str, list[list[str]]] = {}
    for r in gen[1:]:
        by_entry.setdefault(r[0], []).append(r)
    if rows_from == "all":
        rows = gen[1:]
    elif rows_from == "filled":
        rows = [r for r in gen[1:] if any(r[i] != "–" for i in idx[1:])]
    else:
        rows = []
        for r in old[1:]:
            got = by_entry.get(r[0])
            if not got:
                raise ValueError(f"{where}: entry {r[0]!r} has no results")
            # decode tables hold one row per (entry, setting): keep the file's row of each setting
            match = [g for g in got if all(g[ghead.index(h)] == v for h, v in zip(header, r)
                                           if h in ("prefill", "prefix + new"))]
            if not match:
                raise ValueError(f"{where}: no kvq-eval row for {' | '.join(r)}")
            rows.append(match[0])
    return _table(header, [[r[i] for i in idx] for r in rows])


def _generate(kind: str, args: str, old: list[list[str]], results: Results, where: str, folder: Path) -> list[str]:
    if kind == "table":
        m = _TABLE.match(args)
        if not m:
            raise ValueError(f"{where}: expected '<!-- kvq-eval table MODEL [VARIANT] [all|filled] -->'")
        model, variant, rows_from = m.groups()
        res = results(model)
        text = decode_table(res) if variant == "decode" else markdown_table(res, None if variant in (None, "-") else variant)
        return _entry_table(old, _parse(text), rows_from, where)
    if kind == "compare":
        m = _COMPARE.match(args)
        if not m:
            raise ValueError(f"{where}: expected '<!-- kvq-eval compare MODEL A B ppl|needles [VARIANT] -->'")
        model, a, b, what, variant = m.groups()
        res = results(model)
        if what == "ppl":
            cmp = paired_ppl(res, a, b)
            if not cmp:
                raise ValueError(f"{where}: {a} and {b} share no perplexity cell")
            return _parse(ppl_comparison_table(cmp, a, b))
        variant = variant or "single"
        cells = [c for c in res["niah"] if variant == "all" or c["variant"] == variant]
        return _parse(comparison_table(paired_comparison(cells, a, b), a, b))
    if kind == "overlap":
        m = re.fullmatch(r"(\w+) (\d+(?:,\d+)*)", args.strip())
        if not m:
            raise ValueError(f"{where}: expected '<!-- kvq-eval overlap MODEL CTX[,CTX...] -->'")
        return _parse(overlap_table(m.group(1), [int(c) for c in m.group(2).split(",")]))
    if kind == "sink":
        m = re.fullmatch(r"([\w.-]+\.json) (\w+(?:,\w+)*)", args.strip())
        if not m:
            raise ValueError(f"{where}: expected '<!-- kvq-eval sink FILE.json MODEL[,MODEL...] -->'")
        return _parse(sink_markdown(folder, m.group(1), m.group(2).split(",")))
    if kind == "reproduce":
        from .reproduce import format_comparison

        path = folder.parent / args.strip()
        if not re.fullmatch(r"[\w./-]+\.json", args.strip()) or not path.is_file():
            raise ValueError(f"{where}: expected '<!-- kvq-eval reproduce FILE.json -->' naming a file under "
                             f"{folder.parent}")
        return _parse(format_comparison(json.loads(path.read_text())))
    if kind == "study":
        if not re.fullmatch(r"\w+", args.strip()):
            raise ValueError(f"{where}: expected '<!-- kvq-eval study MODEL -->'")
        return _parse(study_markdown(folder.parent / "plan" / args.strip() / "study.json"))
    model = args.strip()
    if not re.fullmatch(r"\w+", model):
        raise ValueError(f"{where}: expected '<!-- kvq-eval recommend MODEL -->'")
    return _parse(recommend_table(results(model)))


def study_markdown(path: Path) -> str:
    """``planstudy.study_table`` of the study JSON at ``path``, or a one-row table saying that it has
    not been run while ``path`` is absent; ``ValueError`` naming the file when it is not a study."""
    from .planstudy import study_table

    if not path.is_file():
        return ("| target | plan |\n|---|---|\n"
                f"| – | the study has not been run: no {path.parent.name}/{path.name} yet (`make plan-study`) |")
    try:
        return study_table(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: not a kvq-plan study ({type(exc).__name__}: {exc})") from None


def sink_markdown(folder: Path, name: str, models) -> str:
    """``sink.sink_table`` of ``folder/MODEL/name`` for each model (a row of "–" where it is absent);
    ``ValueError`` naming the file when it is not JSON or not a sink report."""
    from .sink import sink_table

    reports = []
    for model in models:
        path = folder / model / name
        try:
            reports.append((model, json.loads(path.read_text()) if path.is_file() else None))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not readable JSON ({exc})") from None
    try:
        return sink_table(reports)
    except ValueError as exc:
        raise ValueError(f"{folder}/*/{name}: {exc}") from None


def overlap_table(model: str, contexts) -> str:
    """``niah.filler_overlap`` of the grid's single-needle samples per context, as Markdown."""
    from .models import load_tokenizer
    from .niah import filler_overlap

    tok = load_tokenizer(model)
    head = ["context", "haystack (sentences)", "prompts", "prompts per filler sentence (mean, max)",
            "shared filler between two prompts (mean, max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in contexts:
        o = filler_overlap(tok, "single", c, GRID_DEPTHS, GRID_SAMPLES)
        lines.append(f"| {c} | {o['haystack']} ({o['haystack_sentences']}) | {o['prompts']} | {o['mean_uses']:.2f}, "
                     f"{o['max_uses']} | {100 * o['pair_overlap']:.1f} %, {100 * o['max_pair_overlap']:.1f} % |")
    return "\n".join(lines)


def refresh_markdown(text: str, results_dir, name: str = "README.md") -> str:
    """``text`` with every marked table (module docstring) rebuilt from ``results_dir``.

    Parameters
    ----------
    text : str
        A Markdown file's content.
    results_dir : str or Path
        The results folder (``results/eval_v3``), one subfolder per model; study markers read
        ``plan/`` beside it.
    name : str
        The file's name, for error messages.

    Returns
    -------
    str
        The text with its marked tables replaced; everything else untouched.
    """
    cache: dict[str, dict] = {}

    def results(model: str) -> dict:
        if model not in cache:
            cache[model] = load_results(str(results_dir), model)
        return cache[model]

    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        m = _MARK.match(line.strip())
        i += 1
        if not m:
            continue
        where = f"{name} line {i}"
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not lines[j].startswith("|"):
            raise ValueError(f"{where}: a '<!-- kvq-eval {m.group(1)} -->' marker must be followed by a table")
        k = j
        while k < len(lines) and lines[k].startswith("|"):
            k += 1
        out.extend(lines[i:j])  # the blank lines between marker and table
        rows = _generate(m.group(1), m.group(2), _parse("\n".join(lines[j:k])), results, where, Path(results_dir))
        out.extend(_table(rows[0], rows[1:]) if m.group(1) != "table" else rows)
        i = k
    return "\n".join(out)


def refresh_file(path, results_dir, check: bool = False) -> bool:
    """Refresh the marked tables of the Markdown file at ``path`` in place (or, with ``check``, only
    compare). True when it changed (or, with ``check``, would change)."""
    path = Path(path)
    old = path.read_text()
    new = refresh_markdown(old, results_dir, path.name)
    if new != old and not check:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return new != old
