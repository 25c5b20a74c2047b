"""The kvq-codebooks command line (in process, and once through ``python -m codebooks``)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from codebooks import Gaussian, SphereMarginal, load_tables, lloyd_max
from codebooks.build import parse_int_list
from codebooks.cli import main


def test_build_show_and_reload(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["build", "--dist", "sphere,gaussian", "--dim", "64,80", "--bits", "1-3", "--out", str(out),
                 "--quiet"]) == 0
    assert "wrote 9 codebooks" in capsys.readouterr().out
    tables = load_tables(out)
    assert sorted(tables) == sorted([f"sphere_d{d}_b{b}" for d in (64, 80) for b in (1, 2, 3)]
                                    + [f"gaussian_b{b}" for b in (1, 2, 3)])
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sphere_d80_b3" in text and "9 codebooks" in text
    assert main(["show", str(out), "--brief"]) == 0
    assert "SphereMarginal(d=64)" in capsys.readouterr().out


def test_build_is_exact_unless_fast(tmp_path, capsys):
    args = ["build", "--dist", "sphere", "--dim", "96", "--bits", "7", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "e")]) == 0
    assert main(args + ["--out", str(tmp_path / "f"), "--fast"]) == 0
    exact, fast = load_tables(tmp_path / "e")["sphere_d96_b7"], load_tables(tmp_path / "f")["sphere_d96_b7"]
    assert exact.solver == "newton-tridiagonal+mp50" and fast.solver == "newton-tridiagonal"
    assert exact == lloyd_max(SphereMarginal(96), 7, exact=True) and fast == lloyd_max(SphereMarginal(96), 7)


def test_build_polar(tmp_path, capsys):
    assert main(["build", "--dist", "polar", "--level", "1-2", "--bits", "2", "--out", str(tmp_path), "--quiet"]) == 0
    assert sorted(load_tables(tmp_path)) == ["polar_l1_b2", "polar_l2_b2"]


def test_audit_from_list_file_and_json(tmp_path, capsys):
    levels = lloyd_max(SphereMarginal(128), 2).levels
    arg = ",".join(repr(float(v)) for v in levels)
    assert main(["audit", "--dist", "sphere", "--dim", "128", f"--levels={arg}"]) == 0
    assert "excess" in capsys.readouterr().out
    np.save(tmp_path / "l.npy", 1.1 * levels)
    assert main(["audit", "--dist", "sphere", "--dim", "128", "--levels", str(tmp_path / "l.npy"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["excess_percent"] > 0.1 and rep["best_scale"] == pytest.approx(1 / 1.1, rel=1e-6)
    (tmp_path / "l.txt").write_text("\n".join(str(v) for v in lloyd_max(Gaussian(), 1).levels))
    assert main(["audit", "--dist", "gaussian", "--levels", str(tmp_path / "l.txt")]) == 0
    assert "bits               1 (2 levels)" in capsys.readouterr().out
    (tmp_path / "l.json").write_text(json.dumps([-1.0, 1.0]))
    assert main(["audit", "--dist", "gaussian", "--levels", str(tmp_path / "l.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bits"] == 1


@pytest.mark.parametrize("argv, message", [
    (["build", "--dist", "sphere", "--bits", "1-2", "--out", "x"], "--dist sphere needs --dim"),
    (["build", "--dist", "cauchy", "--out", "x"], "--dist must be sphere, gaussian or polar"),
    (["build", "--dist", "sphere", "--dim", "1", "--out", "x"], "--dim: '1' is outside 2..1048576"),
    (["build", "--dist", "gaussian", "--bits", "0-2", "--out", "x"], "--bits: '0-2' is outside 1..12"),
    (["build", "--dist", "gaussian", "--bits", "3-1", "--out", "x"], "--bits: cannot parse"),
    (["build", "--out", "x"], "--dist is required"),
    (["audit", "--dist", "gaussian", "--levels", "a,b"], "neither a file nor a list"),
    (["audit", "--dist", "gaussian", "--levels=1,0"], "strictly increasing"),
    (["audit", "--dist", "sphere", "--dim", "64,128", "--levels=-1,1"], "exactly one density"),
    (["show", "/nonexistent/folder"], "directory missing"),
])
def test_errors_are_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_parse_int_list():
    assert parse_int_list("1-3,8,2", "--bits") == [1, 2, 3, 8]
    with pytest.raises(ValueError, match="cannot parse"):
        parse_int_list("1-", "--bits")


def test_python_dash_m_entry_point(tmp_path):
    res = subprocess.run([sys.executable, "-m", "codebooks", "build", "--dist", "gaussian", "--bits", "1",
                          "--out", str(tmp_path), "--quiet"], capture_output=True, text=True, check=True)
    assert "wrote 1 codebooks" in res.stdout
    res = subprocess.run([sys.executable, "-m", "codebooks", "--version"], capture_output=True, text=True)
    assert res.stdout.startswith("kvq-codebooks ")
