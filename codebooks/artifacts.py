"""Versioned artifact folders: ``manifest.json`` + ``tables.safetensors`` (+ an optional C header).

Every file this toolkit writes for other tools (codebook tables, calibration statistics, NOVA-KV
and OSCAR transforms) is an artifact folder:

``tables.safetensors``
    All arrays, written by a deterministic safetensors serialiser (8-byte little-endian header
    length, compact JSON header with sorted metadata, arrays grouped by decreasing itemsize so each
    is aligned, space padding to a multiple of 8, raw little-endian data).
``manifest.json``
    Canonical JSON (sorted keys, one-space indent, trailing newline): ``schema_version``,
    ``generator``, ``kind`` (what the folder holds), ``files`` (sha256 of the other files),
    ``entries`` (one object per item, each with ``name`` and ``arrays``: dtype, shape and sha256 of
    every array it owns) and ``manifest_sha256`` over the canonical JSON of the rest.

``load_artifacts`` re-derives every redundant piece and refuses the folder, naming the file and
the problem, on any difference: manifest bytes vs their canonical form, its own hash, the file
hashes, safetensors structure, array dtypes/shapes/hashes, arrays not listed. A single flipped byte
anywhere is therefore detected. Writing is deterministic: equal content gives equal bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._version import TABLE_SCHEMA_VERSION, __version__

__all__ = ["MANIFEST", "TENSORS", "TableFileError", "Artifacts", "save_artifacts", "load_artifacts", "sha256"]

MANIFEST = "manifest.json"
TENSORS = "tables.safetensors"
GENERATOR = f"kvq-codebooks {__version__}"

_DTYPES = {np.dtype("<f8"): "F64", np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<i8"): "I64",
           np.dtype("<i4"): "I32", np.dtype("u1"): "U8"}


class TableFileError(ValueError):
    """An artifact folder is missing, corrupted, truncated or inconsistent."""


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> bytes:
    """The one byte form a manifest may have."""
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n").encode()


def _safetensors_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    order = sorted(arrays, key=lambda k: -arrays[k].dtype.itemsize)  # stable: keeps given order per size
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, offset = [], 0
    for key in order:
        arr = np.ascontiguousarray(arrays[key])
        data = arr.tobytes()
        header[key] = {"dtype": _DTYPES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def array_spec(arr: np.ndarray) -> dict:
    """Manifest description of an array: dtype, shape, sha256 of its little-endian bytes."""
    return {"dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": sha256(np.ascontiguousarray(arr).tobytes())}


def save_artifacts(folder, kind: str, entries: list[dict], arrays: dict[str, np.ndarray],
                   extra_files: dict[str, bytes] | None = None) -> Path:
    """Write an artifact folder.

    Parameters
    ----------
    folder : str or Path
        Created if missing; existing files of the same names are replaced atomically.
    kind : str
        What the folder holds (``"codebooks"``, ``"calibration"``, ``"nova_kv"``, ...).
    entries : list of dict
        JSON-serialisable items, each with a unique ``"name"`` and ``"arrays"``: the list of array
        names it owns (replaced in the manifest by their specs).
    arrays : dict of str -> ndarray
        Every array, each owned by exactly one entry; dtypes float64/32/16, int64/32 or uint8.
    extra_files : dict of str -> bytes, optional
        Further files (e.g. a C header) whose sha256 the manifest records.

    Returns
    -------
    Path
    """
    names = [e["name"] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"entry names must be unique; duplicated: {sorted({n for n in names if names.count(n) > 1})}")
    owned = [a for e in entries for a in e["arrays"]]
    if sorted(owned) != sorted(arrays) or len(set(owned)) != len(owned):
        raise ValueError("every array must be owned by exactly one entry")
    arrays = {k: np.ascontiguousarray(v.astype(v.dtype.newbyteorder("<"))) for k, v in arrays.items()}
    for k, v in arrays.items():
        if v.dtype not in _DTYPES:
            raise TypeError(f"array {k!r} has unsupported dtype {v.dtype}")
    tensors = _safetensors_bytes(arrays, {"schema_version": str(TABLE_SCHEMA_VERSION), "generator": GENERATOR,
                                          "kind": kind})
    extra_files = extra_files or {}
    files = {TENSORS: sha256(tensors), **{n: sha256(b) for n, b in extra_files.items()}}
    manifest = {
        "schema_version": TABLE_SCHEMA_VERSION,
        "generator": GENERATOR,
        "kind": kind,
        "files": files,
        "entries": [{**e, "arrays": {a: array_spec(arrays[a]) for a in e["arrays"]}} for e in entries],
    }
    manifest["manifest_sha256"] = sha256(canonical_json(manifest))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / TENSORS, tensors)
    for n, b in extra_files.items():
        _write_atomic(folder / n, b)
    _write_atomic(folder / MANIFEST, canonical_json(manifest))
    return folder


@dataclass(frozen=True)
class Artifacts:
    """A validated artifact folder: its manifest, its entries and all arrays by name."""

    folder: Path
    manifest: dict
    arrays: dict

    @property
    def entries(self) -> list[dict]:
        return self.manifest["entries"]

    def file_bytes(self, name: str) -> bytes:
        """An extra file's bytes (already checked against its sha256)."""
        return (self.folder / name).read_bytes()


def fail(path: Path, problem: str):
    """Raise the one error of this module, naming the file."""
    raise TableFileError(f"{path}: {problem}")


def _read(path: Path) -> bytes:
    if not path.is_file():
        fail(path, "file is missing")
    return path.read_bytes()


def _parse_manifest(path: Path, raw: bytes, kind: str) -> dict:
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(path, f"not valid JSON ({exc})")
    if not isinstance(manifest, dict):
        fail(path, "top level must be a JSON object")
    schema = manifest.get("schema_version")
    if schema != TABLE_SCHEMA_VERSION:
        fail(path, f"schema version {schema!r} is not supported (this reader: {TABLE_SCHEMA_VERSION})")
    for key, typ in (("generator", str), ("kind", str), ("files", dict), ("entries", list),
                     ("manifest_sha256", str)):
        if not isinstance(manifest.get(key), typ):
            fail(path, f"field {key!r} is missing or not a {typ.__name__}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if sha256(canonical_json(body)) != manifest["manifest_sha256"]:
        fail(path, "manifest_sha256 does not match the manifest content (edited or corrupted)")
    if canonical_json(manifest) != raw:
        fail(path, "bytes differ from the canonical serialisation (edited or corrupted)")
    if manifest["kind"] != kind:
        fail(path, f"holds {manifest['kind']!r} artifacts, expected {kind!r}")
    if not re.fullmatch(r"kvq-codebooks \S+", manifest["generator"]):
        fail(path, f"unexpected generator {manifest['generator']!r}")
    return manifest


def load_artifacts(folder, kind: str) -> Artifacts:
    """Load and validate an artifact folder of the given ``kind`` (``TableFileError`` otherwise)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    folder = Path(folder)
    if not folder.is_dir():
        raise TableFileError(f"{folder}: not a table folder (directory missing)")
    mpath = folder / MANIFEST
    manifest = _parse_manifest(mpath, _read(mpath), kind)
    if TENSORS not in manifest["files"]:
        fail(mpath, f"does not list {TENSORS}")
    for name, digest in manifest["files"].items():
        path = folder / name
        if sha256(_read(path)) != digest:
            fail(path, "sha256 does not match the manifest (corrupted, truncated or replaced)")
    tpath = folder / TENSORS
    try:
        tensors = load(_read(tpath))
    except (SafetensorError, ValueError, OSError) as exc:
        fail(tpath, f"unreadable safetensors ({exc})")
    listed = set()
    for entry in manifest["entries"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("arrays"), dict) or "name" not in entry:
            fail(mpath, "an entry lacks 'name' or 'arrays'")
        for key, spec in entry["arrays"].items():
            if key in listed:
                fail(mpath, f"array {key!r} is listed twice")
            listed.add(key)
            if key not in tensors:
                fail(tpath, f"array {key!r} listed in the manifest is missing")
            arr = tensors[key]
            if not isinstance(spec, dict) or str(arr.dtype) != spec.get("dtype") or list(arr.shape) != spec.get("shape"):
                fail(tpath, f"array {key!r} has dtype {arr.dtype} shape {list(arr.shape)}, manifest says "
                            f"{spec.get('dtype') if isinstance(spec, dict) else spec}")
            if sha256(np.ascontiguousarray(arr).tobytes()) != spec.get("sha256"):
                fail(tpath, f"array {key!r} does not match its sha256 (corrupted)")
    extra = sorted(set(tensors) - listed)
    if extra:
        fail(tpath, f"arrays not listed in the manifest: {extra[:5]}")
    for arr in tensors.values():
        arr.setflags(write=False)
    return Artifacts(folder, manifest, tensors)
