"""Golden cases from the official implementations: the sets bundled in ``data/``, plus any folder
in the same format named by ``$KVQ_INTEROP_DIR``; the format reader is ``golden_format.py``."""

from __future__ import annotations

import pytest

from .golden_format import interop_dirs


@pytest.fixture(scope="session")
def interop_folders():
    """The folders the golden tests read: ``data/`` first, then those of ``$KVQ_INTEROP_DIR``."""
    return interop_dirs()
