"""Which golden files the interop tests read: the bundled ``data/`` sets, then ``$KVQ_INTEROP_DIR``."""

from __future__ import annotations

import json
import shutil

import pytest

from .golden_format import DATA, ENV, cases, file_label, golden_files, interop_dirs

METHODS = ("kivi", "llama-cpp-turboquant", "oscar", "qjl", "quarot")


def test_every_method_ships_facts_and_golden_cases(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert interop_dirs() == [DATA]
    for method in METHODS:
        assert (DATA / method / "facts.json").is_file()
        assert [p.name for p in golden_files(method)] == ["golden.json"]


def test_extra_folder_adds_new_files_and_skips_copies(monkeypatch, tmp_path):
    (tmp_path / "kivi").mkdir()
    shutil.copy(DATA / "kivi" / "golden.json", tmp_path / "kivi" / "golden.json")  # a copy: read once
    doc = json.loads((DATA / "kivi" / "golden.json").read_text())
    bundled = len(doc["cases"])
    doc["cases"] = doc["cases"][:2]
    (tmp_path / "kivi" / "golden_more.json").write_text(json.dumps(doc))
    monkeypatch.setenv(ENV, str(tmp_path))
    files = golden_files("kivi")
    assert files == [DATA / "kivi" / "golden.json", tmp_path / "kivi" / "golden_more.json"]
    ids = [cid for cid, _, _ in cases("kivi")]
    assert len(ids) == bundled + 2 and len(set(ids)) == len(ids)
    assert file_label(files[0]) == "golden.json" and file_label(files[1]) == str(files[1])


def test_missing_extra_folder_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="do not exist"):
        interop_dirs()
