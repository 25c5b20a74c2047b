"""kvq-theory curves / plot, and the JSON series format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from codebooks import Gaussian, lloyd_max
from theory import ResultsError, Series, load_series
from theory.cli import main


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("theory")
    ext = out / "ext.npy"
    np.save(ext, lloyd_max(Gaussian(), 3).levels / np.sqrt(64) * 1.2)  # a mis-scaled external table
    assert main(["curves", "--dim", "64", "--bits", "1-6", "--out", str(out / "r"), "--mc-samples", "2000",
                 "--audit", f"scaled_table={ext}"]) == 0
    return out / "r"


def test_curves_write_valid_series(results):
    files = sorted(results.glob("*.json"))
    names = {f.stem for f in files}
    assert {"shannon_lower_bound", "turboquant_mse_bound", "lloyd_max_sphere_d64", "entropy_coded_sphere_d64",
            "peer_lloyd300_sphere_d64", "norm_corrected_sphere_d64", "qjl_prod_exact_d64",
            "bias_factor_sphere_d64", "scaled_table"} <= names
    series = {s.name: s for s in load_series(files)}
    lm = series["lloyd_max_sphere_d64"]
    assert lm.x == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0) and lm.kind == "exact" and lm.quantity == "mse"
    slb, tq = series["shannon_lower_bound"], series["turboquant_mse_bound"]
    assert all(lo <= v <= hi for lo, v, hi in zip(slb.y, lm.y, tq.y))
    pt = series["scaled_table"]
    assert pt.kind == "measured" and pt.x == (3.0,) and pt.params["excess_percent"] > 1
    assert pt.y[0] > lm.y[2]
    raw = json.loads((results / "lloyd_max_sphere_d64.json").read_text())
    assert set(raw) >= {"name", "description", "x", "y", "params"}


def test_curves_are_deterministic(results, tmp_path):
    assert main(["curves", "--dim", "64", "--bits", "1-6", "--out", str(tmp_path), "--mc-samples", "2000"]) == 0
    for f in tmp_path.glob("*.json"):
        assert f.read_bytes() == (results / f.name).read_bytes()


def test_plot_makes_a_png(results, tmp_path):
    out = tmp_path / "rd.png"
    assert main(["plot", *map(str, sorted(results.glob("*.json"))), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image as mpimg

    img = mpimg.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1000
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_plot_a_subset(results, tmp_path):
    out = tmp_path / "one.png"
    assert main(["plot", str(results / "bias_factor_sphere_d64.json"), "-o", str(out)]) == 0
    assert out.stat().st_size > 5_000


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"name": "a"}', "missing field"),
    ('{"name": "a", "description": "", "x": [1], "y": [1, 2], "params": {}, "kind": "exact", '
     '"quantity": "mse"}', "same length"),
    ('{"name": "a", "description": "", "x": [1], "y": [1], "params": {}, "kind": "guess", '
     '"quantity": "mse"}', "kind must be one of"),
    ('{"name": "a", "description": "", "x": [1], "y": [NaN], "params": {}, "kind": "exact", '
     '"quantity": "mse"}', "finite numbers"),
])
def test_bad_json_is_one_clear_error(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["plot", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.json" in err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(ResultsError, match=message):
        Series.load(bad)


def test_missing_file_and_bad_args(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["curves", "--bits", "0-3", "--out", str(tmp_path)]) == 2
    assert "--bits: '0-3' is outside 1..12" in capsys.readouterr().err
    assert main(["curves", "--bits", "1-2", "--out", str(tmp_path), "--audit", "noequals"]) == 2
    assert "NAME=FILE" in capsys.readouterr().err
