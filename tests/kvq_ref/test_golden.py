"""kvq_ref.golden and ``kvq-codebooks golden``: files in the interop format that our implementation passes.

Each written file is read back by the independent reader of tests/interop and checked by the very
tests that check the official golden files, so the writer, the format and the rules agree.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest

import codebooks.cli as cli
from kvq_ref.golden import METHODS, encode_array, write_golden
from tests.interop import test_kivi, test_oscar, test_qjl, test_quarot
from tests.interop.golden_format import cases, decode_array, load_golden

ROOT = Path(__file__).resolve().parents[2]
CHECKS = {"kivi": {"quantizer": test_kivi.test_quantizer, "cache": test_kivi.test_cache},
          "oscar": test_oscar.test_case, "quarot": test_quarot.test_case, "qjl": test_qjl.test_case}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden")
    for m in METHODS:
        write_golden(m, out, seed=3)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_written_files_pass_the_interop_tests(written, method):
    found = cases(method, written)
    assert len(found) >= 4
    for _, case, shared in found:
        check = CHECKS[method]
        (check[case["family"]] if isinstance(check, dict) else check)(case, shared)


def test_deterministic_and_seeded(written, tmp_path):
    again = write_golden("quarot", tmp_path, seed=3)
    assert (again / "golden.json").read_bytes() == (written / "quarot" / "golden.json").read_bytes()
    other = write_golden("quarot", tmp_path / "b", seed=4)
    assert (other / "golden.json").read_bytes() != (again / "golden.json").read_bytes()
    g = load_golden(written / "quarot" / "golden.json")
    assert g["method"] == "quarot" and g["seed"] == 3


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int32"])
def test_array_encoding_round_trips(dtype):
    a = (np.arange(-6, 6).reshape(3, 4) * 1.5).astype(dtype) if "float" in dtype else \
        np.arange(12, dtype=dtype).reshape(3, 4)
    back = decode_array(encode_array(a))
    assert back.dtype == a.dtype and np.array_equal(back, a)
    with pytest.raises(TypeError, match="golden arrays"):
        encode_array(np.zeros(2, np.int64))


def test_pyproject_registers_the_command():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.PLUGIN_GROUP]
    assert eps == {"golden": "kvq_ref.golden:main"}


def test_cli_golden_through_the_entry_point(tmp_path, monkeypatch, capsys):
    # the entry point as pyproject.toml declares it (an editable install may carry older metadata)
    ep = EntryPoint("golden", "kvq_ref.golden:main", cli.PLUGIN_GROUP)
    monkeypatch.setattr(cli, "plugin_commands", lambda: {"golden": ep})
    assert cli.main(["golden", "--method", "kivi,qjl", "--out", str(tmp_path), "--seed", "1"]) == 0
    assert (tmp_path / "kivi" / "golden.json").is_file() and (tmp_path / "qjl" / "facts.json").is_file()
    assert "wrote" in capsys.readouterr().out
    assert cli.main(["golden", "--method", "nova", "--out", str(tmp_path)]) == 2
    assert "method must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "golden" in capsys.readouterr().out


FACT_KEYS = {"method", "source", "golden_format", "settings", "arithmetic", "rules", "not_covered", "gpu_notes",
             "golden_cases", "golden_fields", "tolerance", "amended"}


@pytest.mark.parametrize("method", METHODS)
def test_facts_are_complete(written, method):
    """facts.json holds what the official facts hold: source (generator, command, seed, the official
    repository, commit and functions), settings, arithmetic, rules, cases, fields and a tolerance; every
    output array of every case is named in the fields."""
    import json
    import re

    facts = json.loads((written / method / "facts.json").read_text())
    assert set(facts) == FACT_KEYS and facts["method"] == method
    src = facts["source"]
    assert src["seed"] == 3 and src["command"] == f"kvq-codebooks golden --method {method} --seed 3"
    assert re.fullmatch(r"[0-9a-f]{40}", src["reproduces"]["commit"]) and src["reproduces"]["functions"]
    assert len(facts["rules"]) >= 4 and all(isinstance(r, str) and len(r) > 40 for r in facts["rules"])
    assert facts["settings"] and facts["arithmetic"] and facts["tolerance"] and facts["golden_cases"]
    named = json.dumps(facts["golden_fields"]) + facts["tolerance"]
    for _, case, _ in cases(method, written):
        for key in case["outputs"]:
            stem = re.sub(r"(_bsearch)?(_[a-z0-9]+)?$", "", key) if key.endswith(("_f32", "_f16", "_u8", "_i32", "_f64")) \
                else re.sub(r"_b\d.*$", "", key)
            assert stem in named, f"{method}: output {key!r} is not described in golden_fields"
