"""Refresh the README's evaluation tables from the committed JSON (``kvq-eval readme``).

The README's evaluation section (from its ``**Status.**`` paragraph to ``**The v1 results**``)
quotes three kinds of ``kvq-eval`` output, and this module recomputes each from the results folder,
so that a new result cell never leaves a stale number behind:

- a summary table (first column ``entry``) right after a marker line
  ``<!-- kvq-eval table MODEL [VARIANT] [all|filled] -->`` (``VARIANT`` is ``single``,
  ``multiquery``, ``decode`` or ``-`` for every needle variant). The README's header is kept (a
  table may show a subset of ``kvq-eval table``'s columns) and every row is recomputed from the row
  of its entry; with ``all`` the rows are every entry ``kvq-eval table`` prints, in its order, so a
  new entry appears by itself; ``filled`` is ``all`` less the rows that are "–" in every column the
  README shows (a needle table then gains a method's row with its first needle cell, and is not
  padded with entries that only have perplexity cells);
- a paired needle table (first column ``context``) under a line naming "`A` against `B`": the
  ``kvq-eval compare A B --variant single`` table of SmolLM2;
- a paired 8K perplexity table (first column ``A − B at 8K``, or ``A − B at 8K (Gemma-3)``): each
  row "A − B ..." from the 8K row of ``kvq-eval compare A B`` (Δ NLL with its interval, ratio, p,
  per-window differences; written with "−" and "1.2 %" as the prose does).

Anything the JSON cannot give (an entry without results, a column ``kvq-eval table`` does not
print) raises ``ValueError`` naming it; the README is then left as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .plot import (comparison_table, decode_table, load_results, markdown_table, paired_comparison, paired_ppl,
                   ppl_comparison_table)

__all__ = ["refresh_readme", "refresh_readme_file"]

SECTION = ("**Status.**", "**The v1 results**")
PAIRED_8K = {"A − B at 8K": "smollm2", "A − B at 8K (Gemma-3)": "gemma3"}
Results = Callable[[str], dict]  # model -> load_results of that model, loaded once
_MARK = re.compile(r"^<!-- kvq-eval table (\w+)(?: (single|multiquery|decode|-))?(?: (all|filled))? -->$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table: header, ``---`` line, rows."""
    return [_row(header), "|" + "---|" * len(header)] + [_row(r) for r in rows]


def _parse(text: str) -> list[list[str]]:
    """A Markdown table's rows (header first, the ``---`` line dropped)."""
    return [_cells(line) for line in text.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]


def _blocks(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, end line, the last non-blank line before it) of each table in ``lines``."""
    out, i, prev = [], 0, ""
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append((i, j, prev))
            i = j
            continue
        if lines[i].strip():
            prev = lines[i]
        i += 1
    return out


def _summary(results: Results, model: str, variant: str | None) -> list[list[str]]:
    res = results(model)
    text = decode_table(res) if variant == "decode" else markdown_table(res, variant)
    return _parse(text)


def _entry_table(old: list[list[str]], gen: list[list[str]], rows_from: str | None, where: str) -> list[str]:
    header, ghead = old[0], gen[0]
    missing = [h for h in header if h not in ghead]
    if missing:
        raise ValueError(f"{where}: columns {missing} are not in the kvq-eval table output")
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
            # decode tables hold one row per (entry, setting): keep the README's row of each setting
            match = [g for g in got if all(g[ghead.index(h)] == v for h, v in zip(header, r)
                                           if h in ("prefill", "prefix + new"))]
            if not match:
                raise ValueError(f"{where}: no kvq-eval row for {' | '.join(r)}")
            rows.append(match[0])
    return _table(header, [[r[i] for i in idx] for r in rows])


def _needle_pair(results: Results, lead: str, old: list[list[str]], where: str) -> list[str]:
    m = re.search(r"`([^`]+)` against `([^`]+)`", lead)
    if not m:
        raise ValueError(f"{where}: a paired needle table needs an '`A` against `B`' line above it")
    a, b = m.groups()
    cells = [c for c in results("smollm2")["niah"] if c["variant"] == "single"]
    gen = _parse(comparison_table(paired_comparison(cells, a, b), a, b))
    if gen[0] != old[0]:
        raise ValueError(f"{where}: header {old[0]} is not kvq-eval compare's {gen[0]}")
    return _table(gen[0], gen[1:])


def _readme_style(v: str) -> str:
    v = re.sub(r"(\d)%", r"\1 %", v)
    return re.sub(r"(?<![\w.])-(?=\d)", "−", v)


def _paired_8k(results: Results, old: list[list[str]], where: str) -> list[str]:
    model = PAIRED_8K[old[0][0]]
    res = results(model)
    rows = []
    for r in old[1:]:
        m = re.match(r"(\S+) − (\S+)", r[0])
        if not m:
            raise ValueError(f"{where}: row label is not 'A − B ...': {r[0]!r}")
        a, b = m.groups()
        gen = _parse(ppl_comparison_table(paired_ppl(res, a, b), a, b))
        row = next((g for g in gen[1:] if g[0] == "8K"), None)
        if row is None:
            raise ValueError(f"{where}: {a} and {b} share no 8K perplexity windows")
        rows.append([r[0]] + [_readme_style(v) for v in (row[3], row[4], row[5], row[6])])
    return _table(old[0], rows)


def refresh_readme(text: str, results_dir) -> str:
    """``text`` (a README) with every evaluation table recomputed from ``results_dir``.

    Parameters
    ----------
    text : str
        The README, holding the section from ``**Status.**`` to ``**The v1 results**``.
    results_dir : str or Path
        The results folder (``results/eval_v2``), one subfolder per model.

    Returns
    -------
    str
        The README with the tables of that section replaced; the prose is untouched.
    """
    try:
        start, end = text.index(SECTION[0]), text.index(SECTION[1])
    except ValueError:
        raise ValueError(f"README has no evaluation section ({SECTION[0]} ... {SECTION[1]})") from None
    cache: dict[str, dict] = {}

    def results(model: str) -> dict:
        if model not in cache:
            cache[model] = load_results(str(results_dir), model)
        return cache[model]

    head, body, tail = text[:start], text[start:end], text[end:]
    lines = body.split("\n")
    for i, j, lead in reversed(_blocks(lines)):
        old = _parse("\n".join(lines[i:j]))
        line_no = head.count("\n") + i + 1
        where = f"README line {line_no}"
        mark = _MARK.match(lead.strip())
        if old[0][0] == "entry":
            if not mark:
                raise ValueError(f"{where}: an entry table needs a '<!-- kvq-eval table MODEL ... -->' line above it")
            model, variant, rows_from = mark.groups()
            variant = None if variant in (None, "-") else variant
            new = _entry_table(old, _summary(results, model, variant), rows_from, where)
        elif old[0][0] == "context":
            new = _needle_pair(results, lead, old, where)
        elif old[0][0] in PAIRED_8K:
            new = _paired_8k(results, old, where)
        else:
            continue
        lines[i:j] = new
    return head + "\n".join(lines) + tail


def refresh_readme_file(path, results_dir, check: bool = False) -> bool:
    """Refresh the README at ``path`` in place (or, with ``check``, only compare). True when it
    changed (or, with ``check``, would change)."""
    path = Path(path)
    old = path.read_text()
    new = refresh_readme(old, results_dir)
    if new != old and not check:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return new != old
