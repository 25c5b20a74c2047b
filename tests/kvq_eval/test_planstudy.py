"""The study's pieces that need no model: the uniform baseline, the paired window test, the chart."""

from __future__ import annotations

import json
import math

import pytest

from kvq_eval.planstudy import _cheapest, _paired, baseline_gaps, plot_study, uniform_settings


def _window(dnll, n=100, ids=None):
    w = {"n": n, "nll_q": 3.0 * n + dnll * n, "nll_f": 3.0 * n, "kl": 0.0, "top1": n}
    if ids is not None:
        w["ids_sha256"] = ids
    return w


def _cell(folder, entry, tokens, dnlls, bits, ids=None):
    name = entry.replace(":", "_").replace("@", "__").replace(",", "-")
    path = folder / "smollm2" / "ppl" / f"{name}__T{tokens}x{len(dnlls)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [_window(d, ids=None if ids is None else ids[i]) for i, d in enumerate(dnlls)]
    path.write_text(json.dumps({"entry": entry, "tokens": tokens, "windows": rows, "bits_per_element": bits,
                                "band": {"sink": 0, "window": 0}, "band_pairs": 0.0, "text": "heldout"}))
    return rows


def test_cheapest_uniform_setting_meets_the_target_at_the_upper_bound(tmp_path):
    # t interval over 3 windows: mean +- 4.303 * sd / sqrt(3)
    _cell(tmp_path, "a@none", 8192, [0.004, 0.005, 0.006], 4.25)      # ~0.5 % +- 0.25: upper ~0.75 %
    _cell(tmp_path, "b@none", 8192, [0.001, 0.008, 0.012], 3.25)      # mean 0.7 %, wide: upper ~1.4 %
    _cell(tmp_path, "c@0,64", 8192, [0.0080, 0.0085, 0.0090], 3.5)    # upper ~0.98 %
    _cell(tmp_path, "d@none", 1024, [0.0, 0.0, 0.0], 2.0)             # another context: ignored
    uni = uniform_settings(tmp_path, "smollm2", 8192)
    assert [u["entry"] for u in uni] == ["b@none", "c@0,64", "a@none"]
    assert _cheapest(uni, 1.0)["entry"] == "c@0,64"
    assert _cheapest(uni, 0.8)["entry"] == "a@none"
    assert _cheapest(uni, 0.1) is None
    # d@none has a 1K cell but no 8K one: the comparison cannot see it yet, and says so
    assert baseline_gaps(tmp_path, "smollm2", 8192) == ["d@none"]
    assert baseline_gaps(tmp_path, "smollm2", 1024) == ["a@none", "b@none", "c@0,64"]
    c = next(u for u in uni if u["entry"] == "c@0,64")
    assert c["ci"][1] == pytest.approx(100 * math.expm1(0.0085 + 4.302652729911275 * 0.0005 / math.sqrt(3)), rel=1e-9)


def test_paired_windows_check_text_and_token_ids():
    a = {"text": "heldout", "windows": [_window(0.01, ids="x"), _window(0.02, ids="y"), _window(0.03, ids="z")]}
    b = {"text": "heldout", "windows": [_window(0.00, ids="x"), _window(0.01, ids="y")]}
    got = _paired(a, b, "plan:p@0,64", "u@none", 8192)
    assert got["windows"] == 2 and got["dnll"] == pytest.approx(0.01) and got["ids_checked"]
    assert "token ids differ" in _paired(a, {**b, "windows": [_window(0.0, ids="q"), _window(0.0, ids="y")]},
                                         "p", "u", 8192)["error"]
    assert "different texts" in _paired(a, {**b, "text": "short"}, "p", "u", 8192)["error"]
    unchecked = _paired(a, {"text": "heldout", "windows": [_window(0.0), _window(0.0)]}, "p", "u", 8192)
    assert unchecked["windows"] == 2 and not unchecked["ids_checked"]


def test_plot_reads_only_the_study_json(tmp_path):
    row = {"target_pct": 1.0, "plan": {"key_bits": [5, 4, None], "value_bits": [3, 3, 4], "bits": 4.1,
                                      "heldout": {"dppl": 0.6, "ci": [0.3, 0.9]}}}
    study = {"model": "smollm2", "context": 8192, "targets": [row],
             "uniform": [{"entry": "tq_mse4@0,64", "bits": 4.43, "dppl": 0.77, "ci": [0.5, 0.99]}]}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    (png,) = plot_study(path, tmp_path / "out" / "study")
    assert png.is_file() and png.stat().st_size > 1000
    path.write_text(json.dumps({**study, "targets": []}))
    with pytest.raises(ValueError, match="no target"):
        plot_study(path, tmp_path / "x")
