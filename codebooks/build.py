"""Building table sets: the default set, parsing of CLI ranges, the shipped tables."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .codebook import Codebook
from .densities import Density, Gaussian, PolarAngle, SphereMarginal
from .solver import lloyd_max

__all__ = ["DEFAULT_SPHERE_DIMS", "DEFAULT_BITS", "DEFAULT_POLAR", "default_densities", "build",
           "parse_int_list", "parse_float_list", "read_levels", "shipped_tables", "SHIPPED_DIR"]

#: Head dimensions of common models (64..256), PolarQuant-style 16/32, MLA 576, and 1024.
DEFAULT_SPHERE_DIMS = (16, 32, 64, 80, 96, 128, 192, 256, 576, 1024)
DEFAULT_BITS = tuple(range(1, 9))
#: PolarQuant's 16-coordinate blocks use angle levels 1..4 at up to 4 bits.
DEFAULT_POLAR = ((1, 2, 3, 4), (1, 2, 3, 4))
SHIPPED_DIR = Path(__file__).parent / "data" / "default"


def default_densities() -> list[tuple[Density, tuple[int, ...]]]:
    """(density, bit widths) pairs of the default table set (104 tables)."""
    out: list[tuple[Density, tuple[int, ...]]] = [(SphereMarginal(d), DEFAULT_BITS) for d in DEFAULT_SPHERE_DIMS]
    out.append((Gaussian(1.0), DEFAULT_BITS))
    levels, bits = DEFAULT_POLAR
    out += [(PolarAngle(level), bits) for level in levels]
    return out


def build(jobs: Iterable[tuple[Density, Iterable[int]]], progress: bool | None = None) -> list[Codebook]:
    """Solve every (density, bits) pair of ``jobs``.

    Parameters
    ----------
    jobs : iterable of (Density, iterable of int)
    progress : bool or None
        Show a tqdm bar on stderr; None shows it only on a terminal and for more than 20 tables.

    Returns
    -------
    list of Codebook
    """
    pairs = [(d, b) for d, bits in jobs for b in bits]
    if progress is None:
        progress = sys.stderr.isatty() and len(pairs) > 20
    it = pairs
    if progress:
        from tqdm import tqdm

        it = tqdm(pairs, desc="solving", unit="table", file=sys.stderr)
    return [lloyd_max(d, b) for d, b in it]


def parse_int_list(text: str, name: str) -> list[int]:
    """'1-3,8' -> [1, 2, 3, 8] (order kept, duplicates dropped)."""
    out: list[int] = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{name}: cannot parse {part!r} (expected e.g. '1-8' or '64,128')")
        lo = int(m.group(1))
        out.extend(range(lo, int(m.group(2) or lo) + 1))
    return list(dict.fromkeys(out))


def parse_float_list(text: str, name: str) -> list[float]:
    """'0.5,1' -> [0.5, 1.0]."""
    try:
        return list(dict.fromkeys(float(p) for p in str(text).split(",")))
    except ValueError:
        raise ValueError(f"{name}: cannot parse {text!r} (expected e.g. '0.5,1')") from None


def read_levels(spec: str) -> np.ndarray:
    """Levels from a file (.npy, .json list, or whitespace/comma-separated text) or a list."""
    path = Path(spec)
    if path.is_file():
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False).ravel()
        text = path.read_text()
        if path.suffix == ".json":
            return np.asarray(json.loads(text), dtype=np.float64).ravel()
        return np.asarray([float(t) for t in text.replace(",", " ").split()], dtype=np.float64)
    try:
        return np.asarray([float(t) for t in spec.replace(",", " ").split()], dtype=np.float64)
    except ValueError:
        raise ValueError(f"--levels: {spec!r} is neither a file nor a list of numbers") from None


def shipped_tables():
    """The default table set shipped inside the package (validated on load)."""
    from .tables import load_tables

    return load_tables(SHIPPED_DIR)
