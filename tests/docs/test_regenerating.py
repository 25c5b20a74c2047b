"""docs/regenerating.md names the command of every committed result and shipped data file.

Its table's first column holds path patterns (``fnmatch``: ``*`` also matches ``/``). Every file git
tracks under the result and data folders below must match a pattern, and every pattern must match
a tracked file: a result committed without its command, or a row left behind by a removed result,
fails here.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "regenerating.md"
#: the folders whose every file is a result or shipped data made by a command
TREES = ("results", "benchmarks/results", "codebooks/data", "kvq_eval/data", "kvq_ref/data",
         "tests/interop/data", "tests/codebooks/data")
#: what .gitignore keeps out of these folders (a stopped cell's partial windows, writer temp files)
IGNORED = ("*.json.partial", "*.json.*.tmp", ".*.lock", "*/__pycache__/*")


def patterns() -> list[str]:
    """The backticked paths of the first column of the table after ``(regenerating-table)=``."""
    lines = PAGE.read_text(encoding="utf-8").split("(regenerating-table)=\n", 1)[1].splitlines()
    rows = [ln for ln in lines[2:] if ln.startswith("|")][: next(
        (i for i, ln in enumerate(lines[2:]) if not ln.startswith("|")), None)]
    found = []
    for row in rows:
        first = row.split("|")[1]
        found += [p for p in re.findall(r"`([^`]+)`", first) if "/" in p]
    return found


def tracked() -> list[str]:
    """Files under ``TREES``: git's tracked files, or (outside a git checkout) the files on disk."""
    proc = subprocess.run(["git", "ls-files", "-z", "--", *TREES], cwd=ROOT, capture_output=True)
    if proc.returncode == 0 and proc.stdout:
        return [p for p in proc.stdout.decode().split("\0") if p]
    files = [str(p.relative_to(ROOT)) for t in TREES for p in (ROOT / t).rglob("*") if p.is_file()]
    return [f for f in files if not any(fnmatch.fnmatch(f, g) or fnmatch.fnmatch(Path(f).name, g) for g in IGNORED)]


def test_table_parses():
    pats = patterns()
    assert len(pats) >= 25 and "codebooks/data/default/*" in pats and "results/theory/rd.png" in pats


def test_every_committed_result_has_its_command():
    pats = patterns()
    missing = [f for f in tracked() if not any(fnmatch.fnmatchcase(f, p) for p in pats)]
    assert not missing, f"{len(missing)} committed files have no row in docs/regenerating.md: {missing[:10]}"


def test_every_row_names_committed_files():
    files = tracked()
    stale = [p for p in patterns() if not any(fnmatch.fnmatchcase(f, p) for f in files)]
    assert not stale, f"docs/regenerating.md rows that match no committed file: {stale}"
