"""Evaluation tasks and the resumable grid runner (one JSON file per cell).

Tasks
-----
``lm``
    Teacher-forced next-token prediction on the fixture's ``evaluation`` part (never seen by the
    calibration): perplexity of the quantized model, perplexity of the fp32 model, KL(fp32 || quant)
    and top-1 agreement, averaged over ``chunks`` windows of ``tokens`` tokens, with the streaming
    semantics of ``hooks`` (each position reads older tokens through the method).
``layers``
    Per layer, from exactly captured Q/K/V of one evaluation window: attention-output relative error
    and logit MSE of the method's cache (band included) for the last 64 query positions.
``niah``
    Needle-in-a-haystack accuracy per (context, variant, depth, seed); the document is prefilled once
    in full precision and shared by all methods (``niah`` module docstring).

Results go to ``OUT/<model>/<task>/<cell>.json``. A run computes only what is missing: an ``lm`` or
``layers`` file is one method's finished cell; a needle cell holds one entry per method, and a later
run with more methods adds the missing entries to it (same sample, one shared prefill). Calibrated
methods record the calibration length they ran with (``calib_tokens``); an entry made with another
length is recomputed, so one folder holds one calibration per method.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import numpy as np

from kvq_ref.attention import QuantizedKV, attention_prefill, exact_attention, logit_mse, relative_error

from .calib import capture, calibration_tables, token_chunks
from .hooks import QuantizedCache, cache_kwargs, register, session
from .methods import make_spec, method_info
from .models import load_model
from .niah import VARIANTS, make_sample, score
from .text import part

__all__ = ["Evaluator", "run_grid"]


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _check_calib_tokens(calib_tokens) -> None:
    if isinstance(calib_tokens, bool) or not isinstance(calib_tokens, int) or not 256 <= calib_tokens <= 8192:
        raise ValueError(f"calib_tokens must be an integer in 256..8192 (two calibration sequences), "
                         f"got {calib_tokens!r}")


class Evaluator:
    """A loaded model with its calibration, running the tasks for any method.

    Parameters
    ----------
    model_name : {"smollm2", "gemma3"}
    calibrate : bool
        Build the NOVA-KV/OSCAR tables (cached) for the calibrated methods.
    calib_tokens : int
        Length of each of the two calibration sequences. Post-RoPE key statistics depend on
        position, so a calibration shorter than the evaluated context leaves later keys outside
        the fitted distribution (``benchmarks/nova_position.py`` measures the effect).
    """

    def __init__(self, model_name: str = "smollm2", calibrate: bool = True, calib_tokens: int = 1024):
        import torch

        _check_calib_tokens(calib_tokens)
        torch.set_grad_enabled(False)
        self.name = model_name
        self.calib_tokens = calib_tokens
        self.model, self.tok, self.info = load_model(model_name)
        register()
        self.model.set_attn_implementation("kvq")
        self.tables = (calibration_tables(self.model, self.tok, model_name, length=calib_tokens)
                       if calibrate else None)

    def spec(self, method: str):
        return make_spec(method, self.tables if method_info(method).get("calibrated") else None)

    # --- lm -------------------------------------------------------------------------------------
    def lm(self, method: str, tokens: int = 1024, chunks: int = 2) -> dict:
        """Perplexity, KL and top-1 agreement on held-out text (see module docstring)."""
        import torch

        spec = None if method == "fp32" else self.spec(method)
        nll_q, nll_f, kl, top1, n = 0.0, 0.0, 0.0, 0.0, 0
        for ids in token_chunks(self.tok, part("evaluation"), tokens, chunks):
            ref = self.model(ids).logits[0, :-1].double()
            if spec is None:
                out = ref
            else:
                with session("simulate", spec):
                    out = self.model(ids).logits[0, :-1].double()
            target = ids[0, 1:]
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
            nll_f += -lp.gather(1, target[:, None]).sum().item()
            nll_q += -lq.gather(1, target[:, None]).sum().item()
            kl += (lp.exp() * (lp - lq)).sum().item()
            top1 += (out.argmax(-1) == ref.argmax(-1)).sum().item()
            n += target.numel()
        return {"ppl": math.exp(nll_q / n), "ppl_fp32": math.exp(nll_f / n), "kl": kl / n,
                "top1_agreement": top1 / n, "tokens": n}

    # --- layers ---------------------------------------------------------------------------------
    def layers(self, method: str, tokens: int = 1024, queries: int = 64) -> dict:
        """Per-layer attention-output relative error and logit MSE from captured Q/K/V."""
        spec = self.spec(method)
        ids = token_chunks(self.tok, part("evaluation"), tokens, 1)[0]
        cap = capture(self.model, ids)
        rel, lmse, bits = [], [], []
        for layer in sorted(cap):
            q, k, v = (x.astype(np.float64) for x in cap[layer])
            g = q.shape[0] // k.shape[0]
            errs, mses, b = [], [], []
            for h in range(k.shape[0]):
                d = k.shape[-1]
                cache = QuantizedKV.build(k[h], v[h], spec.key(layer, h, d), spec.value(layer, h, d),
                                          sink=spec.sink, window=spec.window)
                qq = q[h * g:(h + 1) * g, -queries:]
                errs.append(relative_error(attention_prefill(qq, cache), exact_attention(qq, k[h], v[h])))
                mses.append(logit_mse(qq, k[h], cache))
                b.append(cache.bits_per_element()["total"])
            rel.append(float(np.mean(errs)))
            lmse.append(float(np.mean(mses)))
            bits.append(float(np.mean(b)))
        return {"attn_rel_err": rel, "logit_mse": lmse, "bits_per_element": float(np.mean(bits)),
                "tokens": tokens, "queries": queries}

    # --- niah -----------------------------------------------------------------------------------
    def _greedy(self, cache, first_ids, max_new: int) -> list[int]:
        out = self.model(first_ids, **cache_kwargs(self.model, cache), use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        gen = [nxt]
        import torch

        for _ in range(max_new - 1):
            out = self.model(torch.tensor([[nxt]]), **cache_kwargs(self.model, cache), use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            gen.append(nxt)
            if nxt == self.tok.eos_token_id:
                break
        return gen

    def niah(self, methods, context: int, variant: str, depth: float, seed: int, max_new: int | None = None) -> dict:
        """One needle sample for every method (fp32 included as "fp32"), sharing one exact prefill.

        ``max_new`` defaults to 14 tokens (one 7-digit value) and 32 for ``multivalue`` (three).
        """
        max_new = max_new or (32 if variant == "multivalue" else 14)
        import copy

        import torch
        from transformers import DynamicCache

        sample = make_sample(self.tok, variant, context, depth, seed)
        doc = self.tok(sample.document, return_tensors="pt").input_ids
        question = self.tok(sample.question, add_special_tokens=False, return_tensors="pt").input_ids
        prefill = DynamicCache()
        self.model(doc, **cache_kwargs(self.model, prefill), use_cache=True)
        results = {}
        for method in methods:
            t0 = time.perf_counter()
            if method == "fp32":
                gen = self._greedy(copy.deepcopy(prefill), question, max_new)
                bits = 32.0
            else:
                spec = self.spec(method)
                cache = QuantizedCache.from_cache(prefill, spec)
                with session("cache", spec, cache):
                    gen = self._greedy(cache, question, max_new)
                bits = cache.bits_per_element()
            answer = self.tok.decode(gen, skip_special_tokens=True)
            results[method] = {"score": score(sample, answer), "answer": answer, "bits_per_element": bits,
                               "seconds": time.perf_counter() - t0}
        return {"variant": variant, "context": context, "depth": depth, "seed": seed, "key": sample.key,
                "values": list(sample.values), "prompt_tokens": int(doc.shape[1] + question.shape[1]),
                "results": results}


def run_grid(model: str, methods, out, contexts=(1024,), tasks=("lm", "layers", "niah"), variants=VARIANTS,
             depths=(0.25, 0.5, 0.75), seeds=(0,), lm_tokens: int = 1024, lm_chunks: int = 2,
             calib_tokens: int = 1024, progress: bool | None = None) -> dict:
    """Run every missing cell of the grid and return a summary of what was run.

    Parameters
    ----------
    model : str
    methods : sequence of str
        Method names (``methods.METHODS``, or ``<method>:keys``/``:values``); "fp32" is always
        evaluated as the baseline.
    out : path
        Results folder; cells already present are skipped (resumable).
    calib_tokens : int
        Calibration sequence length (``Evaluator``), recorded with every calibrated result. Stored
        results of calibrated methods made with another length are recomputed (module docstring);
        a warning says when it is shorter than the longest needle context.
    """
    import sys

    from tqdm import tqdm

    methods = [m for m in dict.fromkeys(["fp32", *methods])]
    for m in methods:
        if m != "fp32":
            method_info(m)  # ValueError naming the known methods
    _check_calib_tokens(calib_tokens)
    unknown = set(tasks) - {"lm", "layers", "niah"}
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; known: lm, layers, niah")
    root = Path(out) / model
    cells = []
    if "lm" in tasks:
        cells += [("lm", m, root / "lm" / _file_name(m)) for m in methods]
    if "layers" in tasks:
        cells += [("layers", m, root / "layers" / _file_name(m)) for m in methods if m != "fp32"]
    if "niah" in tasks:
        cells += [("niah", (c, v, d, s), root / "niah" / f"ctx{c}_{v}_d{d:g}_s{s}.json")
                  for c in contexts for v in variants for d in depths for s in seeds]
    todo = [(task, arg, path, need) for task, arg, path in cells
            if (need := _missing(task, arg, path, methods, calib_tokens))]
    summary = {"cells": len(cells), "done_before": len(cells) - len(todo), "ran": 0}
    if not todo:
        return summary
    calibrated = {m for _, _, _, need in todo for m in need if _calibrated(m)}
    longer = [arg[0] for task, arg, _, need in todo if task == "niah" and arg[0] > calib_tokens
              and calibrated.intersection(need)]
    if longer:
        warnings.warn(f"calib_tokens={calib_tokens} is shorter than the needle context {max(longer)}: "
                      f"{', '.join(sorted(calibrated))} will meet keys at positions they were not "
                      f"calibrated on (see benchmarks/nova_position.py)", stacklevel=2)
    ev = Evaluator(model, calibrate=bool(calibrated), calib_tokens=calib_tokens)
    show = sys.stderr.isatty() if progress is None else progress
    for task, arg, path, need in tqdm(todo, desc=f"kvq-eval {model}", unit="cell", disable=not show,
                                      file=sys.stderr):
        t0 = time.perf_counter()
        if task == "lm":
            res = {"method": arg, **ev.lm(arg, lm_tokens, lm_chunks), "calib_tokens": calib_tokens}
        elif task == "layers":
            res = {"method": arg, **ev.layers(arg, lm_tokens), "calib_tokens": calib_tokens}
        else:
            c, v, d, s = arg
            res = _merge_niah(path, ev.niah(need, c, v, d, s), calib_tokens)
        res.update({"model": model, "task": task})
        res["wall_seconds"] = res.get("wall_seconds", 0.0) + time.perf_counter() - t0
        _write(path, res)
        summary["ran"] += 1
    return summary


def _file_name(method: str) -> str:
    """``nova.json``; ``nova_keys.json`` for ``nova:keys`` (no colon in file names)."""
    return method.replace(":", "_") + ".json"


def _calibrated(method: str) -> bool:
    return method != "fp32" and bool(method_info(method).get("calibrated"))


def _entry_calib(entry: dict, cell: dict):
    """Calibration length of a stored result (per needle entry; older files kept it per cell)."""
    return entry.get("calib_tokens", cell.get("calib_tokens", 1024))


def _missing(task: str, arg, path: Path, methods, calib_tokens: int) -> list[str]:
    """Methods a cell still needs: absent ones, and calibrated ones stored with another length."""
    def stale(method, entry, cell):
        return _calibrated(method) and _entry_calib(entry, cell) != calib_tokens

    wanted = methods if task == "niah" else [arg]
    if not path.is_file():
        return list(wanted)
    try:
        cell = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a readable result file ({exc}); delete it to recompute the cell") from None
    if task != "niah":
        return [arg] if stale(arg, cell, cell) else []
    have = cell["results"]
    return [m for m in wanted if m not in have or stale(m, have[m], cell)]


def _merge_niah(path: Path, new: dict, calib_tokens: int) -> dict:
    """``new`` (a needle cell for some methods) merged into the cell stored at ``path``, if any.

    Every calibrated entry records its ``calib_tokens``. The stored sample must be the one just
    made (same needle key and values), or the fixture changed under the folder: that is an error,
    never a silent mix of two samples.
    """
    for method, entry in new["results"].items():
        if _calibrated(method):
            entry["calib_tokens"] = calib_tokens
    if not path.is_file():
        return new
    old = json.loads(path.read_text())
    if (old["key"], old["values"], old["prompt_tokens"]) != (new["key"], new["values"], new["prompt_tokens"]):
        raise ValueError(f"{path}: the stored needle sample differs from the one the text fixture now "
                         f"makes (key {old['key']!r} vs {new['key']!r}); write to a fresh --out folder")
    for method, entry in old["results"].items():
        if _calibrated(method) and "calib_tokens" not in entry:
            entry["calib_tokens"] = _entry_calib(entry, old)
    old["results"].update(new["results"])
    old.pop("calib_tokens", None)
    return old
