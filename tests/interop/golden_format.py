"""Reader of the interop golden format (``data/README.md`` beside this file), independent of kvq_ref.

A golden file is ``{method, source, variant, seed, shared?, cases: [{id, family, params, inputs,
outputs, notes}]}``. Every array is ``{dtype, shape, b64}``: base64 of the array's little-endian
bytes in C order, dtype one of float16, float32, float64, int8, uint8, int32. Plain JSON numbers are
scalars; block formats are hex strings (kept as str). Nested dicts of arrays (QuaRot's per-path
outputs) are decoded recursively.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

DTYPES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "i1", "uint8": "u1", "int32": "<i4"}
#: The golden sets shipped with the repository (made by the official code; ``data/README.md``).
DATA = Path(__file__).resolve().parent / "data"
#: More folders in the same format, read after ``DATA``: ``$KVQ_INTEROP_DIR`` (several joined by ``os.pathsep``).
ENV = "KVQ_INTEROP_DIR"


def interop_dirs() -> list[Path]:
    """The bundled ``data/`` folder, then every folder named in ``$KVQ_INTEROP_DIR``.

    A named folder that does not exist is an error (a typo must not pass as "no extra golden sets").
    """
    extra = [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    missing = [str(p) for p in extra if not p.is_dir()]
    if missing:
        raise FileNotFoundError(f"${ENV} names folders that do not exist: {missing}")
    return [DATA, *extra]


def is_array(obj) -> bool:
    return isinstance(obj, dict) and set(obj) == {"dtype", "shape", "b64"}


def decode_array(obj) -> np.ndarray:
    """One ``{dtype, shape, b64}`` object as a read-only numpy array (native byte order)."""
    if obj["dtype"] not in DTYPES:
        raise ValueError(f"golden array dtype {obj['dtype']!r} is not one of {sorted(DTYPES)}")
    raw = base64.b64decode(obj["b64"], validate=True)
    dt = np.dtype(DTYPES[obj["dtype"]])
    shape = tuple(int(s) for s in obj["shape"])
    if len(raw) != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"golden array of shape {shape} {obj['dtype']} holds {len(raw)} bytes")
    arr = np.frombuffer(raw, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
    arr.setflags(write=False)
    return arr


def decode_tree(obj):
    """Decode every array object inside dicts and lists; other values unchanged."""
    if is_array(obj):
        return decode_array(obj)
    if isinstance(obj, dict):
        return {k: decode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tree(v) for v in obj]
    return obj


def load_golden(path) -> dict:
    """A golden.json with every array decoded."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    for key in ("method", "cases"):
        if key not in raw:
            raise ValueError(f"{path}: golden file lacks {key!r}")
    return decode_tree(raw)


def golden_files(method: str, folder=None) -> list[Path]:
    """Every ``golden*.json`` in ``<folder>/<method>/`` (sorted); without ``folder``, those of every
    folder of ``interop_dirs()`` in order, a file whose bytes equal an earlier one's counted once (so
    ``$KVQ_INTEROP_DIR`` pointing at a copy of the bundled sets tests nothing twice)."""
    if folder is not None:
        return sorted((Path(folder) / method).glob("golden*.json"))
    out, seen = [], set()
    for root in interop_dirs():
        for path in sorted((root / method).glob("golden*.json")):
            digest = hashlib.sha256(path.read_bytes()).digest()
            if digest not in seen:
                seen.add(digest)
                out.append(path)
    return out


def file_label(path: Path) -> str:
    """A golden file's name in test ids: ``golden.json`` for the bundled sets, the path otherwise."""
    return path.name if path.parent.parent == DATA else str(path)


def cases(method: str, folder=None) -> list[tuple[str, dict, dict]]:
    """``(file:case id, case, shared arrays)`` for every case of every golden file of ``method``."""
    out = []
    for path in golden_files(method, folder):
        g = load_golden(path)
        if g["method"] != method:
            raise ValueError(f"{path}: method {g['method']!r}, expected {method!r}")
        for case in g["cases"]:
            out.append((f"{file_label(path)}:{case['id']}", case, g.get("shared", {})))
    return out


def golden_params(method: str, family: str | None = None, folder=None):
    """pytest params ``(case, shared)`` of every golden case of ``method`` (optionally one family);
    one skipped param with the reason when the folder holds no golden file of ``method``."""
    if not golden_files(method, folder):
        where = folder if folder is not None else [str(p) for p in interop_dirs()]
        return [pytest.param(None, None, marks=pytest.mark.skip(
            reason=f"no golden files for {method!r} in {where} (set ${ENV} to a folder in the interop format)"),
            id=f"{method}-absent")]
    return [pytest.param(c, shared, id=cid) for cid, c, shared in cases(method, folder)
            if family is None or c["family"] == family]


def same_bits(a, b) -> None:
    """Assert equal dtype, shape and bytes (so -0.0 differs from 0.0): the golden files' "bit-exact"."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
