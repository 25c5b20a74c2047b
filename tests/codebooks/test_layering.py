"""Data flows one way: nothing in codebooks/ imports theory, kvq_ref or gpu, not even lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import codebooks

FORBIDDEN = {"theory", "kvq_ref", "gpu"}
ROOT = Path(codebooks.__file__).resolve().parent


def imported_roots(tree: ast.AST) -> set[str]:
    """Top-level package names imported anywhere in a module (statements, __import__, import_module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__", "find_spec"):
                out.add(node.args[0].value.split(".")[0])
    return out


def test_codebooks_never_imports_upstream_packages():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 10
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(ast.parse(f.read_text())) & FORBIDDEN) for f in files}
    assert not {k: v for k, v in bad.items() if v}


def test_the_checker_sees_every_import_form():
    src = "import kvq_ref.nova\nfrom theory import x\ndef f():\n    import gpu\n    importlib.import_module('kvq_ref.golden')\n"
    assert imported_roots(ast.parse(src)) >= FORBIDDEN


def test_the_cli_runs_without_loading_upstream_packages(tmp_path):
    code = ("import sys, codebooks.cli as c; c.main(['build', '--dist', 'gaussian', '--bits', '1', '--quiet', "
            f"'--out', {str(tmp_path)!r}]); print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
