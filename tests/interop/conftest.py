"""Golden cases from the official implementations, read from ``$KVQ_INTEROP_DIR`` (default
``../shared/interop`` beside the repository); the format reader is ``golden_format.py``."""

from __future__ import annotations

import pytest

from .golden_format import interop_dir


@pytest.fixture(scope="session")
def interop_folder():
    """The folder the golden tests read (absent folders make the tests skip, with the reason)."""
    return interop_dir()
