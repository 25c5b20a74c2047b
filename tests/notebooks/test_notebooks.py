"""Every notebook runs top to bottom as a plain script, and renders to an executed .ipynb.

Notebooks 04 and 05 load SmolLM2 (marked ``model``); the others need only the library. Each runs in
a fresh interpreter from the repository root, with matplotlib's Agg backend and Triton's interpreter,
as ``make notebooks`` does in a Jupyter kernel.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.py"))
NEEDS_MODEL = {"04_nova_kv", "05_real_model"}


def test_the_six_notebooks_are_percent_format():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]
    for p in NOTEBOOKS:
        text = p.read_text()
        assert text.startswith("# %% [markdown]\n# # "), f"{p.name}: must open with a markdown title cell"
        assert text.count("\n# %%\n") >= 2, f"{p.name}: needs code cells"


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[pytest.mark.model] if p.stem in NEEDS_MODEL else [])
                                  for p in NOTEBOOKS])
def test_notebook_runs(path):
    env = dict(os.environ, MPLBACKEND="Agg", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), f"{path.name} printed nothing"


def test_render_executes_in_a_kernel_with_inline_figures(tmp_path):
    """``make notebooks`` path: jupytext + nbclient write an executed notebook with its figure."""
    nb = ROOT / "notebooks" / "03_methods.py"
    proc = subprocess.run([sys.executable, ".ci/render_notebooks.py", str(nb), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cells = json.loads((tmp_path / "03_methods.ipynb").read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the methods figure is shown inline"
    assert any("TurboQuantMSE 4" in "".join(o.get("text", "")) for o in outputs)
