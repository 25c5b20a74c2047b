"""The README's evaluation tables are ``kvq-eval table`` output on the committed JSON (issue 15).

Every row of a table whose first column is ``entry`` in the README's v2 evaluation text (from its
**Status.** paragraph to **The v1 results**) must equal, cell by cell under the same column
headers, the row of that entry in one of the tables ``kvq-eval table`` prints from
``results/eval_v2`` (all, single or multi-query needles, or the long decodes, for each model). A
README table may show a subset of the columns (the 8K-only tables), never a number the JSON does
not give. Comparison tables (``kvq-eval compare``) are paired on the same samples and are not
checked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq_eval.plot import decode_table, load_results, markdown_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "results" / "eval_v2"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables of ``text`` as lists of rows (header first, the ``---`` line dropped)."""
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                cur.append(_cells(line))
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def _section() -> str:
    text = README.read_text()
    start, end = text.index("**Status.**"), text.index("**The v1 results**")
    return text[start:end]


def _generated() -> list[list[list[str]]]:
    out = []
    for model in ("smollm2", "gemma3"):
        res = load_results(str(RESULTS), model, None)
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
def generated():
    # results/eval_v2 is committed beside the README that cites it: a missing folder is a failure
    out = _generated()
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
