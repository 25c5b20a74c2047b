"""The real-model evaluation: capture, streaming-quantized attention, the quantized Cache, NIAH.

Tests marked ``model`` load SmolLM2-135M from its wheel (a few hundred tokens each); CI runs them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvq_ref import KIVI, QJL, PolarQuant, QuaRot, TurboBlock, TurboQuantMSE, TurboQuantProd
from kvq_eval.hooks import concat_encoded
from kvq_eval.methods import METHODS, Blocked, Identity, make_spec
from kvq_eval.niah import Sample, score
from kvq_eval.plot import (comparison_table, load_results, markdown_table, paired_comparison, plot_results,
                           summary_table)


# ---------------------------------------------------------------------------------------------
# no model


@pytest.mark.parametrize("method", [TurboQuantMSE(64, 3), TurboQuantProd(64, 3), PolarQuant(64), QuaRot(64, 2, group=64),
                                    KIVI(64, 2, "key", group=32, residual=32), KIVI(64, 2, "value", 32, 32),
                                    QJL(64, "key", m=128, m_outlier=16), QJL(64, "value"), Identity(64),
                                    Blocked(TurboBlock("turbo3", 32), 64)], ids=lambda m: m.name)
def test_chunk_encodings_concatenate(method):
    """The cache encodes tokens in chunks of 32: concatenating chunk encodings equals encoding all."""
    x = np.random.default_rng(0).standard_normal((96, 64))
    whole = method.encode(x)
    parts = concat_encoded(method, [method.encode(x[i:i + 32]) for i in range(0, 96, 32)])
    assert parts == whole
    assert np.array_equal(method.decode(parts), method.decode(whole))


def test_blocked_turbo_and_identity():
    b = Blocked(TurboBlock("turbo4", 32), 64)
    x = np.random.default_rng(1).standard_normal((5, 64))
    enc = b.encode(x)
    assert enc.bits_per_element == 4.5 and b.decode(enc).shape == (5, 64)
    assert np.array_equal(Identity(64).decode(Identity(64).encode(x)), x.astype(np.float32))
    with pytest.raises(ValueError, match="block size 32 must divide dim 48"):
        Blocked(TurboBlock("turbo3", 32), 48)


def test_method_registry():
    assert make_spec("nova", tables=object()).window == 256
    with pytest.raises(ValueError, match="needs calibration tables"):
        make_spec("nova")
    with pytest.raises(ValueError, match="unknown method"):
        make_spec("zip")
    spec = make_spec("tq_mse3")
    assert spec.key(0, 1, 64) is spec.key(0, 1, 64) and spec.key(0, 1, 64) != spec.key(0, 2, 64)


def test_half_methods_quantize_one_side_only():
    from kvq_eval.methods import method_info
    from kvq_eval.runner import _file_name

    keys, values = make_spec("tq_mse3:keys"), make_spec("tq_mse3:values")
    full = make_spec("tq_mse3")
    assert keys.key(2, 1, 64) == full.key(2, 1, 64) and keys.value(2, 1, 64) == Identity(64)
    assert values.value(2, 1, 64) == full.value(2, 1, 64) and values.key(2, 1, 64) == Identity(64)
    assert make_spec("tq_mse3:keys") == keys  # same half method, same spec (quantizers shared)
    nova = method_info("nova:values")
    assert nova["calibrated"] and (nova["sink"], nova["window"]) == (64, 256) and "nominal_bits" not in nova
    with pytest.raises(ValueError, match="needs calibration tables"):
        make_spec("nova:keys")
    for bad in ("tq_mse3:both", "zip:keys", "tq_mse3:"):
        with pytest.raises(ValueError, match="each also as <method>:keys"):
            method_info(bad)
    with pytest.raises(TypeError, match="method name must be a str"):
        method_info(3)
    assert _file_name("nova:keys") == "nova_keys.json" and _file_name("tq_split2.5") == "tq_split2.5.json"


def test_scoring_crafted_answers():
    s = Sample("single", 1024, 0.5, 0, "doc", "q", "calm-river", ("1234567",))
    assert score(s, " 1234567.") == 1.0
    assert score(s, " 1,234,567") == 1.0
    assert score(s, " 1234568") == 0.0
    m = Sample("multivalue", 1024, 0.5, 0, "doc", "q", "calm-river", ("1111111", "2222222", "3333333"))
    assert score(m, "1111111 and 3333333") == pytest.approx(2 / 3)


@pytest.mark.parametrize("bad", [100, 10_000, 1024.0, True])
def test_calibration_length_is_validated_before_any_model_load(tmp_path, bad):
    from kvq_eval.cli import main
    from kvq_eval.runner import run_grid

    with pytest.raises(ValueError, match="calib_tokens must be an integer in 256..8192"):
        run_grid("smollm2", ["nova"], tmp_path, calib_tokens=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        assert main(["run", "--methods", "nova", "--calib-tokens", str(bad), "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_needle_cells_merge_methods_and_recompute_other_calibrations(tmp_path):
    """What a run still owes a stored cell, and how new entries join it (no model: crafted files)."""
    from kvq_eval.runner import _merge_niah, _missing

    path = tmp_path / "ctx1024_single_d0.5_s0.json"
    sample = {"variant": "single", "context": 1024, "depth": 0.5, "seed": 0, "key": "calm-river",
              "values": ["1234567"], "prompt_tokens": 1000}
    # an older file: calibration length stored per cell, not per entry
    path.write_text(json.dumps({**sample, "calib_tokens": 1024, "wall_seconds": 5.0, "results": {
        "fp32": {"score": 1.0}, "tq_mse4": {"score": 1.0}, "nova": {"score": 0.0}, "oscar": {"score": 1.0}}}))
    methods = ["fp32", "tq_mse4", "kivi2", "nova", "oscar"]
    assert _missing("niah", None, path, methods, 1024) == ["kivi2"]
    # another calibration length: only the calibrated methods are owed again
    assert _missing("niah", None, path, methods, 4096) == ["kivi2", "nova", "oscar"]
    assert _missing("niah", None, tmp_path / "absent.json", methods, 4096) == methods
    new = {**sample, "results": {"kivi2": {"score": 0.0}, "nova": {"score": 1.0}}}
    merged = _merge_niah(path, new, 4096)
    assert merged["results"]["nova"] == {"score": 1.0, "calib_tokens": 4096}
    assert merged["results"]["oscar"] == {"score": 1.0, "calib_tokens": 1024}  # kept, and its length recorded
    assert merged["results"]["kivi2"] == {"score": 0.0} and merged["results"]["fp32"] == {"score": 1.0}
    assert "calib_tokens" not in merged and merged["wall_seconds"] == 5.0
    path.write_text(json.dumps(merged))
    assert _missing("niah", None, path, methods, 4096) == ["oscar"]
    assert _missing("niah", None, path, methods, 1024) == ["nova"]
    # one method per file for lm/layers: an uncalibrated method is never stale
    lm = tmp_path / "nova.json"
    lm.write_text(json.dumps({"method": "nova", "calib_tokens": 1024}))
    assert _missing("lm", "nova", lm, methods, 4096) == ["nova"] and _missing("lm", "nova", lm, methods, 1024) == []
    lm.write_text(json.dumps({"method": "kivi2", "calib_tokens": 1024}))
    assert _missing("lm", "kivi2", lm, methods, 4096) == []
    lm.write_text('{"method": "kivi2", "calib')  # a truncated file is named, never silently redone
    with pytest.raises(ValueError, match="nova.json: not a readable result file"):
        _missing("lm", "kivi2", lm, methods, 4096)
    # a stored sample that is not the one the fixture makes now is never mixed in
    with pytest.raises(ValueError, match="stored needle sample differs"):
        _merge_niah(path, {**new, "key": "other-key"}, 4096)


def test_plot_and_summary_from_json(tmp_path):
    root = tmp_path / "smollm2"
    for task, rows in (("lm", [{"method": "fp32", "ppl": 20.0, "ppl_fp32": 20.0, "kl": 0.0, "top1_agreement": 1.0},
                               {"method": "tq_mse4", "ppl": 21.0, "ppl_fp32": 20.0, "kl": 0.05,
                                "top1_agreement": 0.9}]),
                       ("layers", [{"method": "tq_mse4", "bits_per_element": 4.25, "attn_rel_err": [0.1],
                                    "logit_mse": [0.2]}])):
        (root / task).mkdir(parents=True)
        for r in rows:
            (root / task / f"{r['method']}.json").write_text(json.dumps(r))
    (root / "niah").mkdir()
    for ctx in (1024, 2048):
        (root / "niah" / f"ctx{ctx}.json").write_text(json.dumps(
            {"context": ctx, "results": {"fp32": {"score": 1.0}, "tq_mse4": {"score": 0.5}}}))
    # a cell filled for fp32 only is left out of every mean (methods are compared on the same cells)
    (root / "niah" / "ctx2048_fp32_only.json").write_text(json.dumps(
        {"context": 2048, "results": {"fp32": {"score": 0.0}}}))
    rows = {r["method"]: r for r in summary_table(load_results(tmp_path, "smollm2"))}
    assert rows["tq_mse4"]["niah"] == {1024: 0.5, 2048: 0.5} and rows["tq_mse4"]["bits_per_element"] == 4.25
    assert rows["fp32"]["niah"] == {1024: 1.0, 2048: 1.0}
    # restricted to fp32, the fp32-only cell is paired and counts
    only = summary_table(load_results(tmp_path, "smollm2", methods=["fp32"]))
    assert [r["method"] for r in only] == ["fp32"] and only[0]["niah"] == {1024: 1.0, 2048: 0.5}
    table = markdown_table(load_results(tmp_path, "smollm2")).splitlines()
    assert table[0].endswith("| NIAH 1K (n=1) | NIAH 2K (n=1) |") and table[2].startswith("| fp32 | 32 | 32 | 20.00 |")
    # nominal 4, stored 4.25, ppl 21 = +5.0 % over fp32, mean attention error 0.1, needle 0.5 at both contexts
    assert table[3] == "| tq_mse4 | 4 | 4.25 | 21.00 | +5.0% | 0.0500 | 0.900 | 0.100 | 0.50 | 0.50 |"
    paths = plot_results(tmp_path, "smollm2", tmp_path / "out" / "s")
    assert len(paths) == 2 and all(p.stat().st_size > 10_000 for p in paths)
    from kvq_eval.cli import main

    assert main(["table", str(tmp_path), "--methods", "fp32"]) == 0
    assert main(["table", str(tmp_path), "--methods", "fp32,zip"]) == 2
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path, "gemma3")


def test_paired_comparison_sign_test(tmp_path):
    from scipy.stats import binomtest

    def cell(ctx, a, b, extra=None):
        r = {"a": {"score": a}, "b": {"score": b}, **({"c": {"score": extra}} if extra is not None else {})}
        return {"context": ctx, "results": r}

    # 1K: a wins 5 (one by a third), loses 1, ties 2; 2K: all ties; a cell without b is not paired
    cells = [cell(1024, 1, 0), cell(1024, 1, 0), cell(1024, 1, 0), cell(1024, 1, 0), cell(1024, 1 / 3, 0),
             cell(1024, 0, 1), cell(1024, 0, 0), cell(1024, 1, 1), cell(2048, 1, 1, extra=0),
             {"context": 2048, "results": {"a": {"score": 1.0}}}]
    cmp = paired_comparison(cells, "a", "b")
    one = cmp[1024]
    assert (one["n"], one["wins"], one["losses"], one["ties"]) == (8, 5, 1, 2)
    assert one["mean_diff"] == pytest.approx((4 + 1 / 3 - 1) / 8, abs=1e-12)
    # exact one-sided sign test = binomial test on the untied cells (scipy, independent code)
    assert one["p_sign"] == pytest.approx(binomtest(5, 6, 0.5, alternative="greater").pvalue, rel=1e-12)
    assert cmp[2048] == {"n": 1, "wins": 0, "losses": 0, "ties": 1, "mean_diff": 0.0, "p_sign": 1.0}
    rev = paired_comparison(cells, "b", "a")[1024]
    assert (rev["wins"], rev["losses"]) == (1, 5) and rev["p_sign"] == pytest.approx(63 / 64, rel=1e-12)
    table = comparison_table(cmp, "a", "b").splitlines()
    assert table[0] == "| context | cells | a > b | a < b | ties | mean a − b | p (sign test, one-sided) |"
    assert table[2] == f"| 1024 | 8 | 5 | 1 | 2 | +0.42 | {7 / 64:.3g} |"
    with pytest.raises(ValueError, match="must differ"):
        paired_comparison(cells, "a", "a")
    with pytest.raises(ValueError, match="b='zip'"):
        paired_comparison(cells, "a", "zip")
    with pytest.raises(ValueError, match="no needle cell holds both 'a' and 'c'"):
        paired_comparison([cells[-1], {"context": 1024, "results": {"c": {"score": 1.0}}}], "a", "c")
    with pytest.raises(TypeError, match="str"):
        paired_comparison(cells, "a", 3)
    (tmp_path / "smollm2" / "niah").mkdir(parents=True)
    for i, c in enumerate(cells):
        (tmp_path / "smollm2" / "niah" / f"c{i}.json").write_text(json.dumps(c))
    from kvq_eval.cli import main

    assert main(["compare", str(tmp_path), "a", "b"]) == 0
    assert main(["compare", str(tmp_path), "a", "zip"]) == 2


# ---------------------------------------------------------------------------------------------
# with SmolLM2 (a few hundred tokens)


@pytest.fixture(scope="module")
def lm():
    pytest.importorskip("transformers")
    import torch

    from kvq_eval.calib import token_chunks
    from kvq_eval.hooks import register
    from kvq_eval.models import load_model
    from kvq_eval.text import part

    torch.set_grad_enabled(False)
    model, tok, info = load_model("smollm2")
    register()
    ids = token_chunks(tok, part("evaluation"), 200, 1)[0]
    ref = model(ids).logits  # stock sdpa
    model.set_attn_implementation("kvq")
    return model, tok, ids, ref


@pytest.mark.model
def test_capture_equals_stock_attention(lm):
    from kvq_eval.hooks import session

    model, tok, ids, ref = lm
    with session("capture") as s:
        out = model(ids).logits
    assert (out - ref).abs().max().item() <= 1e-5
    assert sorted(s.captured) == list(range(30))
    q, k, v = s.captured[0][0]
    assert q.shape == (9, 200, 64) and k.shape == (3, 200, 64) and v.shape == k.shape


@pytest.mark.model
def test_identity_method_reproduces_fp32_logits(lm):
    from kvq_eval.hooks import session

    model, tok, ids, ref = lm
    with session("simulate", make_spec("identity")):
        out = model(ids).logits
    # float64 attention vs torch's float32 sdpa: differences at float32 rounding of the logits
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.model
@pytest.mark.parametrize("name", ["tq_mse2", "tq_prod3", "kivi2", "qjl", "polarquant", "quarot2", "turbo3"])
def test_each_method_gives_finite_metrics_and_band_is_exact(lm, name):
    import torch

    from kvq_eval.hooks import session

    model, tok, ids, ref = lm
    spec = make_spec(name)
    with session("simulate", spec):
        out = model(ids).logits
    assert torch.isfinite(out).all()
    kl = (torch.softmax(ref, -1) * (torch.log_softmax(ref, -1) - torch.log_softmax(out, -1))).sum(-1).mean()
    assert 0 < kl.item() < 5
    # a band covering every token leaves only float16 storage: logits as with the identity method
    wide = type(spec)(name=spec.name, make=spec.make, sink=0, window=10_000)
    with session("simulate", wide):
        banded = model(ids).logits
    assert (banded - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.model
def test_quantized_cache_generate_and_band(lm):
    import torch

    from kvq_eval.hooks import QuantizedCache, cache_kwargs, session

    model, tok, ids, ref = lm
    short = ids[:, :150]
    plain = model.generate(short, max_new_tokens=6, do_sample=False)
    spec = make_spec("identity")
    cache = QuantizedCache(spec)
    with session("cache", spec, cache):
        same = model.generate(short, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(plain, same)
    spec = make_spec("kivi2")  # window 128: 200 + 5 tokens written -> 64 (two chunks) leave the window
    cache = QuantizedCache(spec)
    with session("cache", spec, cache):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache))
    assert out.shape == (1, 206)
    store = cache.stores[0]
    assert (store.n, store.n_mid, store.win_k[0].shape[0]) == (205, 64, 141)
    # window tokens are kept exactly (float16 copies of the keys written)
    k_full = cache.layers[0].keys[0, 0].double().numpy()
    assert np.array_equal(store.win_k[0].astype(np.float16), k_full[-store.win_k[0].shape[0]:].astype(np.float16))
    # 64 tokens at KIVI-2's stored rate (3 bits), 141 at 16: the measured rate is their mix
    kivi_bits = KIVI(64, 2, "key", 32, 32).encode(np.zeros((64, 64))).bits_per_element
    assert cache.bits_per_element() == pytest.approx((64 * kivi_bits + 141 * 16) / 205, rel=1e-12)


@pytest.mark.model
def test_needle_found_by_fp32_at_1k_and_runner_resumes(lm, tmp_path):
    from kvq_eval.runner import Evaluator

    model, tok, ids, ref = lm
    ev = Evaluator.__new__(Evaluator)
    ev.name, ev.model, ev.tok, ev.tables = "smollm2", model, tok, None
    cell = ev.niah(["fp32", "tq_mse4"], 1024, "single", 0.5, 0)
    assert cell["results"]["fp32"]["score"] == 1.0
    assert 1024 - 64 <= cell["prompt_tokens"] <= 1024  # filler stops at a sentence boundary
    assert set(cell["results"]) == {"fp32", "tq_mse4"}
    row = ev.lm("tq_mse4", tokens=128, chunks=1)
    assert row["ppl"] > 1 and row["kl"] >= 0 and 0 <= row["top1_agreement"] <= 1
    layers = ev.layers("tq_mse4", tokens=128, queries=16)
    assert len(layers["attn_rel_err"]) == 30 and all(np.isfinite(layers["logit_mse"]))


@pytest.mark.model
def test_grid_is_resumable(lm, tmp_path):
    from kvq_eval.cli import main
    from kvq_eval.runner import run_grid

    kw = dict(contexts=(256,), tasks=("lm", "niah"), variants=("single",), depths=(0.5,), seeds=(0,),
              lm_tokens=64, lm_chunks=1, progress=False)
    first = run_grid("smollm2", ["tq_mse4"], tmp_path, **kw)
    assert first == {"cells": 3, "done_before": 0, "ran": 3}
    files = sorted(p.name for p in (tmp_path / "smollm2").rglob("*.json"))
    assert files == ["ctx256_single_d0.5_s0.json", "fp32.json", "tq_mse4.json"]
    lm_row = json.loads((tmp_path / "smollm2" / "lm" / "tq_mse4.json").read_text())
    assert lm_row["wall_seconds"] > 0 and lm_row["model"] == "smollm2" and lm_row["calib_tokens"] == 1024
    assert run_grid("smollm2", ["tq_mse4"], tmp_path, **kw) == {"cells": 3, "done_before": 3, "ran": 0}
    # a method added later is computed alone and joins the stored needle cell
    cell_path = tmp_path / "smollm2" / "niah" / "ctx256_single_d0.5_s0.json"
    before = json.loads(cell_path.read_text())
    assert run_grid("smollm2", ["tq_mse4", "tq_mse2"], tmp_path, **kw) == {"cells": 4, "done_before": 2, "ran": 2}
    after = json.loads(cell_path.read_text())
    assert set(after["results"]) == {"fp32", "tq_mse4", "tq_mse2"}
    assert {m: after["results"][m] for m in before["results"]} == before["results"]
    assert after["wall_seconds"] > before["wall_seconds"]
    assert main(["run", "--methods", "nope", "--out", str(tmp_path)]) == 2
