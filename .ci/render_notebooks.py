"""Render the percent-format notebooks to .ipynb and execute them in a Jupyter kernel.

Usage (from the repository root; ``make notebooks`` runs it)::

    python .ci/render_notebooks.py [notebooks/01_codebooks.py ...] [--out out/notebooks] [--timeout 900]

Each ``notebooks/NN_*.py`` is read with jupytext, executed by nbclient in a ``python3`` kernel of this
interpreter with the repository root as working directory (the notebooks use paths such as
``results/eval_v3``), and written with its outputs and inline figures to ``OUT/NN_*.ipynb``. A failing
cell stops the run with a non-zero exit status and the cell's traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render(path: Path, out: Path, timeout: int) -> Path:
    """Execute ``path`` and write ``out / (stem + ".ipynb")``; returns the written path."""
    import jupytext
    import nbformat
    from jupyter_client import KernelManager
    from nbclient import NotebookClient

    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with tempfile.TemporaryDirectory() as sockets:  # local IPC sockets, no TCP ports
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "kernel"))
        NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(ROOT)}}).execute()
    target = out / f"{path.stem}.ipynb"
    nbformat.write(nb, target)
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "out" / "notebooks")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9]*.py"))
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel inherits it: notebook 06 runs on CPU
    for path in paths:
        t0 = time.perf_counter()
        target = render(path, args.out, args.timeout)
        print(f"{path} -> {target} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
