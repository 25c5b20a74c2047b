"""Building table sets: the default set, parsing of CLI ranges, the shipped tables."""

from __future__ import annotations

import io
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ._atomic import read_file
from ._validate import JSON_MAX_BYTES, MAX_BITS, parse_json
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


def build(jobs: Iterable[tuple[Density, Iterable[int]]], progress: bool | None = None,
          exact: bool = True) -> list[Codebook]:
    """Solve every (density, bits) pair of ``jobs``.

    Parameters
    ----------
    jobs : iterable of (Density, iterable of int)
    progress : bool or None
        Show a tqdm bar on stderr; None shows it only on a terminal and for more than 20 tables.
    exact : bool
        Correctly rounded levels (``lloyd_max(..., exact=True)``): the table files are the same
        bytes on every platform. False keeps the float64 solution (faster for large 10-12-bit
        sets; its last bits depend on the platform's floating point).

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
    return [lloyd_max(d, b, exact=exact) for d, b in it]


def parse_int_list(text: str, name: str, lo: int | None = None, hi: int | None = None,
                   max_items: int = 10_000) -> list[int]:
    """'1-3,8' -> [1, 2, 3, 8] (order kept, duplicates dropped).

    Every bound is checked against ``[lo, hi]`` and the total count against ``max_items`` before
    any range is expanded (``1-99999999999`` is refused at once, not after filling memory).
    """
    parts = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d{1,18})\s*(?:-\s*(\d{1,18})\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{name}: cannot parse {part!r} (expected e.g. '1-8' or '64,128')")
        a = int(m.group(1))
        b = int(m.group(2) or a)
        if (lo is not None and a < lo) or (hi is not None and b > hi):
            rng = f"{lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
            raise ValueError(f"{name}: {part.strip()!r} is outside {rng}")
        parts.append((a, b))
    total = sum(b - a + 1 for a, b in parts)
    if total > max_items:
        raise ValueError(f"{name}: {text!r} names {total} values, more than the {max_items} allowed")
    out = [v for a, b in parts for v in range(a, b + 1)]
    return list(dict.fromkeys(out))


def parse_float_list(text: str, name: str) -> list[float]:
    """'0.5,1' -> [0.5, 1.0] (finite numbers only)."""
    try:
        vals = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{name}: cannot parse {text!r} (expected e.g. '0.5,1')") from None
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"{name}: {text!r} holds a non-finite number")
    return list(dict.fromkeys(vals))


def _load_npy(raw: bytes) -> np.ndarray:
    """A numeric .npy array, its header checked before anything is allocated: a plain numeric dtype,
    at most ``2**MAX_BITS`` values, and exactly the bytes the header declares (a 160-byte file
    declaring 10^12 elements gave a MemoryError traceback)."""
    f = io.BytesIO(raw)
    major, _ = np.lib.format.read_magic(f)
    read_header = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}.get(major)
    if read_header is None:
        raise ValueError(f"unsupported .npy format version {major}")
    shape, _, dtype = read_header(f)
    count = math.prod(shape)
    if dtype.hasobject or dtype.kind not in "fiu":
        raise ValueError(f"holds {dtype} values, not numbers")
    if count > 1 << MAX_BITS:
        raise ValueError(f"declares {count} values; a table has at most {1 << MAX_BITS}")
    if len(raw) - f.tell() != count * dtype.itemsize:
        raise ValueError(f"declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes) but holds "
                         f"{len(raw) - f.tell()} bytes of data")
    return np.load(io.BytesIO(raw), allow_pickle=False)


def read_levels(spec: str, name: str = "--levels") -> np.ndarray:
    """Levels from a file (.npy, .json list, or whitespace/comma-separated text) or a list.

    A file must be a regular file of at most 64 MiB; JSON is parsed with bounded nesting and finite
    numbers (``parse_json``). Any problem is one ``ValueError`` naming ``name`` and the file.
    """
    path = Path(spec)
    if path.exists() and not path.is_file():
        raise ValueError(f"{name}: {path} is {'a directory' if path.is_dir() else 'not a regular file'}")
    if path.is_file():
        try:
            raw = read_file(path, JSON_MAX_BYTES)
            if path.suffix == ".npy":
                arr = _load_npy(raw)
            elif path.suffix == ".json":
                obj = parse_json(raw)
                if not isinstance(obj, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                        for v in obj):
                    raise ValueError("expected a flat JSON list of numbers")
                arr = np.asarray(obj, dtype=np.float64)
            else:
                arr = np.asarray([float(t) for t in raw.decode("utf-8").replace(",", " ").split()], dtype=np.float64)
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            raise ValueError(f"{name}: {path}: {exc}") from None
        if arr.dtype.kind not in "fiu":
            raise ValueError(f"{name}: {path} holds {arr.dtype} values, not numbers")
        return arr.astype(np.float64).ravel()
    try:
        return np.asarray([float(t) for t in spec.replace(",", " ").split()], dtype=np.float64)
    except ValueError:
        raise ValueError(f"{name}: {spec!r} is neither a file nor a list of numbers") from None


def shipped_tables():
    """The default table set shipped inside the package (validated on load)."""
    from .tables import load_tables

    return load_tables(SHIPPED_DIR)
