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
hashes, safetensors structure and metadata, array dtypes/shapes/hashes, arrays not listed, NaN/Inf
in any float array, file names outside the folder, JSON size and nesting. A single flipped byte
anywhere is therefore detected. Each kind's loader then checks its own entry fields against a
schema. Writing is deterministic (equal content gives equal bytes) and atomic
(``codebooks._atomic``): a reader sees the whole old set or the whole new set.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._atomic import FolderReader, check_name, read_folder, write_folder
from ._validate import parse_json
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
    written = {TENSORS: tensors, **extra_files, MANIFEST: canonical_json(manifest)}
    return write_folder(folder, written, replaceable=lambda f: holds_only(f, written))


def holds_only(folder: Path, names) -> bool:
    """True if ``folder`` holds nothing but regular files named in ``names`` (an existing folder is
    replaced only then: never a folder with a user's other files)."""
    return all(p.name in names and p.is_file() and not p.is_symlink() for p in folder.iterdir())


@dataclass(frozen=True)
class Artifacts:
    """A validated artifact folder: its manifest, its entries, all arrays by name, the other files' bytes."""

    folder: Path
    manifest: dict
    arrays: dict
    files: dict

    @property
    def entries(self) -> list[dict]:
        return self.manifest["entries"]

    def file_bytes(self, name: str) -> bytes:
        """An extra file's bytes (already checked against its sha256; read with the rest of the set)."""
        return self.files[name]


def fail(path: Path, problem: str):
    """Raise the one error of this module, naming the file."""
    raise TableFileError(f"{path}: {problem}")


#: Largest manifest and tensor file a reader accepts.
MAX_MANIFEST_BYTES = 64 << 20
MAX_TENSOR_BYTES = 16 << 30
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = {"schema_version", "generator", "kind", "files", "entries", "manifest_sha256"}
_NAME_DTYPE = {v: k for k, v in _DTYPES.items()}
_SPEC_DTYPES = {str(k) for k in _DTYPES}


def is_int(v) -> bool:
    """A JSON integer (bool excluded)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _shape_ok(shape) -> bool:
    return isinstance(shape, list) and len(shape) <= 8 and all(is_int(n) and 0 <= n < 2**40 for n in shape)


_SHA_LINE = re.compile(rb'\n "manifest_sha256": "([0-9a-f]{64})",\n')


def _check_manifest_hash(path: Path, raw: bytes) -> None:
    """``manifest_sha256`` against the bytes, before any parsing (a large edited or forged manifest is
    refused in one pass over its bytes, not after building and re-serialising its JSON). In the
    canonical form the field is one line between ``kind`` and ``schema_version``; without that line
    the bytes are the canonical form of the rest, which is what the hash covers."""
    found = list(_SHA_LINE.finditer(raw))
    if len(found) != 1:
        fail(path, "no single top-level 'manifest_sha256' line: not the canonical form this toolkit writes "
                   "(edited or corrupted)")
    m = found[0]
    if sha256(raw[:m.start()] + raw[m.end() - 1:]) != m.group(1).decode():
        fail(path, "manifest_sha256 does not match the manifest content (edited or corrupted)")


def _parse_manifest(path: Path, raw: bytes, kind: str) -> dict:
    if len(raw) > 1 << 20:  # small manifests parse in milliseconds and get the parser's precise messages
        _check_manifest_hash(path, raw)
    try:
        manifest = parse_json(raw)
    except ValueError as exc:
        fail(path, str(exc))
    if not isinstance(manifest, dict):
        fail(path, "top level must be a JSON object")
    schema = manifest.get("schema_version")
    if not is_int(schema) or schema != TABLE_SCHEMA_VERSION:
        fail(path, f"field 'schema_version': schema version {schema!r} is not supported (this reader: {TABLE_SCHEMA_VERSION})")
    if set(manifest) != _TOP_KEYS:
        fail(path, f"top-level fields {sorted(manifest)}, expected {sorted(_TOP_KEYS)}")
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
        fail(path, f"field 'kind': holds {manifest['kind']!r} artifacts, expected {kind!r}")
    if not re.fullmatch(r"kvq-codebooks \S+", manifest["generator"]):
        fail(path, f"field 'generator': unexpected {manifest['generator']!r}")
    for name, digest in manifest["files"].items():
        try:
            check_name(name)
        except ValueError as exc:
            fail(path, f"field 'files': {exc} (refused: outside the folder or hidden)")
        if name == MANIFEST or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            fail(path, f"field 'files': entry {name!r} must map a data file to a sha256 hex digest")
    if TENSORS not in manifest["files"]:
        fail(path, f"field 'files' does not list {TENSORS}")
    seen = set()
    for i, entry in enumerate(manifest["entries"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] \
                or not isinstance(entry.get("arrays"), dict):
            fail(path, f"entries[{i}] must be an object with a non-empty string 'name' and an object 'arrays'")
        if entry["name"] in seen:
            fail(path, f"entries[{i}]: name {entry['name']!r} is listed twice")
        seen.add(entry["name"])
        for key, spec in entry["arrays"].items():
            if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "sha256"} \
                    or not isinstance(spec["dtype"], str) or spec["dtype"] not in _SPEC_DTYPES \
                    or not _shape_ok(spec["shape"]) or not isinstance(spec["sha256"], str) \
                    or not _HEX64.fullmatch(spec["sha256"]):
                fail(path, f"entry {entry['name']!r}: array {key!r} spec must be {{dtype, shape, sha256}} with a "
                           f"supported dtype, a list of sizes and a hex digest; got {spec!r:.200}")
    return manifest


def _parse_safetensors(path: Path, raw: bytes, kind: str) -> dict[str, np.ndarray]:
    """Arrays of a safetensors file this toolkit wrote, with every header field checked."""
    if len(raw) < 8:
        fail(path, f"truncated: {len(raw)} bytes")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8 or n > MAX_MANIFEST_BYTES:
        fail(path, f"header length {n} exceeds the file ({len(raw)} bytes)")
    try:
        header = parse_json(raw[8:8 + n], max_depth=4)
    except ValueError as exc:
        fail(path, f"header: {exc}")
    if not isinstance(header, dict):
        fail(path, "header must be a JSON object")
    meta = header.pop("__metadata__", None)
    want = {"schema_version": str(TABLE_SCHEMA_VERSION), "kind": kind}
    if not isinstance(meta, dict) or {k: meta.get(k) for k in want} != want \
            or not isinstance(meta.get("generator"), str) or set(meta) != {*want, "generator"}:
        fail(path, f"header metadata {meta!r:.200} does not say schema_version "
                   f"{TABLE_SCHEMA_VERSION}, kind {kind!r} and a generator")
    data = memoryview(raw)[8 + n:]
    arrays, spans = {}, []
    for key, spec in header.items():
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            fail(path, f"tensor {key!r}: header entry must hold dtype, shape, data_offsets")
        dtype = _NAME_DTYPE.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            fail(path, f"tensor {key!r}: dtype {spec['dtype']!r} is not one this toolkit writes "
                       f"({', '.join(sorted(_NAME_DTYPE))})")
        off = spec["data_offsets"]
        if not _shape_ok(spec["shape"]) or not isinstance(off, list) or len(off) != 2 \
                or not all(is_int(o) for o in off) or not 0 <= off[0] <= off[1] <= len(data) \
                or off[1] - off[0] != math.prod(spec["shape"]) * dtype.itemsize:
            fail(path, f"tensor {key!r}: shape {spec['shape']!r} and data_offsets {off!r} do not fit the data")
        spans.append((off[0], off[1]))
        arrays[key] = np.frombuffer(data[off[0]:off[1]], dtype=dtype).reshape(spec["shape"])
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            fail(path, "tensor data has gaps or overlaps")
        end = hi
    if end != len(data):
        fail(path, f"{len(data) - end} bytes after the last tensor")
    return arrays


def _load(reader: FolderReader, kind: str) -> Artifacts:
    folder = reader.folder
    mpath, tpath = folder / MANIFEST, folder / TENSORS

    def read(name, limit):
        try:
            return reader.read(name, limit)
        except ValueError as exc:
            raise TableFileError(str(exc)) from None

    manifest = _parse_manifest(mpath, read(MANIFEST, MAX_MANIFEST_BYTES), kind)
    # sizes bounded from the manifest before a byte of the data is read: the tensor file holds the
    # listed arrays plus a header of bounded size; other files (a C header) at most a few dozen
    # characters per array element
    specs = [(key, spec) for entry in manifest["entries"] for key, spec in entry["arrays"].items()]
    data_bytes = sum(math.prod(sp["shape"]) * np.dtype(sp["dtype"]).itemsize for _, sp in specs)
    elements = sum(math.prod(sp["shape"]) for _, sp in specs)
    header_bytes = 8 + 1024 + sum(len(key.encode()) + 160 for key, _ in specs)
    limits = {TENSORS: min(MAX_TENSOR_BYTES, data_bytes + header_bytes)}
    files = {}
    for name, digest in manifest["files"].items():
        data = read(name, limits.get(name, min(MAX_TENSOR_BYTES, (1 << 20) + 64 * elements + 512 * len(specs))))
        if sha256(data) != digest:
            fail(folder / name, "sha256 does not match the manifest (corrupted, truncated or replaced)")
        files[name] = data
    tensors = _parse_safetensors(tpath, files.pop(TENSORS), kind)
    listed = set()
    for entry in manifest["entries"]:
        for key, spec in entry["arrays"].items():
            if key in listed:
                fail(mpath, f"array {key!r} is listed twice")
            listed.add(key)
            if key not in tensors:
                fail(tpath, f"array {key!r} listed in the manifest is missing")
            arr = tensors[key]
            if str(arr.dtype) != spec["dtype"] or list(arr.shape) != spec["shape"]:
                fail(tpath, f"array {key!r} has dtype {arr.dtype} shape {list(arr.shape)}, manifest says "
                            f"{spec['dtype']} {spec['shape']}")
            if sha256(arr.tobytes()) != spec["sha256"]:
                fail(tpath, f"array {key!r} does not match its sha256 (corrupted)")
            if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
                fail(tpath, f"array {key!r} holds {int(np.count_nonzero(~np.isfinite(arr)))} NaN/Inf value(s)")
    extra = sorted(set(tensors) - listed)
    if extra:
        fail(tpath, f"arrays not listed in the manifest: {extra[:5]}")
    out = {}
    for key, arr in tensors.items():
        arr = arr.astype(arr.dtype.newbyteorder("="))  # native-order copy, independent of the file bytes
        arr.setflags(write=False)
        out[key] = arr
    return Artifacts(folder, manifest, out, files)


def load_artifacts(folder, kind: str) -> Artifacts:
    """Load and validate an artifact folder of the given ``kind`` (``TableFileError`` otherwise).

    All files are read from one consistent view of the folder (``codebooks._atomic.read_folder``:
    a concurrent writer's swap is never seen half done).
    """
    folder = Path(folder)
    try:
        return read_folder(folder, lambda reader: _load(reader, kind))
    except TableFileError:
        raise
    except ValueError as exc:
        msg = str(exc)
        if msg.endswith("directory missing"):
            msg = f"{folder}: not a table folder (directory missing)"
        raise TableFileError(msg) from None


def check_keys(path: Path, entry: dict, keys) -> None:
    """The entry has exactly ``keys`` (besides ``name`` and ``arrays``)."""
    want, have = set(keys) | {"name", "arrays"}, set(entry)
    if have != want:
        parts = [f"missing {sorted(want - have)}" if want - have else "", f"unknown {sorted(have - want)}" if have - want else ""]
        fail(path, f"entry {entry.get('name')!r}: fields {' and '.join(p for p in parts if p)}")


def field_int(path: Path, entry: dict, key: str, lo: int | None = None, hi: int | None = None) -> int:
    """Integer field ``key`` of ``entry`` in ``[lo, hi]`` (booleans refused), else ``TableFileError``."""
    v = entry.get(key)
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in {lo}..{hi}" if hi is not None else (f" >= {lo}" if lo is not None else "")
        fail(path, f"entry {entry.get('name')!r}: field {key!r} must be an integer{rng}, got {v!r:.60}")
    return v


def field_float(path: Path, entry: dict, key: str, lo: float | None = None, allow_none: bool = False) -> float | None:
    """Finite number field ``key`` (>= ``lo`` if given), else ``TableFileError``."""
    v = entry.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or (lo is not None and v < lo):
        fail(path, f"entry {entry.get('name')!r}: field {key!r} must be a finite number"
                   f"{f' >= {lo}' if lo is not None else ''}, got {v!r:.60}")
    return float(v)


def field_str(path: Path, entry: dict, key: str, pattern: str = r".{1,200}") -> str:
    """String field ``key`` matching ``pattern``, else ``TableFileError``."""
    v = entry.get(key)
    if not isinstance(v, str) or not re.fullmatch(pattern, v):
        fail(path, f"entry {entry.get('name')!r}: field {key!r} must be a string matching {pattern}, got {v!r:.60}")
    return v
