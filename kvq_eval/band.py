"""The 16-bit band (sink S, recent window W): one run setting for every method, one rule in every mode.

A token is kept in float16 while it is among the first ``S`` tokens (the sink) or among the most
recent tokens of the window; the rest (the middle) is stored through the method. Tokens leave the
window in whole token groups of the method (``token_group``: 32 for KIVI and QJL keys, whose
encodings group tokens, 1 for the others), so after ``n`` tokens are written the middle holds
``n_encoded(n, S, W, group)`` tokens. The simulation (teacher forcing) and the decoding cache both
use this count, so the same ``--band S,W`` means the same stored tokens in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Band", "parse_band", "token_group", "n_encoded", "band_mask"]


@dataclass(frozen=True)
class Band:
    """``sink`` first tokens and ``window`` most recent tokens kept in float16."""

    sink: int = 0
    window: int = 0

    def __post_init__(self):
        for name in ("sink", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"band {name} must be a non-negative integer, got {v!r}")

    @property
    def label(self) -> str:
        """``none`` or ``S,W`` (as given to ``--band``; also the cell files' band tag)."""
        return "none" if self.sink == 0 and self.window == 0 else f"{self.sink},{self.window}"

    @property
    def tag(self) -> str:
        """File-name form of ``label``: ``none`` or ``S-W``."""
        return self.label.replace(",", "-")


#: largest sink or window of a band, in tokens (beyond any context here; larger ones overflowed int64 late)
MAX_BAND = 1 << 24


def parse_band(text: str) -> Band | None:
    """``"none"`` -> Band(0, 0); ``"S,W"`` -> Band(S, W); ``"own"`` -> None (each method's own band)."""
    if not isinstance(text, str):
        raise TypeError(f"band must be a str, got {type(text).__name__}")
    t = text.strip().lower()
    if t == "own":
        return None
    if t == "none":
        return Band(0, 0)
    parts = t.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) <= MAX_BAND for p in parts):
        raise ValueError(f"band must be 'none', 'own' or 'S,W' (two integers in 0..{MAX_BAND}), got {text!r}")
    return Band(int(parts[0]), int(parts[1]))


def token_group(quantizer) -> int:
    """Tokens a method encodes together: ``group`` for KIVI and QJL keys (grouped along tokens), else 1."""
    from kvq_ref.kivi import KIVI
    from kvq_ref.qjl import QJL

    if isinstance(quantizer, (KIVI, QJL)) and quantizer.role == "key":
        return int(quantizer.group)
    return 1


def n_encoded(n, sink: int, window: int, group: int = 1):
    """Middle tokens stored through the method once ``n`` tokens are written (int or int array).

    ``floor(max(0, n - sink - window) / group) * group``: the window holds between ``window`` and
    ``window + group - 1`` tokens, and exactly ``window`` when ``group = 1``.
    """
    excess = np.maximum(0, np.asarray(n) - sink - window)
    out = (excess // group) * group
    return int(out) if np.ndim(out) == 0 else out


def band_mask(q_pos: np.ndarray, k_pos: np.ndarray, sink: int, window: int, group: int = 1) -> np.ndarray:
    """bool (Tq, Tk): key position t is in float16 for the query at position i (i + 1 tokens written)."""
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    mid_end = sink + n_encoded(q_pos + 1, sink, window, group)
    return (k_pos[None, :] < sink) | (k_pos[None, :] >= np.asarray(mid_end)[:, None])
