"""Table files: exact round trip, determinism, corruption detection, the C header, shipped set."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codebooks import (Empirical, Gaussian, PolarAngle, SphereMarginal, TableFileError, lloyd_max,
                       load_tables, save_tables, shipped_tables)
from codebooks.build import SHIPPED_DIR, build, default_densities
from codebooks.artifacts import canonical_json as _canonical
from codebooks.artifacts import sha256 as _sha256
from codebooks.tables import HEADER, MANIFEST, TENSORS

FILES = (MANIFEST, TENSORS, HEADER)


@pytest.fixture(scope="module")
def small_set():
    rng = np.random.default_rng(0)
    return [lloyd_max(SphereMarginal(8), 1), lloyd_max(Gaussian(0.5), 2), lloyd_max(PolarAngle(2), 1),
            lloyd_max(Empirical(rng.standard_normal(50)), 2)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, small_set):
    return save_tables(small_set, tmp_path_factory.mktemp("tiny"))


def test_round_trip_is_exact(tmp_path, small_set):
    save_tables(small_set, tmp_path)
    loaded = load_tables(tmp_path)
    assert len(loaded) == len(small_set)
    for cb in small_set:
        got = loaded[cb.name]
        assert got == cb
        assert got.levels.dtype == np.float64 and got.levels.tobytes() == cb.levels.tobytes()
    assert loaded.find(Gaussian(0.5), 2) == small_set[1]
    with pytest.raises(KeyError, match="no table for Gaussian"):
        loaded.find(Gaussian(0.5), 3)
    with pytest.raises(KeyError, match="available"):
        loaded["nope"]


def test_writing_is_deterministic_and_order_free(tmp_path, small_set):
    a, b = tmp_path / "a", tmp_path / "b"
    save_tables(small_set, a)
    save_tables(small_set[::-1], b)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    save_tables(small_set, a)  # rewriting in place gives the same bytes again
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_every_flipped_byte_is_detected(tiny_folder, tmp_path):
    """Exhaustive: flip each byte of each file of a small set (bitwise NOT), one at a time."""
    work = tmp_path / "w"
    shutil.copytree(tiny_folder, work)
    for name in FILES:
        path = work / name
        raw = path.read_bytes()
        for i in range(len(raw)):
            bad = bytearray(raw)
            bad[i] ^= 0xFF
            path.write_bytes(bytes(bad))
            with pytest.raises(TableFileError, match=name.replace(".", r"\.")):
                load_tables(work)
        path.write_bytes(raw)
    assert len(load_tables(work)) == 4


@given(st.sampled_from(FILES), st.integers(0, 10**9), st.integers(1, 255))
@settings(max_examples=60)
def test_random_byte_edits_are_detected(name, pos, mask):
    folder = _default_copy()
    path = folder / name
    raw = path.read_bytes()
    bad = bytearray(raw)
    bad[pos % len(raw)] ^= mask
    path.write_bytes(bytes(bad))
    try:
        with pytest.raises(TableFileError):
            load_tables(folder)
    finally:
        path.write_bytes(raw)


_COPY: list[Path] = []


def _default_copy() -> Path:
    if not _COPY:
        import tempfile

        dst = Path(tempfile.mkdtemp()) / "default"
        shutil.copytree(SHIPPED_DIR, dst)
        _COPY.append(dst)
    return _COPY[0]


@pytest.mark.parametrize("name", FILES)
def test_truncated_or_missing_files(tiny_folder, tmp_path, name):
    work = tmp_path / "w"
    shutil.copytree(tiny_folder, work)
    raw = (work / name).read_bytes()
    (work / name).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TableFileError, match=name.replace(".", r"\.")):
        load_tables(work)
    (work / name).unlink()
    with pytest.raises(TableFileError, match="file is missing"):
        load_tables(work)


def test_schema_mismatch_is_refused(tiny_folder, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(tiny_folder, work)
    manifest = json.loads((work / MANIFEST).read_text())
    manifest["schema_version"] = 99
    del manifest["manifest_sha256"]
    manifest["manifest_sha256"] = _sha256(_canonical(manifest))  # a well-formed file from the future
    (work / MANIFEST).write_bytes(_canonical(manifest))
    with pytest.raises(TableFileError, match="schema version 99 is not supported"):
        load_tables(work)


def test_semantic_edits_with_valid_checksums_are_refused(tiny_folder, tmp_path):
    """A manifest whose mse or density was edited and re-hashed no longer matches the table."""
    work = tmp_path / "w"
    shutil.copytree(tiny_folder, work)
    manifest = json.loads((work / MANIFEST).read_text())
    entry = next(e for e in manifest["entries"] if e["density"]["kind"] == "sphere")
    entry["density"]["params"]["d"] = 9
    entry["name"] = "sphere_d9_b1"
    del manifest["manifest_sha256"]
    manifest["manifest_sha256"] = _sha256(_canonical(manifest))
    (work / MANIFEST).write_bytes(_canonical(manifest))
    with pytest.raises(TableFileError):
        load_tables(work)


def test_not_a_folder(tmp_path):
    with pytest.raises(TableFileError, match="directory missing"):
        load_tables(tmp_path / "absent")


def test_save_validation(tmp_path):
    cb = lloyd_max(Gaussian(), 1)
    with pytest.raises(ValueError, match="unique names"):
        save_tables([cb, cb], tmp_path)
    with pytest.raises(ValueError, match="at least one Codebook"):
        save_tables([], tmp_path)
    with pytest.raises(TypeError, match="Codebook objects"):
        save_tables([cb.levels], tmp_path)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")
def test_c_header_compiles_and_matches_float32_bits(tmp_path, small_set):
    """The generated header, compiled by gcc, holds exactly the float32 arrays."""
    save_tables(small_set, tmp_path)
    src = tmp_path / "dump.c"
    src.write_text(
        '#include <stdio.h>\n#include <string.h>\n#include "kvq_tables.h"\n'
        "int main(void){ for(int t=0;t<KVQ_TABLES_COUNT;t++){ const kvq_table_t *k=&kvq_tables[t];"
        ' printf("%s %d %d", k->name, k->bits, k->n_levels);'
        " for(int i=0;i<k->n_levels;i++){unsigned u; memcpy(&u,&k->levels[i],4); printf(\" %08x\",u);}"
        " for(int i=0;i<k->n_levels-1;i++){unsigned u; memcpy(&u,&k->thresholds[i],4); printf(\" %08x\",u);}"
        ' printf("\\n"); } return KVQ_TABLES_SCHEMA_VERSION == 1 ? 0 : 1; }\n'
    )
    exe = tmp_path / "dump"
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Werror", "-I", str(tmp_path), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    loaded = load_tables(tmp_path)
    assert len(out) == len(small_set)
    for line in out:
        name, bits, n, *words = line.split()
        cb = loaded[name]
        assert int(bits) == cb.bits and int(n) == cb.levels.size
        want = np.concatenate([cb.levels, cb.thresholds]).astype("<f4").view("<u4")
        assert [int(w, 16) for w in words] == want.tolist()


def test_shipped_tables_regenerate_byte_identically(tmp_path):
    """`make tables` (kvq-codebooks build --default) reproduces the shipped set exactly.

    The levels are the exact optima correctly rounded (``exact=True``), so this holds on any
    platform, not only the one that wrote the files (``test_exact.py``)."""
    save_tables(build(default_densities(), progress=False), tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (SHIPPED_DIR / name).read_bytes(), name


def test_shipped_tables_load():
    tables = shipped_tables()
    assert len(tables) == 104
    cb = tables["sphere_d128_b4"]
    assert cb.unit_distortion == pytest.approx(0.009315, rel=1e-3)
    assert tables.find(SphereMarginal(128), 4) is cb
