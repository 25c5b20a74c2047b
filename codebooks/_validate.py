"""Argument checks shared by the package: one clear error naming the argument and the constraint."""

from __future__ import annotations

import json
import math
import numbers

import numpy as np

MAX_BITS = 12


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise naming ``name`` and the allowed range.

    Booleans and integral floats are rejected: ``bits=3.0`` is almost always a bug upstream.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:
            rng = f">= {lo}"
        elif lo is None:
            rng = f"<= {hi}"
        else:
            rng = f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def check_bits(bits, lo: int = 1, hi: int = MAX_BITS) -> int:
    """Validate a bit width (default range 1..12, the solver's supported range)."""
    return check_int("bits", bits, lo, hi)


def check_positive(name: str, value) -> float:
    """Return ``value`` as a finite float > 0, or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def finite_array(name: str, values, ndim: int | None = 1, min_size: int = 1) -> np.ndarray:
    """Return ``values`` as a float64 array after checking dtype, shape and finiteness."""
    arr = np.asarray(values)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise TypeError(f"{name} must be a numeric array, got dtype {arr.dtype}")
    if np.iscomplexobj(arr):
        raise TypeError(f"{name} must be real, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size < min_size:
        raise ValueError(f"{name} must have at least {min_size} element(s), got {arr.size}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise ValueError(f"{name} must be finite, found {bad} NaN/Inf value(s)")
    return arr


def strictly_increasing(name: str, arr: np.ndarray) -> None:
    """Raise unless ``arr`` is strictly increasing."""
    if arr.size > 1 and not np.all(np.diff(arr) > 0):
        i = int(np.argmax(~(np.diff(arr) > 0)))
        raise ValueError(
            f"{name} must be strictly increasing, but {name}[{i}]={arr[i]!r} >= {name}[{i + 1}]={arr[i + 1]!r}"
        )


#: Bounds of every JSON file this toolkit reads (manifests, result series, level lists).
JSON_MAX_BYTES = 64 << 20
JSON_MAX_DEPTH = 32
_NUMBER_MAX_CHARS = 40


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise ValueError(f"integer with {len(text.lstrip('-'))} digits (at most 19 allowed)")
    return int(text)


def _json_float(text: str) -> float:
    if len(text) > _NUMBER_MAX_CHARS:
        raise ValueError(f"number written with {len(text)} characters (at most {_NUMBER_MAX_CHARS} allowed)")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} overflows float64")
    return value


def _json_constant(text: str):
    raise ValueError(f"{text} is not allowed: JSON here must hold finite numbers")


def parse_json(raw: bytes | str, max_depth: int = JSON_MAX_DEPTH, max_bytes: int = JSON_MAX_BYTES):
    """Parse JSON that nobody vouches for: bounded size and nesting, finite numbers of sane length.

    Raises
    ------
    ValueError
        Describing the problem (the caller adds the file name): not UTF-8, not JSON, larger than
        ``max_bytes``, nested deeper than ``max_depth``, NaN/Infinity, a number that overflows
        float64 or is written with more than 40 characters, an integer of more than 19 digits.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise ValueError(f"JSON of {len(raw)} bytes is larger than the {max_bytes} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    try:
        obj = json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return obj
