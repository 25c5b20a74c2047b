"""kvq-theory checks its arguments and output paths before any work (issue 16, crash/unclear list).

``kvq-theory plot -o DIR`` wrote ``DIR.png`` beside the folder; ``--out`` an existing file surfaced
only after all the work; ``--bits 1-99999999999`` was expanded before checking; deeply nested JSON
crashed ``plot`` with a RecursionError.
"""

from __future__ import annotations

import pytest

import theory.cli
from theory.cli import main as theory_main

UNWRITABLE = "/proc/sys/kvq-test-out"  # not writable even for root


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command starts its work before refusing."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were checked")
    monkeypatch.setattr(theory.cli, "default_series", boom)


def _err(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one clear line, no traceback
    return err


def test_theory_plot_output_and_inputs(tmp_path, capsys):
    series = tmp_path / "s.json"
    series.write_text('{"name": "a", "description": "", "x": [1], "y": [0.5], "params": {}, '
                      '"kind": "exact", "quantity": "mse"}')
    out_dir = tmp_path / "figs"
    out_dir.mkdir()
    assert theory_main(["plot", str(series), "-o", str(out_dir)]) == 2
    assert "is a directory" in _err(capsys)
    assert not (tmp_path / "figs.png").exists()  # matplotlib used to write DIR.png beside DIR
    assert theory_main(["plot", str(series), "-o", str(tmp_path / "noext")]) == 2
    assert "must end in one of .png" in _err(capsys)
    assert theory_main(["plot", str(series), "-o", UNWRITABLE + ".png"]) == 2
    assert "is not writable" in _err(capsys)
    deep = tmp_path / "deep.json"
    deep.write_text("{\"a\":" * 50_000 + "1" + "}" * 50_000)
    assert theory_main(["plot", str(deep), "-o", str(tmp_path / "x.png")]) == 2
    assert "nested deeper" in _err(capsys)
    assert theory_main(["plot", str(series), "-o", str(tmp_path / "new" / "x.png")]) == 0
    assert (tmp_path / "new" / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_theory_curves_checks_first(tmp_path, capsys, no_work):
    f = tmp_path / "file"
    f.write_text("x")
    assert theory_main(["curves", "--out", str(f)]) == 2
    assert "exists and is not a directory" in _err(capsys)
    assert theory_main(["curves", "--bits", "1-99999999999", "--out", str(tmp_path / "o")]) == 2
    assert "outside 1..12" in _err(capsys)
    assert theory_main(["curves", "--dim", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--dim must be in 2.." in _err(capsys)
    assert theory_main(["curves", "--out", str(tmp_path / "o"), "--audit", f"t={tmp_path / 'none.npy'}"]) == 2
    assert "neither a file nor a list" in _err(capsys)
