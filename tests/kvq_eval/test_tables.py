"""Tables, comparisons and charts from crafted result files (no model)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy.stats import binomtest

from kvq_eval.cli import main
from kvq_eval.plot import (decode_summary, decode_table, load_results, markdown_table, niah_summary,
                           paired_comparison, paired_decode, paired_ppl, plot_results, ppl_summary)


def _ppl(entry, tokens, dnll, bits):
    windows = [{"n": tokens - 1, "nll_q": (2.0 + d) * (tokens - 1), "nll_f": 2.0 * (tokens - 1), "kl": 0.01 * tokens,
                "top1": tokens - 2, "dnll_bins": [d * (1 + b) for b in range(4)]} for d in dnll]
    return {"entry": entry, "tokens": tokens, "windows": windows, "bits_per_element": bits, "band_pairs": 0.1,
            "band": {"sink": 0, "window": 0}, "task": "ppl"}


def _write(root, rel, obj):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "smollm2"
    _write(root, "ppl/a.json", _ppl("tq_mse4@none", 1024, [0.05, 0.04, 0.06, 0.05], 4.25))
    _write(root, "ppl/b.json", _ppl("tq_mse4@64,256", 1024, [0.001, 0.002, 0.0, 0.001], 6.2))
    # 12 needle samples at 1K: fp32 right on 10, tq_mse4@none on 7 (never where fp32 fails)
    for s in range(12):
        fp, q = int(s < 10), int(s < 7)
        _write(root, f"niah/single_ctx1024_d0.5_s{s}.json", {
            "variant": "single", "context": 1024, "sample": s, "depth": 0.5, "results": {
                "fp32": {"exact": fp, "logprob": -1.0 - 0.1 * s},
                "tq_mse4@none": {"exact": q, "logprob": -1.5 - 0.1 * s, "bits_per_element": 4.25}}})
    return tmp_path


def test_summaries_and_table(folder):
    res = load_results(folder, "smollm2")
    pp = ppl_summary(res)["tq_mse4@none"][1024]
    assert pp["dppl"] == pytest.approx(100 * math.expm1(0.05), rel=1e-12) and pp["windows"] == 4
    assert pp["ci"][0] <= pp["dppl"] <= pp["ci"][1] and pp["bits"] == 4.25
    nh = niah_summary(res["niah"])
    ci = binomtest(7, 12).proportion_ci(method="wilson")
    row = nh["tq_mse4@none"][1024]
    assert row["exact"] == 7 / 12 and row["ci"] == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert row["dlogprob"] == pytest.approx(-0.5) and row["dlogprob_ci"] == pytest.approx((-0.5, -0.5))
    # the interval is Student's t over the 4 windows (t_3 = 3.182), then 100 (exp(.) - 1)
    d = [0.05, 0.04, 0.06, 0.05]
    half = 3.182446305284263 * statistics.stdev(d) / 2
    assert pp["ci"] == pytest.approx((100 * math.expm1(0.05 - half), 100 * math.expm1(0.05 + half)), rel=1e-9)
    table = markdown_table(res).splitlines()
    assert table[0].startswith("| entry | bits @1K | Δppl 1K [95% t-CI] (windows) | KL 1K | cache bits 1K | exact 1K")
    assert table[2].startswith("| fp32 | – | – | – | 32.00 | 0.83 [")
    assert table[3].startswith("| tq_mse4@none | 4.25 | +5.13% [") and table[3].endswith("| 4.25 | 0.58 [0.32, 0.81] (12) | -0.50 [-0.50, -0.50] |")
    assert table[4].startswith("| tq_mse4@64,256 | 6.20 |")
    paths = plot_results(folder, "smollm2", folder / "out" / "s")
    assert len(paths) == 1 and paths[0].stat().st_size > 10_000


def test_a_column_that_pools_two_calibrations_says_so(tmp_path):
    """A calibrated entry whose samples in one column name two calibration digests is marked
    "(n; 2 calibrations)"; one digest (or none, a method without calibration) leaves "(n)"."""
    root = tmp_path / "smollm2"
    for s in range(4):
        prov = {"artifacts": {"calibration": "c1" if s < 3 else "c2", "nova_kv": "x"}}
        for ctx, p in ((1024, prov), (4096, {"artifacts": {"calibration": "c1"}})):
            _write(root, f"niah/single_ctx{ctx}_d0.5_s{s}.json", {
                "variant": "single", "context": ctx, "sample": s, "depth": 0.5, "results": {
                    "fp32": {"exact": 1, "logprob": -1.0},
                    "nova@1,0": {"exact": int(s < 2), "logprob": -2.0, "bits_per_element": 3.5, "provenance": p}}})
    nh = niah_summary(load_results(tmp_path, "smollm2")["niah"])
    assert nh["nova@1,0"][1024]["calibrations"] == 2 and nh["nova@1,0"][4096]["calibrations"] == 1
    assert nh["fp32"][1024]["calibrations"] == 0
    row = next(r for r in markdown_table(load_results(tmp_path, "smollm2")).splitlines() if r.startswith("| nova@1,0"))
    assert "0.50 [0.15, 0.85] (4; 2 calibrations)" in row and row.count("calibrations") == 1


def test_entries_filter_keeps_the_needle_reference(folder):
    # filtering to one entry still pairs its needle samples with fp32 (the log-probability change
    # is against fp32), and drops the other entries
    res = load_results(folder, "smollm2", ["tq_mse4@none"])
    assert set(res["ppl"]) == {"tq_mse4@none"}
    assert niah_summary(res["niah"])["tq_mse4@none"][1024]["dlogprob"] == pytest.approx(-0.5)
    row = next(r for r in markdown_table(res).splitlines() if r.startswith("| tq_mse4@none |"))
    assert row.endswith("| -0.50 [-0.50, -0.50] |")
    assert load_results(folder, "smollm2", ["tq_mse4@64,256"])["niah"] and \
        "tq_mse4@none" not in niah_summary(load_results(folder, "smollm2", ["tq_mse4@64,256"])["niah"])


def test_compare_mcnemar_and_bootstrap(folder, capsys):
    cmp = paired_comparison(load_results(folder, "smollm2")["niah"], "tq_mse4@none", "fp32")[1024]
    assert (cmp["a_only"], cmp["b_only"], cmp["both"], cmp["neither"]) == (0, 3, 7, 2)
    assert cmp["p_mcnemar"] == pytest.approx(binomtest(0, 3, 0.5).pvalue)
    assert cmp["dlogprob"] == pytest.approx(-0.5)
    assert main(["compare", str(folder), "tq_mse4@none", "fp32"]) == 0
    assert "| 1024 | 12 | 0 | 3 | 7 | 2 | 0.25 | -0.50 [-0.50, -0.50] |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="must differ"):
        paired_comparison([], "a", "a")
    assert main(["compare", str(folder), "tq_mse4@none", "zip@none"]) == 2


def test_paired_perplexity_over_windows(folder, capsys):
    """Two entries on the same windows: the paired unit is the window (the difference of the two
    cells' per-window NLL changes), never a block inside one; 4 windows all of one sign give the
    smallest sign-flip p there is, 2 / 2**4."""
    from scipy.stats import ttest_1samp

    a, b = [0.05, 0.04, 0.06, 0.05], [0.001, 0.002, 0.0, 0.001]
    d = [x - y for x, y in zip(a, b)]
    cmp = paired_ppl(load_results(folder, "smollm2"), "tq_mse4@none", "tq_mse4@64,256")[1024]
    assert "blocks" not in cmp and cmp["windows"] == 4
    assert cmp["dnll"] == pytest.approx(sum(d) / 4, rel=1e-9) and cmp["ci"][0] <= cmp["dnll"] <= cmp["ci"][1]
    assert cmp["window_dnll"] == pytest.approx(d, rel=1e-9)
    assert cmp["p_t"] == pytest.approx(ttest_1samp(d, 0.0).pvalue, rel=1e-9) and cmp["p_signflip"] == 2 / 16
    assert cmp["ratio_pct"] == pytest.approx(100 * math.expm1(sum(d) / 4), rel=1e-9)
    assert main(["compare", str(folder), "tq_mse4@none", "tq_mse4@64,256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| window | windows | Δ NLL") and f"| 1K | 4 | {sum(d) / 4:+.4f} [" in out
    assert "| 0.125 |" in out
    assert paired_ppl(load_results(folder, "smollm2"), "tq_mse4@none", "fp32") == {}  # fp32 is every cell's reference
    _write(folder / "smollm2", "ppl/c.json", _ppl("kivi4@none", 1024, [0.01, 0.02], 5.0))
    with pytest.raises(ValueError, match="at 1024 tokens: the two entries hold different windows"):
        paired_ppl(load_results(folder, "smollm2"), "kivi4@none", "tq_mse4@none")


def test_bad_result_files_give_one_clear_error(tmp_path, capsys):
    _write(tmp_path / "smollm2", "ppl/x.json", {})
    assert main(["table", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "x.json: not a kvq-eval ppl result (missing entry, tokens, windows" in err and "Traceback" not in err
    v1 = tmp_path / "v1"
    _write(v1 / "smollm2", "lm/fp32.json", {})
    assert main(["table", str(v1)]) == 2
    assert "results of the v1 protocol" in capsys.readouterr().err
    (tmp_path / "smollm2" / "ppl" / "x.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable result file"):
        load_results(tmp_path, "smollm2")
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path, "gemma3")


def test_capture_refuses_bad_counts_before_loading(tmp_path, capsys, monkeypatch):
    import kvq_eval.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["capture", "--tokens", "-5", "--out", str(tmp_path / "q.safetensors")]) == 2
    assert "--tokens must be a positive integer, got -5" in capsys.readouterr().err
    assert main(["capture", "--sequences", "0", "--out", str(tmp_path / "q.safetensors")]) == 2
    assert not any(tmp_path.iterdir())


def test_run_arguments_are_validated(tmp_path):
    assert main(["run", "--band", "64", "--out", str(tmp_path)]) == 2
    assert main(["run", "--ppl-windows", "1024", "--out", str(tmp_path)]) == 2
    assert main(["run", "--prefill", "lazy", "--out", str(tmp_path)]) == 2
    assert main(["run", "--methods", "nope", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_position_and_layer_tables(folder, capsys):
    assert main(["table", str(folder), "--positions", "1024"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| entry | 0–256 | 256–512 | 512–768 | 768–1024 |"
    # mean over windows of d * (1 + bin): d averages 0.05 for tq_mse4@none
    assert "| tq_mse4@none | +0.050 | +0.100 | +0.150 | +0.200 |" in out
    assert main(["table", str(folder), "--positions", "8192"]) == 2
    assert "no perplexity cell with 8192-token windows; present: [1024]" in capsys.readouterr().err
    _write(folder / "smollm2", "layers/a.json", {"entry": "tq_mse4@none", "attn_rel_err": [0.1, 0.25],
                                                  "logit_mse": [1.0, 2.0], "bits_per_element": 4.25})
    assert main(["table", str(folder), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "| tq_mse4@none | 0.100 | 0.250 |" in out and "exact keys" not in out
    _write(folder / "smollm2", "layers/b.json", {"entry": "kivi4@none", "attn_rel_err": [0.05, 0.06],
                                                  "logit_mse": [1.0, 2.0], "bits_per_element": 5.0,
                                                  "key_mean_share": [0.2, 0.65], "logit_snr": [2.5, 0.058]})
    assert main(["table", str(folder), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "| exact keys: mean share | 0.200 | 0.650 |" in out and "| exact keys: logit SNR | 2.500 | 0.058 |" in out


def test_interrupted_run_is_logged_with_what_it_wrote(tmp_path, monkeypatch, capsys):
    """SIGTERM/Ctrl-C part-way: runs.jsonl still records the command, its wall time and the cells
    written so far (the convention of results/*/runs.jsonl), and the exit status is 130."""
    import os
    import signal

    import kvq_eval.runner as runner

    def fake_grid(*args, summary, **kw):
        summary.update(cells=10, done_before=2, ran=3)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(runner, "run_grid", fake_grid)
    assert main(["run", "--methods", "tq_mse4", "--out", str(tmp_path)]) == 130
    line = json.loads((tmp_path / "smollm2" / "runs.jsonl").read_text())
    assert (line["cells"], line["done_before"], line["ran"], line["interrupted"]) == (10, 2, 3, "SIGTERM")
    assert line["command"].startswith("kvq-eval run --methods tq_mse4") and line["wall_seconds"] >= 0
    assert "3 cell(s) run, 2 already done, of 10" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is not None


def _decode(entry, prefill, dnll, bits, new=64):
    """A decode cell: one window per value of ``dnll`` (NLL change per generated token), whose 4
    position bins hold dnll * (1, 2, 3, 4) / 2.5 (mean dnll)."""
    windows = [{"n": new, "nll_q": (2.0 + d) * new, "nll_f": 2.0 * new, "kl": 0.02 * new, "top1": new - 4,
                "dnll_bins": [d * (1 + b) / 2.5 for b in range(4)], "bits_per_element": bits} for d in dnll]
    return {"entry": entry, "prefill": prefill, "prefix": 1024, "new_tokens": new, "windows": windows, "task": "decode"}


def test_decode_table_and_paired_decode(folder, capsys):
    """Long decodes: the perplexity change over the generated tokens with a t interval over windows,
    and two entries paired on the same windows."""
    root = folder / "smollm2"
    _write(root, "decode/f.json", _decode("fp32", "exact", [0.0, 0.0], 32.0))
    _write(root, "decode/a.json", _decode("tq_mse4@none", "exact", [0.05, 0.07], 4.25))
    _write(root, "decode/b.json", _decode("tq_mse4@none+qprefill", "quantized", [0.08, 0.09], 4.25))
    _write(root, "decode/c.json", _decode("tq_mse4@none", "exact", [0.05], 4.25, new=128))  # another setting
    res = load_results(folder, "smollm2")
    assert set(res["decode"]["tq_mse4@none"]) == {(1024, 64), (1024, 128)}
    row = decode_summary(res)["tq_mse4@none"][(1024, 64)]
    assert row["dppl"] == pytest.approx(100 * math.expm1(0.06), rel=1e-12) and row["windows"] == 2
    assert row["ci"][0] < row["dppl"] < row["ci"][1] and row["tokens"] == 128 and row["prefill"] == "exact"
    assert row["kl"] == pytest.approx(0.02) and row["top1"] == pytest.approx(60 / 64) and row["bits"] == 4.25
    table = decode_table(res).splitlines()
    assert table[0] == "| entry | prefill | prefix + new | bits | Δppl [95% t-CI] (windows) | KL | top-1 |"
    assert table[2].startswith("| fp32 | exact | 1024 + 64 | 32.00 | +0.00% [+0.00, +0.00] (2) |")
    assert [r.split(" | ")[0] for r in table[3:]] == ["| tq_mse4@none"] * 2 + ["| tq_mse4@none+qprefill"]
    cmp = paired_decode(res, "tq_mse4@none+qprefill", "tq_mse4@none")
    assert list(cmp) == [(1024, 64)]  # only the setting both decoded
    c = cmp[(1024, 64)]
    assert c["windows"] == 2 and c["dnll"] == pytest.approx(0.025, rel=1e-9)
    assert c["window_dnll"] == pytest.approx([0.03, 0.02], rel=1e-9)
    assert main(["table", str(folder), "--decode"]) == 0 and "| tq_mse4@none+qprefill | quantized |" in capsys.readouterr().out
    assert main(["compare", str(folder), "tq_mse4@none+qprefill", "tq_mse4@none"]) == 0
    assert "| decode 1024 + 64 | 2 | +0.0250 [" in capsys.readouterr().out
    _write(root, "decode/d.json", _decode("kivi4@none", "exact", [0.05], 4.0, new=128))
    with pytest.raises(ValueError, match="1 window"):
        paired_decode(load_results(folder, "smollm2"), "kivi4@none", "tq_mse4@none")
    assert decode_summary(load_results(folder, "smollm2"))["kivi4@none"][(1024, 128)]["ci"] is None
    # an entry on both perplexity windows and needles still prints the needle table after the ppl one
    assert main(["compare", str(folder), "tq_mse4@none", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "| decode 1024 + 64 |" in out and "| 1024 | 12 | 0 | 3 | 7 | 2 |" in out


def test_decode_table_without_cells_is_an_error(folder, capsys):
    assert main(["table", str(folder), "--decode"]) == 2
    assert "no decode cells" in capsys.readouterr().err


def _multiquery(folder):
    """Add 12 multi-query samples at 1K beside the single ones: nobody exact, tq_mse4 1 nat below fp32."""
    root = folder / "smollm2"
    for s in range(12):
        _write(root, f"niah/multiquery_ctx1024_d0.5_s{s}.json", {
            "variant": "multiquery", "context": 1024, "sample": s, "depth": 0.5, "results": {
                "fp32": {"exact": 0, "logprob": -5.0}, "tq_mse4@none": {"exact": 0, "logprob": -6.0,
                                                                       "bits_per_element": 4.25}}})


def test_chart_plots_one_needle_variant(folder):
    # a multi-query cell at the same context must not be pooled into the single-needle point:
    # the chart's needle panels (exact match, log-probability) show one variant (default single)
    from kvq_eval.plot import figures

    _multiquery(folder)
    res = load_results(folder, "smollm2")

    def needle_points(variant):
        ax = figures(res, "smollm2", variant)["quality_vs_bits"].axes[1]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        ys = [float(y) for c in ax.containers for y in c.lines[0].get_ydata()]  # errorbar data points
        return labels, ys

    labels, ys = needle_points("single")
    assert labels == ["1K (n=12)"] and ys == [pytest.approx(7 / 12)]
    labels, ys = needle_points("multiquery")
    assert labels == ["1K (n=12)"] and ys == [0.0]

    def logprob_points(variant):
        # third panel: the answer's log-probability change against fp32, one point per entry and
        # context, at the entry's stored bits, named at the longest context
        ax = figures(res, "smollm2", variant)["quality_vs_bits"].axes[2]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        pts = [(float(x), float(y)) for c in ax.containers for x, y in zip(*c.lines[0].get_data())]
        return labels, pts, [(t.get_text(), tuple(map(float, t.xy))) for t in ax.texts]

    # multi-query: every sample 1 nat below fp32, so the point is exactly -1 (zero-width interval)
    labels, pts, names = logprob_points("multiquery")
    assert labels == ["1K (n=12 paired)"] and pts == [(4.25, pytest.approx(-1.0))]
    assert names == [("tq_mse4@none", (4.25, pytest.approx(-1.0)))]
    # single: the fixture puts tq_mse4@none 0.5 nat below fp32 on each of its 12 samples
    labels, pts, _ = logprob_points("single")
    assert labels == ["1K (n=12 paired)"] and pts == [(4.25, pytest.approx(-0.5))]
    # a second context (3 multi-query samples at 4K, 2 nats below fp32): one point per context,
    # and only the longest context's point is named
    for s in range(3):
        _write(folder / "smollm2", f"niah/multiquery_ctx4096_d0.5_s{s}.json", {
            "variant": "multiquery", "context": 4096, "sample": s, "depth": 0.5, "results": {
                "fp32": {"exact": 0, "logprob": -4.0}, "tq_mse4@none": {"exact": 0, "logprob": -6.0,
                                                                       "bits_per_element": 4.1}}})
    res = load_results(folder, "smollm2")
    labels, pts, names = logprob_points("multiquery")
    assert labels == ["1K (n=12 paired)", "4K (n=3 paired)"]
    assert pts == [(4.25, pytest.approx(-1.0)), (4.1, pytest.approx(-2.0))]
    assert names == [("tq_mse4@none", (4.1, pytest.approx(-2.0)))]
    with pytest.raises(ValueError, match="variant"):
        figures(res, "smollm2", "multikey")


def test_table_and_compare_default_to_the_single_needle(folder, capsys):
    # `kvq-eval table`/`compare` without --variant show the single needle (a pool of variants mixes
    # samples of different difficulty); --variant multiquery and --variant all are explicit
    _multiquery(folder)

    def row(*extra):
        assert main(["table", str(folder), *extra]) == 0
        return next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| tq_mse4@none |"))

    assert row().endswith("| 0.58 [0.32, 0.81] (12) | -0.50 [-0.50, -0.50] |")
    assert row("--variant", "multiquery").endswith("| 0.00 [0.00, 0.24] (12) | -1.00 [-1.00, -1.00] |")
    assert "(24) | -0.75 [" in row("--variant", "all")
    assert main(["compare", str(folder), "tq_mse4@none", "fp32"]) == 0
    assert "| 1024 | 12 | 0 | 3 | 7 | 2 | 0.25 | -0.50 [-0.50, -0.50] |" in capsys.readouterr().out
    assert main(["compare", str(folder), "tq_mse4@none", "fp32", "--variant", "all"]) == 0
    assert "| 1024 | 24 | 0 | 3 | 7 | 14 |" in capsys.readouterr().out


def test_chart_says_when_no_perplexity_cell_exists(folder):
    # a model whose grid has only needle cells so far: the perplexity panel says so instead of
    # drawing empty axes that read as a plotting error
    from kvq_eval.plot import figures

    res = load_results(folder, "smollm2")
    ax = figures(res, "smollm2")["quality_vs_bits"].axes[0]
    assert ax.containers and "no perplexity cells yet" not in [t.get_text() for t in ax.texts]
    res["ppl"] = {}
    ax = figures(res, "smollm2")["quality_vs_bits"].axes[0]
    assert not ax.containers and [t.get_text() for t in ax.texts] == ["no perplexity cells yet"]
