"""Evaluation text: a committed public-domain fixture (KJV Genesis and Exodus), cut into disjoint parts.

The fixture (``data/kjv_genesis_exodus.txt``, ~71k words, ~100k SmolLM2 tokens) is the King James
Version text as printed by Debian's ``bible-kjv`` package, one chapter per paragraph, verse
numbers removed. It is split by words into three disjoint parts so that calibration never sees the
evaluation text: ``calibration`` (first 30 %), ``evaluation`` (next 30 %) and ``haystack`` (the
rest, filler for needle-in-a-haystack prompts). ``heldout`` is everything after the calibration
part (~61k SmolLM2 tokens): perplexity windows of 8K tokens need more than ``evaluation`` holds. ``bible_text()`` returns the whole KJV when the
``bible`` command is installed (``make eval-deps`` installs it) for longer haystacks.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

__all__ = ["FIXTURE", "fixture_text", "part", "bible_text", "PARTS"]

FIXTURE = Path(__file__).parent / "data" / "kjv_genesis_exodus.txt"
PARTS = {"calibration": (0.0, 0.3), "evaluation": (0.3, 0.6), "haystack": (0.6, 1.0), "heldout": (0.3, 1.0)}


@lru_cache(maxsize=1)
def fixture_text() -> str:
    """The committed KJV slice."""
    return FIXTURE.read_text(encoding="utf-8")


def part(name: str) -> str:
    """One of the disjoint parts of the fixture (``PARTS``), as whitespace-joined words."""
    if name not in PARTS:
        raise ValueError(f"part must be one of {sorted(PARTS)}, got {name!r}")
    words = fixture_text().split()
    lo, hi = PARTS[name]
    return " ".join(words[int(lo * len(words)):int(hi * len(words))])


def bible_text() -> str | None:
    """The whole KJV from Debian's ``bible`` command, or None when it is not installed."""
    exe = shutil.which("bible")
    if exe is None:
        return None
    out = subprocess.run([exe, "-f", "Ge1:1-Re22:21"], capture_output=True, text=True, check=True).stdout
    return " ".join(line.split(" ", 1)[1] for line in out.splitlines() if " " in line)
