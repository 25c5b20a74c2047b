"""Sphinx configuration of the kvq-toolkit documentation (``make docs`` builds it into out/docs/).

Pages are MyST Markdown; the API reference is generated from the numpydoc docstrings: this file
writes one page per module into docs/api/generated/ (not committed) and autodoc fills it. The build imports every module it documents, so it needs the
project and its extras installed (``pip install -e '.[docs,eval,gpu]'``, which the Makefile does).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")  # gpu.triton imports without a GPU

from codebooks._version import __version__  # noqa: E402

project = "kvq-toolkit"
author = "the kvq-toolkit developers"
copyright = "2026, the kvq-toolkit developers"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: $...$ and $$...$$ math, ::: fences, heading anchors for [text](page.md#anchor) links
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# API reference: one page per module, written below into docs/api/generated/ (git-ignored).
# autosummary's recursive mode is not used: it resolves "codebooks.audit" to the function that
# codebooks/__init__.py re-exports under the module's name, not to the module.
API_PACKAGES = ("codebooks", "theory", "kvq_ref", "gpu", "kvq_eval")
autosummary_generate = False


def _modules(package: str) -> list[str]:
    """``package`` and its public submodules, recursively (no ``_private`` or ``__main__``)."""
    import importlib
    import pkgutil

    mod = importlib.import_module(package)
    out = [package]
    for info in pkgutil.iter_modules(getattr(mod, "__path__", [])):
        if not info.name.startswith("_"):
            out += _modules(f"{package}.{info.name}") if info.ispkg else [f"{package}.{info.name}"]
    return out


def _exports(package: str) -> list[str]:
    """The classes and functions of ``package.__all__`` under the public module that defines them
    (``codebooks.lloyd_max`` -> ``solver.lloyd_max``), so a package's page links to them."""
    import importlib

    mod = importlib.import_module(package)
    out = []
    for name in getattr(mod, "__all__", []):
        home = getattr(getattr(mod, name), "__module__", None)
        if home and home.startswith(package + ".") and "._" not in home:
            out.append(f"{home[len(package) + 1:]}.{name}")  # relative to the package's page
    return out


def _page(name: str, children: list[str]) -> str:
    """The reStructuredText of one module's page: a package lists its exports and its modules."""
    lines = [name, "=" * len(name), ""]
    if not children:
        return "\n".join(lines + [f".. automodule:: {name}", "   :members:", ""])
    lines += [f".. automodule:: {name}", "   :no-members:", ""]
    exports = _exports(name)
    if exports:
        lines += [".. rubric:: Exported names", "", ".. autosummary::", ""]
        lines += [f"   ~{item}" for item in exports] + [""]
    lines += [".. rubric:: Modules", "", ".. toctree::", "   :maxdepth: 1", ""]
    lines += [f"   {child}" for child in children] + [""]
    return "\n".join(lines)


def _write_api_pages(folder: Path) -> None:
    """One page per module; files are rewritten only when their text changes (incremental builds)."""
    folder.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for package in API_PACKAGES:
        modules = _modules(package)
        for name in modules:
            children = [m for m in modules if m.rsplit(".", 1)[0] == name and m != name]
            path = folder / f"{name}.rst"
            text = _page(name, children)
            wanted.add(path.name)
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
    for stale in folder.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()


_write_api_pages(Path(__file__).parent / "api" / "generated")
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_preserve_defaults = True
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
nitpicky = True  # an unresolved cross-reference (a :ref:, :py:obj: or See Also name) is an error under -W

html_theme = "pydata_sphinx_theme"
html_title = f"kvq-toolkit {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"index": []}
html_show_sourcelink = False
