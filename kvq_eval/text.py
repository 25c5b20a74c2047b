"""Evaluation text: committed public-domain fixtures (the King James Version), cut into disjoint parts.

The fixtures are the KJV as Debian's ``bible-kjv`` package prints it (``kjv_chapters``: one chapter
per paragraph, verse numbers removed; ``tests/kvq_eval/test_text.py`` rebuilds them byte for byte
where the ``bible`` command is installed):

* ``data/kjv_genesis_exodus.txt`` (~71k words, ~100k SmolLM2 tokens), split by words into
  ``calibration`` (first 30 %), ``evaluation`` (next 30 %) and ``haystack`` (the rest); ``heldout``
  is everything after the calibration part (~61k SmolLM2 tokens, 7 windows of 8K): the text of
  the long perplexity windows, the long decodes and the per-layer errors;
* ``data/kjv_leviticus_deuteronomy.txt`` (~96k words): ``short``, the text of perplexity windows
  of up to ``SHORT_WINDOW_MAX`` tokens, disjoint from the long windows and from calibration;
* ``data/kjv_joshua_revelation.txt.gz`` (~650k words, ~0.9M SmolLM2 tokens): ``long_haystack``,
  the filler of needle prompts longer than ``SHORT_HAYSTACK_MAX`` tokens (``niah``), long enough
  that 30 samples of 8K tokens share little of it.

Calibration (``calibration``) never overlaps any evaluation text. ``bible_text()`` returns the
whole KJV when the ``bible`` command is installed (``make eval-deps``).
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

__all__ = ["FIXTURE", "FIXTURES", "fixture_text", "part", "bible_text", "kjv_chapters", "PARTS",
           "SHORT_WINDOW_MAX", "SHORT_HAYSTACK_MAX", "ppl_text"]

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "kjv_genesis_exodus.txt"
#: Each committed fixture with the verse range ``kjv_chapters`` builds it from.
FIXTURES = {"genesis_exodus": (FIXTURE, "Ge1:1-Ex40:38"),
            "leviticus_deuteronomy": (DATA / "kjv_leviticus_deuteronomy.txt", "Le1:1-De34:12"),
            "joshua_revelation": (DATA / "kjv_joshua_revelation.txt.gz", "Jos1:1-Re22:21")}
#: part -> (fixture, first and last fraction of its words)
PARTS = {"calibration": ("genesis_exodus", 0.0, 0.3), "evaluation": ("genesis_exodus", 0.3, 0.6),
         "haystack": ("genesis_exodus", 0.6, 1.0), "heldout": ("genesis_exodus", 0.3, 1.0),
         "short": ("leviticus_deuteronomy", 0.0, 1.0), "long_haystack": ("joshua_revelation", 0.0, 1.0)}
#: Perplexity windows of at most this many tokens read ``short`` (spread over it); longer ones read
#: ``heldout`` (consecutive windows from its start), so that short and long windows never share text.
SHORT_WINDOW_MAX = 4096
#: Needle prompts of at most this many tokens take their filler from ``haystack`` (protocol v2's
#: samples, unchanged); longer ones from ``long_haystack``.
SHORT_HAYSTACK_MAX = 4096


@lru_cache(maxsize=None)
def fixture_text(name: str = "genesis_exodus") -> str:
    """A committed fixture's text (``FIXTURES``)."""
    if name not in FIXTURES:
        raise ValueError(f"fixture must be one of {sorted(FIXTURES)}, got {name!r}")
    path = FIXTURES[name][0]
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


@lru_cache(maxsize=None)
def part(name: str) -> str:
    """One of the disjoint parts of the fixtures (``PARTS``), as whitespace-joined words."""
    if name not in PARTS:
        raise ValueError(f"part must be one of {sorted(PARTS)}, got {name!r}")
    fixture, lo, hi = PARTS[name]
    words = fixture_text(fixture).split()
    return " ".join(words[int(lo * len(words)):int(hi * len(words))])


def ppl_text(tokens: int) -> str:
    """The part a perplexity window of ``tokens`` tokens reads (``SHORT_WINDOW_MAX``)."""
    return "short" if tokens <= SHORT_WINDOW_MAX else "heldout"


def kjv_chapters(verses: str, exe: str | None = None) -> str:
    """The KJV verses ``verses`` (e.g. ``"Ge1:1-Ex40:38"``) as Debian's ``bible`` prints them, one
    chapter per paragraph (paragraphs separated by a blank line), verse numbers removed: how the
    fixtures were made.

    Raises ``FileNotFoundError`` when the ``bible`` command (Debian's ``bible-kjv``) is missing.
    """
    exe = exe or shutil.which("bible")
    if exe is None:
        raise FileNotFoundError("the bible command is not installed (Debian package bible-kjv)")
    out = subprocess.run([exe, "-f", verses], capture_output=True, text=True, check=True).stdout
    paras, cur, chapter = [], [], None
    for line in out.splitlines():
        if " " not in line:
            continue
        ref, text = line.split(" ", 1)
        m = re.match(r"(.*?)(\d+):(\d+)$", ref)  # book, chapter, verse: Ge1:1, 1Sa3:4, Exo1:1
        if m is None:
            raise ValueError(f"unexpected verse reference {ref!r} in the bible output")
        key = m.group(1, 2)
        if key != chapter and cur:
            paras.append(" ".join(cur))
            cur = []
        chapter = key
        cur.append(text.strip())
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras) + "\n"


def bible_text() -> str | None:
    """The whole KJV from Debian's ``bible`` command, or None when it is not installed."""
    exe = shutil.which("bible")
    if exe is None:
        return None
    out = subprocess.run([exe, "-f", "Ge1:1-Re22:21"], capture_output=True, text=True, check=True).stdout
    return " ".join(line.split(" ", 1)[1] for line in out.splitlines() if " " in line)
