"""The README's evaluation tables are ``kvq-eval table`` output on the committed JSON (issue 15).

Every row of a table whose first column is ``entry`` in the README's v2 evaluation text (from its
**Status.** paragraph to **The v1 results**) must equal, cell by cell under the same column
headers, the row of that entry in one of the tables ``kvq-eval table`` prints from
``results/eval_v2`` (all, single or multi-query needles, or the long decodes, for each model). A
README table may show a subset of the columns (the 8K-only tables), never a number the JSON does
not give. The paired tables are ``kvq-eval compare`` output the same way: a needle table (first
column ``context``) under a line naming "`A` against `B`" must equal ``compare A B --variant single``
row by row, and every row "A − B ..." of the 8K perplexity tables (first column ``A − B at 8K``,
and ``A − B at 8K (Gemma-3)`` for Gemma) the 8K row of ``compare A B`` (Δ NLL with its interval,
ratio, p, per-window differences; the README writes "−" and "1.2 %" where the CLI prints "-" and
"1.2%").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvq_eval.plot import (comparison_table, decode_table, load_results, markdown_table, paired_comparison,
                           paired_ppl, ppl_comparison_table)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "results" / "eval_v2"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _led_tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """Markdown tables of ``text`` as (the last non-blank line before the table, rows: header first,
    the ``---`` line dropped)."""
    tables, cur, lead, prev = [], [], "", ""
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not cur:
                lead = prev
            if not set(line) <= set("|-: "):
                cur.append(_cells(line))
        else:
            if cur:
                tables.append((lead, cur))
                cur = []
            if line.strip():
                prev = line
    return tables


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables of ``text`` as lists of rows (header first, the ``---`` line dropped)."""
    return [rows for _, rows in _led_tables(text)]


def _section() -> str:
    text = README.read_text()
    start, end = text.index("**Status.**"), text.index("**The v1 results**")
    return text[start:end]


def _generated(results: dict) -> list[list[list[str]]]:
    out = []
    for res in results.values():
        texts = [markdown_table(res, v) for v in (None, "single", "multiquery")]
        if res.get("decode"):
            texts.append(decode_table(res))
        for t in texts:
            out.extend(_tables(t))
    return out


def _rows_match(header, row, table) -> bool:
    head = table[0]
    if not set(header) <= set(head):
        return False
    for r in table[1:]:
        if r[0] == row[0] and all(r[head.index(h)] == v for h, v in zip(header, row)):
            return True
    return False


@pytest.fixture(scope="module")
def results():
    """The committed JSON of both models, loaded once for every check here."""
    return {model: load_results(str(RESULTS), model, None) for model in ("smollm2", "gemma3")}


@pytest.fixture(scope="module")
def generated(results):
    # results/eval_v2 is committed beside the README that cites it: a missing folder is a failure
    out = _generated(results)
    assert out, f"no kvq-eval tables from {RESULTS}"
    return out


def test_readme_section_has_entry_tables():
    tables = [t for t in _tables(_section()) if t[0][0] == "entry"]
    assert len(tables) >= 5, "the README's evaluation section lost its tables"


def test_every_readme_row_is_kvq_eval_output(generated):
    bad = []
    for table in _tables(_section()):
        header = table[0]
        if header[0] != "entry":
            continue
        for row in table[1:]:
            if not any(_rows_match(header, row, g) for g in generated):
                bad.append(" | ".join(row))
    assert not bad, "README rows that no `kvq-eval table` output gives:\n" + "\n".join(bad)


def test_a_changed_number_is_caught(generated):
    """The check above can fail: one digit changed in a README row matches no generated table."""
    table = next(t for t in _tables(_section()) if t[0][0] == "entry" and len(t) > 2)
    header, row = table[0], list(table[1])
    assert any(_rows_match(header, row, g) for g in generated)
    j = next(i for i, v in enumerate(row) if any(ch.isdigit() for ch in v))
    row[j] = row[j].replace(next(ch for ch in row[j] if ch.isdigit()),
                            str((int(next(ch for ch in row[j] if ch.isdigit())) + 1) % 10), 1)
    assert not any(_rows_match(header, row, g) for g in generated)


@pytest.fixture(scope="module")
def smollm2(results):
    return results["smollm2"]


def _needle_compare_tables():
    out = []
    for lead, table in _led_tables(_section()):
        if table[0][0] != "context":
            continue
        m = re.search(r"`([^`]+)` against `([^`]+)`", lead)
        assert m, f"a paired needle table without an '`A` against `B`' line above it: {lead!r}"
        out.append((m.group(1), m.group(2), table))
    return out


def test_readme_needle_comparisons_are_kvq_eval_compare(smollm2):
    found = _needle_compare_tables()
    assert len(found) >= 4, "the README's paired needle tables are gone"
    cells = [c for c in smollm2["niah"] if c["variant"] == "single"]
    bad = []
    for a, b, table in found:
        gen = _tables(comparison_table(paired_comparison(cells, a, b), a, b))[0]
        for row in table[1:]:
            if not _rows_match(table[0], row, gen):
                bad.append(f"{a} vs {b}: " + " | ".join(row))
    assert not bad, "README paired needle rows that `kvq-eval compare` does not give:\n" + "\n".join(bad)


def _norm(v: str) -> str:
    return v.replace("−", "-").replace(" %", "%")


PAIRED_8K = {"A − B at 8K": "smollm2", "A − B at 8K (Gemma-3)": "gemma3"}


def _ppl8k_rows(model: str = "smollm2"):
    """(A, B, the row's cells) of the README's paired 8K table of ``model``."""
    label = next(k for k, v in PAIRED_8K.items() if v == model)
    table = next((t for t in _tables(_section()) if t[0][0] == label), None)
    assert table is not None, f"the README's paired 8K perplexity table ({label}) is gone"
    assert table[0][1:] == ["Δ NLL [95% CI]", "ppl ratio", "p", "per window"]
    out = []
    for row in table[1:]:
        m = re.match(r"(\S+) − (\S+)", row[0])
        assert m, f"row label is not 'A − B ...': {row[0]!r}"
        out.append((m.group(1), m.group(2), [_norm(v) for v in row[1:]]))
    return out


def _ppl8k_generated(res, a, b) -> list[str]:
    gen = _tables(ppl_comparison_table(paired_ppl(res, a, b), a, b))[0]
    row = next(r for r in gen[1:] if r[0] == "8K")
    return [row[3], row[4], row[5], row[6]]


@pytest.mark.parametrize("model", sorted(PAIRED_8K.values()))
def test_readme_8k_paired_rows_are_kvq_eval_compare(results, model):
    rows = _ppl8k_rows(model)
    assert len(rows) >= 5
    res = results[model]
    bad = [f"{a} − {b}: {v} != {g}" for a, b, v in rows if v != (g := _ppl8k_generated(res, a, b))]
    assert not bad, f"README 8K paired rows ({model}) that `kvq-eval compare` does not give:\n" + "\n".join(bad)


def test_a_changed_paired_number_is_caught(smollm2):
    a, b, v = _ppl8k_rows()[0]
    assert v == _ppl8k_generated(smollm2, a, b)
    changed = [v[0].replace(next(ch for ch in v[0] if ch.isdigit() and ch != "0"), "0", 1)] + v[1:]
    assert changed != _ppl8k_generated(smollm2, a, b)
    a, b, table = _needle_compare_tables()[0]
    cells = [c for c in smollm2["niah"] if c["variant"] == "single"]
    gen = _tables(comparison_table(paired_comparison(cells, a, b), a, b))[0]
    row = list(table[1])
    row[1] = str(int(row[1]) + 1)
    assert not _rows_match(table[0], row, gen)
