"""codebooks.llama_cpp without the fork's files: profiles as data, literals, comment masking, CLI checks.

The rewrite itself is tested on the fork's files in ``tests/interop/test_llama_cpp_rewrite.py``.
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from codebooks.cli import main
from codebooks.llama_cpp import FORK_PROFILES, _exact_decimal, literal, load_fork_profiles, mask_comments


def test_shipped_profile_is_valid_and_covers_nine_files():
    prof = load_fork_profiles()["fork@69d8e4be"]
    assert prof.revision.startswith("69d8e4be") and prof.dim == 128 and len(prof.files) == 9
    defs = [d for _, ds in prof.files.values() for d in ds]
    assert sum(d.count for d in defs) == 35
    assert {(d.bits, d.values) for d in defs} == {(b, v) for b in (2, 3, 4) for v in ("levels", "thresholds")}


def _mutated(tmp_path, edit):
    doc = json.loads(FORK_PROFILES.read_text())
    doc = copy.deepcopy(doc)
    edit(doc["forks"][0])
    path = tmp_path / "forks.json"
    path.write_text(json.dumps(doc))
    return path


C_FILE = "ggml/src/ggml-turbo-quant.c"


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.pop("dim"), "exactly name, repository, revision, dim and files"),
    (lambda r: r["files"].update({"../x.c": {"requires": [], "definitions": []}}), "relative path inside"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(bits=5), "bits must be 2, 3 or 4"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(values="centroids"), "values must be"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(type="double"), "type must be one of"),
    (lambda r: r["files"][C_FILE]["definitions"][0]["holds"].pop(), "holds must be 4 floating literals"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(select=[2, 9]), "select must be"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(count=0), "count must be a positive integer"),
    (lambda r: r["files"][C_FILE]["definitions"][0].update(anchor=""), "anchor must be a non-empty string"),
])
def test_bad_profile_records_are_refused_naming_the_field(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_fork_profiles(_mutated(tmp_path, edit))


def _nearest(x: Fraction, dtype):
    f = dtype(float(x))
    cands = [np.nextafter(f, dtype(-np.inf)), f, np.nextafter(f, dtype(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(f"u{c.itemsize}")) & 1))


@given(st.floats(-1, 1, width=32, allow_subnormal=True))
def test_float_literals_read_back_every_way(v):
    v = np.float32(v)
    text = literal(v, "f")
    assert text.endswith("f")
    body = text[:-1]
    assert _nearest(Fraction(body), np.float32) == v and np.float32(float(body)) == v


@given(st.floats(-1, 1, width=16))
def test_half_literals_read_back_every_way(v):
    v = np.float16(v)
    body = literal(v, "h")[:-1]
    assert _nearest(Fraction(body), np.float16) == v
    assert np.float16(float(body)) == v and np.float16(np.float32(float(body))) == v


def test_exact_decimal_is_the_value():
    for v in (np.float32(-0.13304152), np.float16(0.0113), np.float32(1.0), np.float32(-3e-8)):
        assert Fraction(_exact_decimal(v)) == Fraction(float(v))


def test_mask_comments_blanks_comments_and_strings_only():
    text = 'a = 0.5f; // 0.25f\n/* 0.1f\n */ s = "0.3 // no"; c = \'/\'; b = 0.7;\n'
    masked = mask_comments(text)
    assert len(masked) == len(text) and masked.count("\n") == text.count("\n")
    assert "0.5f" in masked and "0.7" in masked and "0.25" not in masked and "0.1f" not in masked
    assert "0.3" not in masked and "b = 0.7;" in masked


@pytest.mark.parametrize("argv,message", [
    (["--out", "x.h", "--apply-to", "."], "exactly one of --out"),
    ([], "exactly one of --out"),
    (["--out", "x.h", "--patch", "p.diff"], "--patch and --fork-profile go with --apply-to"),
    (["--apply-to", ".", "--dim", "64"], "uses the profile's dimension"),
    (["--apply-to", "no/such/folder"], "not a folder"),
    (["--apply-to", ".", "--bits", "5"], "bits must be among 2, 3, 4"),
    (["--apply-to", ".", "--fork-profile", "fork@0000"], "fork profile must be one of"),
])
def test_export_argument_errors(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--format", "llama.cpp", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_is_no_fork_is_refused(tmp_path, capsys):
    (tmp_path / "ggml").mkdir()
    assert main(["export", "--format", "llama.cpp", "--apply-to", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing was changed" in err and "ggml/src/ggml-turbo-quant.c: missing" in err
    assert list(tmp_path.rglob("*")) == [tmp_path / "ggml"]
