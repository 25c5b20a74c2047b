"""Loaders that trust nothing: edited manifests (hashes recomputed), forged arrays, odd files.

Regression tests of issue 16: finding 4 (``NovaModel.load`` accepted NaN/Inf centroids, NaN
transforms, negative variances, duplicate (layer, head) entries; ``CalibrationStats.load`` checked
nothing), finding 8 (``load_tables`` left manifest fields unchecked, never compared the
safetensors metadata with the manifest, followed ``files`` entries such as ``../x`` and
``/etc/hostname``), and the crash/unclear-message list (deep JSON, NaN or 5000-digit numbers,
``iterations='x'``, ``bits=10**9``/``g=0`` in a NOVA manifest, BF16 tensors, a FIFO or directory
reported as missing). Every forged folder has consistent hashes, so only the schema can refuse it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from codebooks import Gaussian, SphereMarginal, TableFileError, lloyd_max, load_tables, save_tables
from codebooks.artifacts import canonical_json, load_artifacts, save_artifacts, sha256
from codebooks.calibration import CalibrationStats
from codebooks.nova import NovaModel, calibrate
from codebooks.tables import HEADER, MANIFEST, TENSORS
from tests.nova_data import generator, sequence

D = 8


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return save_tables([lloyd_max(Gaussian(1.0), 2), lloyd_max(SphereMarginal(16), 1)],
                       tmp_path_factory.mktemp("t") / "set")


@pytest.fixture(scope="module")
def nova(tmp_path_factory):
    gen = generator(D, seed=3)
    stats, model = calibrate([sequence(gen, 2, 1, 60, s) for s in range(2)], D, g=2, bits=1, iterations=3)
    base = tmp_path_factory.mktemp("n")
    return model.save(base / "nova"), stats.save(base / "calib")


def forge(src, dst, kind, entries_fn=None, arrays_fn=None):
    """Re-save ``src`` into ``dst`` after editing entries/arrays: every hash is consistent."""
    art = load_artifacts(src, kind)
    entries = [{**{k: v for k, v in e.items() if k != "arrays"}, "arrays": list(e["arrays"])} for e in art.entries]
    arrays = {k: np.array(v) for k, v in art.arrays.items()}
    if entries_fn:
        entries_fn(entries)
    if arrays_fn:
        arrays_fn(arrays)
    return save_artifacts(dst, kind, entries, arrays, dict(art.files))


def rewrite_manifest(folder, fn):
    """Edit the manifest JSON and recompute its own hash."""
    m = json.loads((folder / MANIFEST).read_text())
    fn(m)
    del m["manifest_sha256"]
    m["manifest_sha256"] = sha256(canonical_json(m))
    (folder / MANIFEST).write_bytes(canonical_json(m))


def copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


# --- table sets (finding 8 and the unclear-message list) -------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("n_levels", 5, "field 'n_levels' is 5, bits=2 means 4"),
    ("iterations", "x", "field 'iterations' must be an integer"),
    ("iterations", True, "field 'iterations' must be an integer"),
    ("solver", 7, "field 'solver' must be a string"),
    ("residual", -1.0, "field 'residual' must be a finite number >= 0"),
    ("version", None, "field 'version' must be a string"),
    ("schema", 2, "field 'schema' must be an integer in 1..1"),
    ("bits", 10**9, "field 'bits' must be an integer in 1..12"),
    ("mse", "0.1", "field 'mse' must be a finite number"),
    ("unit_distortion", 1.0, "field 'unit_distortion'"),
    ("surprise", 1, "unknown ['surprise']"),
])
def test_table_entry_fields_are_checked(tables, tmp_path, field, value, message):
    def edit(entries):
        entries[0][field] = value
    bad = forge(tables, tmp_path / "bad", "codebooks", edit)
    with pytest.raises(TableFileError, match=MANIFEST) as err:
        load_tables(bad)
    assert message in str(err.value)


def test_missing_entry_field_names_it(tables, tmp_path):
    bad = forge(tables, tmp_path / "bad", "codebooks", lambda e: e[0].pop("solver"))
    with pytest.raises(TableFileError, match=r"missing \['solver'\]"):
        load_tables(bad)


@pytest.mark.parametrize("name", ["../x", "/etc/hostname", "sub/dir", ".hidden", ".."])
def test_files_outside_the_folder_are_refused(tables, tmp_path, name):
    bad = copy(tables, tmp_path / "bad")
    rewrite_manifest(bad, lambda m: m["files"].update({name: "0" * 64}))
    with pytest.raises(TableFileError, match="outside the folder"):
        load_tables(bad)


def test_safetensors_metadata_must_match_the_manifest(tables, tmp_path):
    """The tensors file says kind 'nova_kv__' while the manifest says 'codebooks'."""
    bad = copy(tables, tmp_path / "bad")
    raw = (bad / TENSORS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"kind":"codebooks"', b'"kind":"nova_kv__"')
    assert len(header) == n
    new = raw[:8] + header + raw[8 + n:]
    (bad / TENSORS).write_bytes(new)
    rewrite_manifest(bad, lambda m: m["files"].update({TENSORS: sha256(new)}))
    with pytest.raises(TableFileError, match="header metadata"):
        load_tables(bad)


def test_bf16_tensor_is_one_clear_error(tables, tmp_path, capsys):
    bad = copy(tables, tmp_path / "bad")
    raw = (bad / TENSORS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[key]["dtype"] = "BF16"
    header[key]["shape"] = [header[key]["shape"][0] * 2]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    (bad / TENSORS).write_bytes(new)
    rewrite_manifest(bad, lambda m: m["files"].update({TENSORS: sha256(new)}))
    with pytest.raises(TableFileError, match="dtype 'BF16' is not one this toolkit writes"):
        load_tables(bad)
    from codebooks.cli import main
    assert main(["show", str(bad)]) == 2
    assert "BF16" in capsys.readouterr().err


@pytest.mark.parametrize("token, message", [
    ("NaN", "NaN is not allowed"),
    ("Infinity", "Infinity is not allowed"),
    ("1" + "0" * 5000, "integer with 5001 digits"),
    ("1." + "0" * 5000, "written with 5002 characters"),
    ("1e999", "overflows float64"),
])
def test_odd_numbers_in_a_manifest(tables, tmp_path, token, message):
    bad = copy(tables, tmp_path / "bad")
    text = (bad / MANIFEST).read_text()
    m = json.loads(text)
    mse = repr(m["entries"][0]["mse"])
    (bad / MANIFEST).write_text(text.replace(f'"mse": {mse}', f'"mse": {token}', 1))
    with pytest.raises(TableFileError, match=MANIFEST) as err:
        load_tables(bad)
    assert message in str(err.value)


def test_deeply_nested_manifest(tables, tmp_path, capsys):
    bad = copy(tables, tmp_path / "bad")
    (bad / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TableFileError, match="nested deeper than 32 levels"):
        load_tables(bad)
    from codebooks.cli import main
    assert main(["show", str(bad)]) == 2
    assert "nested deeper" in capsys.readouterr().err


def test_fifo_and_directory_are_named_as_such(tables, tmp_path):
    bad = copy(tables, tmp_path / "bad")
    (bad / HEADER).unlink()
    os.mkfifo(bad / HEADER)
    with pytest.raises(TableFileError, match="not a regular file"):
        load_tables(bad)  # and never blocks on the FIFO
    (bad / HEADER).unlink()
    (bad / HEADER).mkdir()
    with pytest.raises(TableFileError, match="is a directory"):
        load_tables(bad)
    with pytest.raises(TableFileError, match="is not a directory"):
        load_tables(bad / MANIFEST)


# --- NOVA-KV models and calibration statistics (finding 4) -----------------------------------------
@pytest.mark.parametrize("array, value, message", [
    ("key.centroids", np.nan, "NaN/Inf"),
    ("value.centroids", np.inf, "NaN/Inf"),
    ("key.forward", np.nan, "NaN/Inf"),
    ("value.variances", -1.0, "value.variances has negative entries"),
    ("oscar.key", 2.0, "oscar.key is not orthogonal"),
])
def test_nova_arrays_are_checked(nova, tmp_path, array, value, message):
    def edit(arrays):
        arrays[f"layer0.head0.{array}"].flat[0] = value
    bad = forge(nova[0], tmp_path / "bad", "nova_kv", arrays_fn=edit)
    with pytest.raises(TableFileError, match=message):
        NovaModel.load(bad)


@pytest.mark.parametrize("field, value, message", [
    ("bits", 10**9, "field 'bits' must be an integer in 1..8"),
    ("g", 0, "field 'g' must be an integer in 1..8"),
    ("g", 3, "need bits*g <= 8 and g dividing d=8"),
    ("d", "8", "field 'd' must be an integer"),
    ("key_floor", float("nan"), None),
    ("layer", -1, "field 'layer' must be an integer in 0.."),
])
def test_nova_entry_fields_are_checked(nova, tmp_path, field, value, message):
    def edit(entries):
        entries[0][field] = value
    if message is None:  # NaN cannot even be written: canonical JSON refuses it
        with pytest.raises(ValueError):
            forge(nova[0], tmp_path / "bad", "nova_kv", edit)
        return
    bad = forge(nova[0], tmp_path / "bad", "nova_kv", edit)
    with pytest.raises(TableFileError) as err:
        NovaModel.load(bad)
    assert message in str(err.value)


def test_nova_duplicate_head_and_missing_field(nova, tmp_path):
    """Two entries for (layer 0, head 0) under different names used to drop one silently."""
    def dup(entries):
        entries[0]["name"] = "other"
    def rename(arrays):
        for k in [k for k in arrays if k.startswith("layer0.head0.")]:
            arrays["other." + k.split(".", 2)[2]] = arrays.pop(k)
    def fix_names(entries):
        dup(entries)
        entries[0]["arrays"] = ["other." + a.split(".", 2)[2] for a in entries[0]["arrays"]]
    bad = forge(nova[0], tmp_path / "bad", "nova_kv", fix_names, rename)
    with pytest.raises(TableFileError, match="name must be 'layer0.head0'"):
        NovaModel.load(bad)
    bad2 = forge(nova[0], tmp_path / "bad2", "nova_kv", lambda e: e[0].pop("key_n_floored"))
    with pytest.raises(TableFileError, match=r"missing \['key_n_floored'\]"):
        NovaModel.load(bad2)


@pytest.mark.parametrize("edit, message", [
    (lambda e, a: a["layer0.head0.qq"].__setitem__((0, 0), np.nan), "NaN/Inf"),
    (lambda e, a: a["layer0.head0.keys.m2"].__setitem__((1, 1), -1.0), "non-negative diagonal"),
    (lambda e, a: a["layer0.head0.qq"].__setitem__((0, 1), 5.0), "symmetric"),
    (lambda e, a: e[0]["weights"].__setitem__("keys", "x"), "weights.keys"),
    (lambda e, a: e[0].__setitem__("n_queries", -3), "field 'n_queries' must be an integer >= 0"),
    (lambda e, a: e[0].__setitem__("d", 9), r"is float64 \(8, 8\), expected float64 \(9, 9\)"),
])
def test_calibration_stats_are_checked(nova, tmp_path, edit, message):
    box = {}
    def entries_fn(entries):
        box["e"] = entries
    def arrays_fn(arrays):
        edit(box["e"], arrays)
    bad = forge(nova[1], tmp_path / "bad", "calibration", entries_fn, arrays_fn)
    with pytest.raises(TableFileError, match=message):
        CalibrationStats.load(bad)


def test_good_sets_still_load(nova, tables):
    assert len(load_tables(tables)) == 2
    assert NovaModel.load(nova[0]).head(0, 0).d == D
    assert CalibrationStats.load(nova[1]).d == D



# --- issue 53: sizes bounded before reading, hashes checked before parsing, .npy headers first ---------
def _copy_set(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_an_oversized_tensor_file_is_refused_before_it_is_read(tables, tmp_path, monkeypatch):
    """A sparse 2 GiB tables.safetensors was read whole (4.2 GB peak) before its hash failed. The
    manifest bounds it (its arrays plus a bounded header) and the file's size is refused from fstat."""
    bad = _copy_set(tables, tmp_path / "bad")
    with open(bad / TENSORS, "r+b") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    import codebooks._atomic as atomic

    real = os.readv

    def readv(fd, bufs):
        if os.fstat(fd).st_size > 1 << 30:
            pytest.fail("the oversized file was read")
        return real(fd, bufs)

    monkeypatch.setattr(atomic.os, "readv", readv)
    with pytest.raises(TableFileError, match=rf"{TENSORS}: is 2147483648 bytes, more than the \d+ allowed"):
        load_tables(bad)


def test_a_large_manifest_with_a_wrong_hash_is_refused_without_parsing(tables, tmp_path, monkeypatch):
    """A 64 MiB manifest took 2.85 GB and 33 s to refuse (parsed and re-serialised first). Past
    1 MiB the manifest_sha256 line is checked against the raw bytes before any JSON parsing."""
    bad = _copy_set(tables, tmp_path / "bad")
    doc = json.loads((bad / MANIFEST).read_text())
    doc["entries"] = doc["entries"] * (4000 // len(doc["entries"]))  # ~2 MiB, consistent JSON
    (bad / MANIFEST).write_bytes(canonical_json(doc))
    import codebooks.artifacts as artifacts

    monkeypatch.setattr(artifacts, "parse_json", lambda *a, **k: pytest.fail("parsed before the hash check"))
    with pytest.raises(TableFileError, match="manifest_sha256 does not match the manifest content"):
        load_tables(bad)
    (bad / MANIFEST).write_bytes(b"{" + b" " * (2 << 20) + b"}")
    with pytest.raises(TableFileError, match="no single top-level 'manifest_sha256' line"):
        load_tables(bad)


def test_the_raw_hash_check_agrees_with_the_canonical_form(tables, tmp_path):
    """The pre-parse check accepts exactly the manifests the full check accepts (a valid large set)."""
    from codebooks.artifacts import _check_manifest_hash

    raw = (tables / MANIFEST).read_bytes()
    _check_manifest_hash(tables / MANIFEST, raw)
    doc = json.loads(raw)
    doc["generator"] = "kvq-codebooks 9"
    body = {k: v for k, v in doc.items() if k != "manifest_sha256"}
    doc["manifest_sha256"] = sha256(canonical_json(body))
    _check_manifest_hash(tables / MANIFEST, canonical_json(doc))
    with pytest.raises(TableFileError):
        _check_manifest_hash(tables / MANIFEST, canonical_json(doc).replace(b"kvq-codebooks 9", b"kvq-codebooks 8"))


def test_npy_header_declaring_huge_arrays_is_one_clear_error(tmp_path, capsys):
    """A 160-byte .npy declaring 10^12 elements gave a MemoryError traceback in `kvq-codebooks audit`."""
    from codebooks.cli import main

    np.save(tmp_path / "ok.npy", np.array([-1.0, -0.3, 0.3, 1.0]))
    raw = (tmp_path / "ok.npy").read_bytes()
    hlen = int.from_bytes(raw[8:10], "little")
    header = raw[10:10 + hlen].replace(b"(4,)", b"(1000000000000,)")
    header = header.rstrip(b" \n").ljust(((10 + len(header) + 63) // 64) * 64 - 11) + b"\n"
    huge = raw[:8] + len(header).to_bytes(2, "little") + header + raw[10 + hlen:]
    (tmp_path / "huge.npy").write_bytes(huge)
    short = raw[:-8]
    (tmp_path / "short.npy").write_bytes(short)
    (tmp_path / "obj.npy").write_bytes(raw.replace(b"'<f8'", b"'|O' "))
    args = ["audit", "--dist", "gaussian", "--levels"]
    assert main(args + [str(tmp_path / "huge.npy")]) == 2
    assert "declares 1000000000000 values; a table has at most 4096" in capsys.readouterr().err
    assert main(args + [str(tmp_path / "short.npy")]) == 2
    assert "but holds 24 bytes of data" in capsys.readouterr().err
    assert main(args + [str(tmp_path / "obj.npy")]) == 2
    assert "not numbers" in capsys.readouterr().err
    assert main(args + [str(tmp_path / "ok.npy")]) == 0
