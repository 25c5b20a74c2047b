"""Fuzz suite (issue 16): loaders, JSON, argument parsers and densities on adversarial input.

Every property reads "a clear refusal of the documented type, or a valid result": loaders raise
only ``TableFileError``, parsers only ``ValueError``, densities either refuse or give finite,
positive distortions. Deterministic (the ``ci`` hypothesis profile derandomizes; ``deadline=None``)
and bounded: the example counts below keep the file at about 30 s on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codebooks import (Empirical, Gaussian, SphereMarginal, TableFileError, audit, distortion, lloyd_max, load_tables,
                       save_tables)
from codebooks._validate import parse_json
from codebooks.artifacts import canonical_json, load_artifacts, save_artifacts, sha256
from codebooks.build import parse_int_list
from codebooks.calibration import CalibrationStats
from codebooks.nova import NovaModel, calibrate
from codebooks.tables import MANIFEST
from tests.nova_data import generator, sequence

#: KVQ_FUZZ_EXPLORE=N explores N random examples per property (local bug hunting); CI is derandomized.
_EXPLORE = os.environ.get("KVQ_FUZZ_EXPLORE")
FUZZ = settings(deadline=None, derandomize=_EXPLORE is None, max_examples=int(_EXPLORE or 60),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LOADERS = {"codebooks": load_tables, "nova_kv": NovaModel.load, "calibration": CalibrationStats.load}


@lru_cache(maxsize=1)
def _sources() -> dict[str, Path]:
    base = Path(tempfile.mkdtemp(prefix="kvq-fuzz-"))
    gen = generator(8, seed=3)
    stats, model = calibrate([sequence(gen, 2, 1, 60, s) for s in range(2)], 8, g=2, bits=1, iterations=3)
    return {"codebooks": save_tables([lloyd_max(Gaussian(1.0), 2), lloyd_max(SphereMarginal(16), 1),
                                      lloyd_max(Empirical(np.arange(7.0)), 1)], base / "t"),
            "nova_kv": model.save(base / "n"), "calibration": stats.save(base / "c")}


def _copy(kind: str) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="kvq-fuzz-case-")) / "set"
    shutil.copytree(_sources()[kind], dst)
    return dst


def _load_or_refuse(kind: str, folder: Path):
    try:
        return LOADERS[kind](folder)
    except TableFileError:
        return None
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


# --- raw corruption of any file ------------------------------------------------------------------
@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), which=st.integers(0, 10), pos=st.floats(0, 1),
       op=st.sampled_from(["flip", "truncate", "append", "zero"]), byte=st.integers(1, 255))
def test_raw_corruption_is_refused(kind, which, pos, op, byte):
    folder = _copy(kind)
    files = sorted(p for p in folder.iterdir())
    path = files[which % len(files)]
    raw = bytearray(path.read_bytes())
    i = min(int(pos * len(raw)), len(raw) - 1)
    if op == "flip":
        raw[i] ^= byte
    elif op == "truncate":
        raw = raw[:i]
    elif op == "append":
        raw += bytes([byte]) * (1 + i % 9)
    else:
        raw[i:i + 8] = b"\0" * len(raw[i:i + 8])
        if bytes(raw) == path.read_bytes():
            raw += b"\0"
    path.write_bytes(bytes(raw))
    assert _load_or_refuse(kind, folder) is None


# --- schema: any manifest field set to any JSON value, hashes recomputed ----------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(["../x", "/etc/hostname", "layer0.head0", "meta", "F64", "sphere"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _paths(node, prefix=()):
    """Every (path, value) of a JSON tree except the manifest's own hash."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for k, v in items:
        if k == "manifest_sha256":
            continue
        yield prefix + (k,), v
        yield from _paths(v, prefix + (k,))


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), pick=st.integers(0, 10**6), value=JSON_VALUES,
       delete=st.booleans())
def test_any_manifest_edit_is_refused_or_harmless(kind, pick, value, delete):
    folder = _copy(kind)
    m = json.loads((folder / MANIFEST).read_text())
    paths = list(_paths(m))
    path, _ = paths[pick % len(paths)]
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    del m["manifest_sha256"]
    m["manifest_sha256"] = sha256(canonical_json(m))
    (folder / MANIFEST).write_bytes(canonical_json(m))
    _load_or_refuse(kind, folder)  # anything but TableFileError fails the test


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), pick=st.integers(0, 10**6), flat=st.integers(0, 10**6),
       value=st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e300, -1e-300, 3.0e38, 7.0]))
def test_any_array_edit_is_refused_or_valid(kind, pick, flat, value):
    """One element of one array changed and every hash recomputed: refused, or a valid object."""
    art = load_artifacts(_sources()[kind], kind)
    entries = [{**{k: v for k, v in e.items() if k != "arrays"}, "arrays": list(e["arrays"])} for e in art.entries]
    arrays = {k: np.array(v) for k, v in art.arrays.items()}
    names = sorted(arrays)
    arr = arrays[names[pick % len(names)]]
    if arr.size:
        if arr.dtype.kind == "f":
            with np.errstate(over="ignore"):
                arr.flat[flat % arr.size] = value
        else:
            info = np.iinfo(arr.dtype)
            arr.flat[flat % arr.size] = (info.max if value > 1e3 else info.min if value < -1e3
                                         else 0 if np.isnan(value) else int(value))
    folder = Path(tempfile.mkdtemp(prefix="kvq-fuzz-case-")) / "set"
    save_artifacts(folder, kind, entries, arrays, dict(art.files))
    out = _load_or_refuse(kind, folder)
    if out is not None and kind == "codebooks":
        for cb in out.values():
            assert np.all(np.isfinite(cb.levels)) and cb.mse >= 0


# --- parsers -----------------------------------------------------------------------------------------
@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.integers(0, 3000).map(lambda n: "[" * n + "]" * n),
                 st.integers(0, 3000).map(lambda n: "1" * n),
                 JSON_VALUES.map(lambda v: json.dumps(v))))
def test_parse_json_refuses_cleanly(data):
    try:
        parse_json(data)
    except ValueError:
        pass


@FUZZ
@given(st.text(alphabet="0123456789-, x", max_size=40))
def test_parse_int_list_bounded(text):
    try:
        out = parse_int_list(text, "--bits", 1, 12)
    except ValueError:
        return
    assert all(1 <= v <= 12 for v in out) and len(out) == len(set(out))


# --- densities ---------------------------------------------------------------------------------------
@FUZZ
@given(log10_sigma=st.floats(-330, 310), bits=st.integers(1, 3))
def test_gaussian_any_sigma(log10_sigma, bits):
    with np.errstate(over="ignore"):
        sigma = float(np.float64(10.0) ** log10_sigma)  # 0 or inf at the ends: refused too
    try:
        g = Gaussian(sigma)
    except ValueError as exc:
        assert "sigma must" in str(exc)
        return
    cb = lloyd_max(g, bits)
    ref = lloyd_max(Gaussian(1.0), bits).mse
    assert cb.mse / sigma**2 == pytest.approx(ref, rel=1e-12)  # exact scale invariance, to rounding


@FUZZ
@given(samples=st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=2, max_size=12),
       log_w=st.lists(st.floats(-320, 308), min_size=12, max_size=12))
def test_empirical_any_samples_and_weights(samples, log_w):
    w = 10.0 ** np.asarray(log_w[:len(samples)])
    try:
        e = Empirical(samples, weights=w)
    except ValueError:
        return
    assert np.all(np.isfinite(e.probs)) and math.isclose(e.probs.sum(), 1.0, rel_tol=1e-12)
    lv = np.array([e.values[0], e.values[-1]])
    d = distortion(e, lv)
    assert math.isfinite(d) and d >= 0


@FUZZ
@given(log10_factor=st.floats(-9, 9), bits=st.integers(1, 3))
def test_best_scale_recovers_any_factor(log10_factor, bits):
    cb = lloyd_max(Gaussian(1.0), bits)
    f = 10.0 ** log10_factor
    rep = audit(Gaussian(1.0), cb.levels * f)
    assert rep.best_scale * f == pytest.approx(1.0, rel=1e-7)  # argmin of a smooth D: ~sqrt(eps)
