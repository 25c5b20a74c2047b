"""``kvq-eval readme`` recomputes the README's evaluation tables from the JSON (issue 15).

The committed README must be a fixed point of the refresh (every table is what the committed JSON
gives), and the refresh must repair what goes stale: a changed number, a row missing from a table
marked ``all`` or ``filled``, paired rows. What the JSON cannot give is a ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvq_eval.cli import main
from kvq_eval.readme import refresh_readme, refresh_readme_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "results" / "eval_v2"


@pytest.fixture(scope="module")
def text() -> str:
    return README.read_text()


def _bump_digit(line: str) -> str:
    """``line`` with the first digit after its first cell changed."""
    cut = line.index("|", 2)
    m = re.search(r"\d", line[cut:])
    i = cut + m.start()
    return line[:i] + str((int(line[i]) + 1) % 10) + line[i + 1:]


def _table_rows(text: str, marker: str) -> list[str]:
    lines = text.split("\n")
    i = lines.index(marker) + 1
    while not lines[i].startswith("|"):
        i += 1
    j = i
    while lines[j].startswith("|"):
        j += 1
    return lines[i + 2:j]


def test_the_committed_readme_is_current(text):
    assert refresh_readme(text, RESULTS) == text, "README tables are stale: run `kvq-eval readme`"


def test_every_entry_table_is_marked(text):
    """One marker per entry table of the section, each right above its table (a blank line between)."""
    lines = text[text.index("**Status.**"):text.index("**The v1 results**")].split("\n")
    tables = [k for k, line in enumerate(lines) if line.startswith("| entry |")]
    assert len(tables) >= 5
    for k in tables:
        assert re.fullmatch(r"<!-- kvq-eval table .* -->", lines[k - 2]) and not lines[k - 1], lines[k]


def test_a_changed_number_is_restored(text):
    row = _table_rows(text, "<!-- kvq-eval table gemma3 single -->")[3]
    stale = text.replace(row, _bump_digit(row), 1)
    assert stale != text
    assert refresh_readme(stale, RESULTS) == text


def test_a_missing_row_comes_back_only_in_an_all_or_filled_table(text):
    row = _table_rows(text, "<!-- kvq-eval table smollm2 single all -->")[5]
    assert refresh_readme(text.replace(row + "\n", "", 1), RESULTS) == text
    # ... or in a "filled" one (here: a multi-query row that only exists at 1K)
    marker = "<!-- kvq-eval table smollm2 multiquery filled -->"
    row = next(r for r in _table_rows(text, marker) if r.startswith("| tq_mse2@none+qprefill |"))
    assert refresh_readme(text.replace(row + "\n", "", 1), RESULTS) == text
    # a table without "all" shows the rows the README chose
    listed = _table_rows(text, "<!-- kvq-eval table smollm2 single -->")[2]
    shorter = text.replace(listed + "\n", "", 1)
    assert refresh_readme(shorter, RESULTS) == shorter


def test_a_filled_table_holds_exactly_the_entries_with_a_shown_value(text):
    """``filled`` keeps kvq-eval table's rows that show a value in one of the README's columns: the
    multi-query table lists every entry with a multi-query needle cell, and none of the entries that
    only have perplexity or single-needle cells (which ``all`` would add as rows of "–")."""
    from kvq_eval.plot import load_results

    res = load_results(str(RESULTS), "smollm2")
    with_cells = {e for cell in res["niah"] if cell["variant"] == "multiquery" for e in cell["results"]}
    rows = _table_rows(text, "<!-- kvq-eval table smollm2 multiquery filled -->")
    listed = {r.split("|")[1].strip() for r in rows}
    assert listed == with_cells
    assert not any(set(r.split("|")[2:-1]) <= {" – "} for r in rows)
    # "all" would add rows of dashes for the key-error-study entries that have no multi-query cell
    padded = refresh_readme(text.replace("smollm2 multiquery filled -->", "smollm2 multiquery all -->", 1), RESULTS)
    extra = _table_rows(padded, "<!-- kvq-eval table smollm2 multiquery all -->")
    assert len(extra) > len(rows) and all(set(r.split("|")[2:-1]) <= {" – "} for r in set(extra) - set(rows))


def test_paired_rows_are_restored(text):
    paired = next(line for line in text.split("\n") if re.match(r"\| \S+ − \S+ .*\| [+−]\d", line))
    needle = _table_rows(text, next(line for line in text.split("\n") if re.match(r"`[^`]+` against `", line)))[0]
    stale = text.replace(paired, _bump_digit(paired), 1).replace(needle, _bump_digit(needle), 1)
    assert stale.count("\n") == text.count("\n") and stale != text
    assert refresh_readme(stale, RESULTS) == text


def test_what_the_json_cannot_give_is_named(text):
    row = _table_rows(text, "<!-- kvq-eval table gemma3 single -->")[3]
    fake = "| no_such_method@none" + row[row.index(" |", 2):]
    with pytest.raises(ValueError, match="no_such_method@none"):
        refresh_readme(text.replace(row, fake, 1), RESULTS)
    with pytest.raises(ValueError, match="needs a '<!-- kvq-eval table"):
        refresh_readme(text.replace("<!-- kvq-eval table gemma3 single -->", "", 1), RESULTS)
    head = _table_rows(text, "<!-- kvq-eval table smollm2 decode all -->")
    lines = text.split("\n")
    k = lines.index(head[0]) - 2
    bad = lines[k].replace("| top-1 |", "| top-5 |")
    with pytest.raises(ValueError, match="top-5"):
        refresh_readme("\n".join(lines[:k] + [bad] + lines[k + 1:]), RESULTS)
    with pytest.raises(ValueError, match="evaluation section"):
        refresh_readme("# no section here\n", RESULTS)


def test_cli_check_and_refresh(text, tmp_path, capsys):
    row = _table_rows(text, "<!-- kvq-eval table smollm2 multiquery filled -->")[0]
    path = tmp_path / "README.md"
    path.write_text(text.replace(row, _bump_digit(row), 1))
    assert main(["readme", str(path), "--results", str(RESULTS), "--check"]) == 1
    assert path.read_text() != text  # --check writes nothing
    assert main(["readme", str(path), "--results", str(RESULTS)]) == 0
    assert path.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
    assert main(["readme", str(path), "--results", str(RESULTS), "--check"]) == 0
    assert not refresh_readme_file(path, RESULTS)
    assert "tables match" in capsys.readouterr().out
