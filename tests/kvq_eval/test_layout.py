"""Package layout: the specification (kvq_ref) never imports the evaluation (kvq_eval)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvq_ref

ROOT = Path(kvq_ref.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_kvq_ref_does_not_import_kvq_eval():
    """Every import statement of every kvq_ref module (lazy ones included) is checked."""
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 5
    offending = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f) if m.split(".")[0] == "kvq_eval")
                 for f in files}
    assert not {f: m for f, m in offending.items() if m}
    assert not (ROOT / "eval").exists(), "the evaluation lives in the top-level kvq_eval package"


def test_kvq_eval_package_data_ships_the_fixture():
    from kvq_eval.text import FIXTURE

    assert FIXTURE.is_file() and FIXTURE.parent.parent.name == "kvq_eval"
