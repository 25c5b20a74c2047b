"""kvq-codebooks checks its arguments and output paths before any work (issue 16, crash/unclear list).

Output-path OSErrors surfaced only after all the work (``--out`` an existing file or an unwritable
place in build/calibrate/curves/plot); ``--bits 1-99999999999`` was expanded before checking
(MemoryError); deep JSON crashed ``audit --levels`` and ``kvq-theory plot`` (RecursionError);
``--max-train-tokens -1`` silently dropped a token; ``kvq-theory plot -o DIR`` wrote ``DIR.png``
beside the folder; ``load_device_table(bits=True)`` returned the 1-bit table.
"""

from __future__ import annotations

import os

import pytest

import codebooks.cli
import codebooks.nova
from codebooks.cli import main

UNWRITABLE = "/proc/sys/kvq-test-out"  # not writable even for root


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command starts its work before refusing."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were checked")
    monkeypatch.setattr(codebooks.cli, "build", boom)
    monkeypatch.setattr(codebooks.cli, "read_qkv", boom)
    monkeypatch.setattr(codebooks.nova, "calibrate", boom)


def _err(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one clear line, no traceback
    return err


def test_build_output_checked_first(tmp_path, capsys, no_work):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["build", "--default", "--out", str(f)]) == 2
    assert "exists and is not a directory" in _err(capsys)
    assert main(["build", "--default", "--out", str(f / "sub")]) == 2
    assert "is not a directory" in _err(capsys)
    assert main(["build", "--default", "--out", UNWRITABLE]) == 2
    assert "is not writable" in _err(capsys)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["build", "--default", "--out", str(tmp_path / "mine")]) == 2
    assert "holds other files" in _err(capsys)


@pytest.mark.parametrize("argv, message", [
    (["build", "--dist", "gaussian", "--bits", "1-99999999999"], "--bits: '1-99999999999' is outside 1..12"),
    (["build", "--dist", "sphere", "--dim", "2-99999999999"], "is outside 2..1048576"),
    (["build", "--dist", "sphere", "--dim", "2-900000"], "names 899999 values, more than the 10000 allowed"),
    (["build", "--dist", "gaussian", "--sigma", "nan"], "non-finite"),
    (["build", "--dist", "gaussian", "--sigma", "1e-300", "--bits", "1"], "sigma must be in"),
])
def test_ranges_checked_before_expansion(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert message in _err(capsys)


@pytest.mark.parametrize("flag, value, message", [
    ("--max-train-tokens", "-1", "--max-train-tokens must be >= 1, got -1"),
    ("--iterations", "-2", "--iterations must be in 0..1000000"),
    ("--bits", "0", "--bits must be in 1..8"),
    ("--group", "0", "--group must be in 1..8"),
])
def test_calibrate_arguments_checked_before_reading(flag, value, message, tmp_path, capsys, no_work):
    assert main(["calibrate", "--qkv", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "o"),
                 flag, value]) == 2
    assert message in _err(capsys)


def test_calibrate_output_checked_first(tmp_path, capsys, no_work):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["calibrate", "--qkv", str(tmp_path / "none"), "--out", str(f)]) == 2
    assert "exists and is not a directory" in _err(capsys)
    (tmp_path / "o" / "nova_kv").mkdir(parents=True)
    (tmp_path / "o" / "nova_kv" / "x.txt").write_text("mine")
    assert main(["calibrate", "--qkv", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "holds other files" in _err(capsys)


def test_qkv_fifo_is_named(tmp_path, capsys):
    os.mkfifo(tmp_path / "q.safetensors")
    assert main(["calibrate", "--qkv", str(tmp_path / "q.safetensors"), "--out", str(tmp_path / "o")]) == 2
    assert "not a regular file" in _err(capsys)


def test_audit_levels_files(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 50_000 + "]" * 50_000)
    assert main(["audit", "--dist", "gaussian", "--levels", str(deep)]) == 2
    assert "nested deeper than 32 levels" in _err(capsys)
    nested = tmp_path / "nested.json"
    nested.write_text("[[1, 2]]")
    assert main(["audit", "--dist", "gaussian", "--levels", str(nested)]) == 2
    assert "flat JSON list of numbers" in _err(capsys)
    os.mkfifo(tmp_path / "fifo")
    assert main(["audit", "--dist", "gaussian", "--levels", str(tmp_path / "fifo")]) == 2
    assert "not a regular file" in _err(capsys)
    assert main(["audit", "--dist", "gaussian", "--levels", str(tmp_path)]) == 2
    assert "is a directory" in _err(capsys)


def test_load_device_table_refuses_bool_bits():
    pytest.importorskip("torch")
    from gpu.tables import load_device_table

    with pytest.raises(TypeError, match="bits must be an integer, got True"):
        load_device_table(128, True)
    with pytest.raises(TypeError, match="dim must be an integer"):
        load_device_table(128.0, 2)
    assert load_device_table(128, 1).bits == 1
