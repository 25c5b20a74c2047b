"""Issue 53: kvq-eval refuses bad arguments and outputs before it loads a model; no tracebacks.

Every command line here would have loaded a model first (a late error, after minutes) or crashed
with a traceback (a directory, FIFO or deeply nested ``*.json`` among the results, fields of the
wrong type) or hung (the FIFO). The model loader is replaced by one that fails the test, and the
tokenizer (which the length checks use) by a whitespace tokenizer.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kvq_eval.models as models
from kvq_eval.cli import main
from kvq_eval.niah import make_sample

from .test_protocol import HAY, WordTok


@pytest.fixture
def no_model(monkeypatch):
    import kvq_eval.runner as runner  # imported before the patch: it binds load_model at import

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(runner, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", lambda name="smollm2": WordTok())


def _run(argv, capsys):
    rc = main(argv)
    return rc, capsys.readouterr().err


def test_needle_context_longer_than_the_haystack_is_refused_naming_the_maximum():
    """A 131072-token request gave a ~35K-token prompt labelled 131072; now a ValueError names the
    largest context the haystack gives, and that context itself works, filled to its label."""
    tok = WordTok()
    with pytest.raises(ValueError, match=r"reaches at most (\d+) tokens \(maximum context\)") as err:
        make_sample(tok, "single", 131072, 0.5, 0, haystack=HAY)
    top = int(err.value.args[0].split("at most ")[1].split()[0])
    assert 17000 < top < 19000  # the 18,000 words of HAY plus the fixed text
    s = make_sample(tok, "single", top, 0.5, 0, haystack=HAY)
    assert len((s.document + s.question).split()) == top
    with pytest.raises(ValueError, match="maximum context"):
        make_sample(tok, "single", top + 40, 0.5, 0, haystack=HAY)


@pytest.mark.parametrize("extra,message", [
    (["--out", "{file}"], "exists and is not a directory"),
    (["--out", "/proc/kvq-nope/out"], "cannot be created"),
    (["--band", "99999999999999999999,0"], "two integers in 0..16777216"),
    (["--methods", ""], "--methods: no method given"),
    (["--methods", ","], "--methods: no method given"),
    (["--tasks", "niah", "--ctx", "0"], "needle contexts must be >= 256"),
    (["--tasks", "niah", "--ctx", "10000000"], r"--ctx: context 10000000 .* \(maximum context\)"),
    (["--tasks", "niah", "--depths", "2"], "depths are fractions in"),
    (["--ppl-windows", "16x1"], "a window needs at least 17 tokens"),
    (["--ppl-windows", "4096x1000"], "needs 4096000 tokens of the 'heldout' text"),
    (["--tasks", "decode", "--decode", "99999999999,1,1"], "tokens of the 'heldout' text"),
    (["--ray", "local", "--ray-gpus", "-1"], "--ray-gpus must be a finite number >= 0"),
    (["--ray", "local", "--ray-gpus", "nan"], "--ray-gpus must be a finite number >= 0"),
])
def test_run_refuses_before_the_model_loads(no_model, tmp_path, capsys, extra, message):
    (tmp_path / "afile").write_text("x")
    argv = ["run", "--out", str(tmp_path / "out"), "--methods", "tq_mse4", "--tasks", "ppl"]
    argv += [a.format(file=tmp_path / "afile") for a in extra]
    rc, err = _run(argv, capsys)
    assert rc == 2 and "Traceback" not in err
    import re

    assert re.search(message, err), err


@pytest.mark.parametrize("cmd", ["capture", "sink"])
def test_capture_and_sink_check_their_output_and_lengths_first(no_model, tmp_path, capsys, cmd):
    for out, message in [(str(tmp_path), "is a directory; give a file path"),
                         ("/proc/kvq-nope/x.out", "cannot be created")]:
        rc, err = _run([cmd, "--out", out], capsys)
        assert rc == 2 and message in err, err
    rc, err = _run([cmd, "--out", str(tmp_path / "x.out"), "--tokens", "99999999"], capsys)
    assert rc == 2 and "tokens of the" in err, err


def _results(tmp_path, kind):
    folder = tmp_path / "res" / "smollm2" / "niah"
    folder.mkdir(parents=True)
    bad = folder / "x.json"
    if kind == "dir":
        bad.mkdir()
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "nested":
        bad.write_text("[" * 100000 + "]" * 100000)
    elif kind == "fields":
        bad.write_text(json.dumps({"variant": "single", "context": 1024, "sample": 0, "results": 3}))
    elif kind == "rows":
        bad.write_text(json.dumps({"variant": "single", "context": 1024, "sample": 0, "results": {"fp32": 1}}))
    return tmp_path / "res"


@pytest.mark.parametrize("kind,message", [("dir", "is a directory"), ("fifo", "is not a regular file"),
                                          ("nested", "nested deeper than 32"), ("fields", "field 'results' is a int"),
                                          ("rows", "results must hold JSON objects")])
def test_table_compare_plot_name_a_bad_result_file(no_model, tmp_path, capsys, kind, message):
    res = _results(tmp_path, kind)
    for argv in (["table", str(res)], ["compare", str(res), "fp32", "tq_mse4@none"],
                 ["plot", str(res), "-o", str(tmp_path / "p")]):
        rc, err = _run(argv, capsys)
        assert rc == 2 and "x.json" in err and message in err, err


def test_short_perplexity_windows_never_write_nan():
    """16-token windows wrote NaN (an empty position bin) into the result JSON."""
    import torch

    from kvq_eval.scores import POSITION_BINS, window_stats

    rng = np.random.default_rng(0)
    for n in (15, 16):
        ref, out = torch.from_numpy(rng.standard_normal((n, 5))), torch.from_numpy(rng.standard_normal((n, 5)))
        target = torch.from_numpy(rng.integers(0, 5, n))
        if n < POSITION_BINS:
            with pytest.raises(ValueError, match="fewer than the 16 position bins"):
                window_stats(ref, out, target)
        else:
            stats = window_stats(ref, out, target)
            assert np.all(np.isfinite(stats["dnll_bins"])) and np.all(np.isfinite(stats["kl_bins"]))
