"""Result series as JSON files: what ``kvq-theory curves`` writes and ``kvq-theory plot`` reads.

One file per series::

    {"name": ..., "description": ..., "x": [bits...], "y": [...], "params": {...},
     "kind": "lower_bound" | "upper_bound" | "exact" | "approximation" | "monte_carlo" | "measured",
     "quantity": "mse" | "inner_product" | "bias",
     "y_err": [...] or null}

``quantity`` fixes the units: ``mse`` is the normalized MSE (``E||x - x_hat||^2`` of a unit vector,
``d * mse`` per coordinate); ``inner_product`` is ``d E[(<y,x> - <y,x_hat>)^2] / ||y||^2``;
``bias`` is ``E[<y, x_hat>] / <y, x>``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from codebooks._atomic import read_file, write_file
from codebooks._validate import JSON_MAX_BYTES, parse_json

__all__ = ["Series", "ResultsError", "KINDS", "QUANTITIES", "load_series"]

KINDS = ("lower_bound", "upper_bound", "exact", "approximation", "monte_carlo", "measured")
QUANTITIES = {
    "mse": "normalized MSE  E||x - x_hat||^2  (unit x)",
    "inner_product": "d E[(<y,x> - <y,x_hat>)^2] / ||y||^2",
    "bias": "E[<y, x_hat>] / <y, x>",
}


class ResultsError(ValueError):
    """A results file is missing, not JSON, or not a valid series."""


def _floats(name: str, values) -> tuple[float, ...]:
    if not isinstance(values, list | tuple) or not values:
        raise ValueError(f"{name} must be a non-empty list of numbers")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{name} must hold finite numbers, got {v!r}")
        out.append(float(v))
    return tuple(out)


@dataclass(frozen=True)
class Series:
    """One curve or set of points against bits."""

    name: str
    description: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    params: dict
    kind: str
    quantity: str
    y_err: tuple[float, ...] | None = field(default=None)

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(f"name must be a non-empty identifier ([A-Za-z0-9_.-]), got {self.name!r}")
        if not isinstance(self.description, str):
            raise ValueError("description must be a string")
        object.__setattr__(self, "x", _floats("x", self.x))
        object.__setattr__(self, "y", _floats("y", self.y))
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y must have the same length, got {len(self.x)} and {len(self.y)}")
        if self.y_err is not None:
            object.__setattr__(self, "y_err", _floats("y_err", self.y_err))
            if len(self.y_err) != len(self.y):
                raise ValueError("y_err must have the length of y")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {tuple(QUANTITIES)}, got {self.quantity!r}")
        if not isinstance(self.params, dict):
            raise ValueError("params must be an object")

    def to_dict(self) -> dict:
        """The JSON object (lists, plain floats)."""
        return {"name": self.name, "description": self.description, "x": list(self.x), "y": list(self.y),
                "params": self.params, "kind": self.kind, "quantity": self.quantity,
                "y_err": list(self.y_err) if self.y_err is not None else None}

    def save(self, folder) -> Path:
        """Write ``folder/<name>.json`` (sorted keys, deterministic) and return the path."""
        path = Path(folder) / f"{self.name}.json"
        return write_file(path, (json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n").encode())

    @classmethod
    def load(cls, path) -> "Series":
        """Read and validate one series; ``ResultsError`` names the file and the problem."""
        path = Path(path)
        try:
            obj = parse_json(read_file(path, JSON_MAX_BYTES))
        except ValueError as exc:
            msg = str(exc)
            raise ResultsError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
        if not isinstance(obj, dict):
            raise ResultsError(f"{path}: expected a JSON object")
        missing = [k for k in ("name", "description", "x", "y", "params", "kind", "quantity") if k not in obj]
        if missing:
            raise ResultsError(f"{path}: missing field(s) {missing}")
        try:
            return cls(name=obj["name"], description=obj["description"], x=obj["x"], y=obj["y"],
                       params=obj["params"], kind=obj["kind"], quantity=obj["quantity"],
                       y_err=obj.get("y_err"))
        except ValueError as exc:
            raise ResultsError(f"{path}: {exc}") from None


def load_series(paths) -> list[Series]:
    """Load several series files (any failure raises ``ResultsError``)."""
    paths = list(paths)
    if not paths:
        raise ResultsError("no results files given")
    return [Series.load(p) for p in paths]
