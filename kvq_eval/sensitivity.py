"""Per-(layer, role, candidate) sensitivity cells and joint plan measurements, resumable, serial or on Ray.

A **layer cell** measures one item of the planner's additive model (``kvq_eval.plan``): the NLL
change per token when only layer ``l``'s keys (or values) are stored by one candidate, with the
plan's band, and every other layer and the other role exact, on one window of ``text``. A **joint
cell** measures a whole per-layer table (a plan) on one window: the plan's validation and the check
of the additive model. One JSON file per cell, written whole (``grid._write``); a run computes only
the missing cells, serially with a progress bar or as Ray tasks (``runner.ray_map``: ``--ray
local|auto|ADDRESS``), and the driver writes every file.

How a layer cell is computed (exactly what the full simulation computes, faster):

* the other layers attend with stock attention, as the fp32 reference does: a forward pre-hook on
  layer ``l`` enters ``hooks.session("simulate", spec)`` and its forward hook leaves it, so only
  layer ``l`` runs the streaming simulation;
* layers before ``l`` are not run again: their outputs are the reference's, so the forward starts
  from layer ``l``'s input states, computed once per window and cached under
  ``<cache>/reference/`` (``layer_inputs``; the earlier layers' forwards are replaced by the identity
  for that call). ``tests/kvq_eval/test_planner.py`` checks that this equals the forward from the
  token ids bit for bit;
* the logits (of the quantized and of the reference hidden states, ``scores.window_stats``) are
  formed only at every ``stride``-th position (``stride=1``: all): the vocabulary head is most of a
  late layer's cost (Gemma-3's 262K-token vocabulary), and the mean over a regular subsample of
  positions is an unbiased estimate of the window's mean. A cell records the NLL change and
  KL(fp32 || quant), both per token (``dnll``, ``kl_per_token``).

Cells record the window's token-id digest, the band, the stride, the simulation version and
``provenance``; a stored cell whose settings differ from the unit's is refused (``ValueError``
naming the file), never silently mixed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from .grid import _read, _write
from .models import slug

__all__ = ["window_ids", "layer_inputs", "layer_units", "joint_units", "run_cells", "compute_cell", "read_cell",
           "table_key", "ROLES"]

ROLES = ("key", "value")
_KEY_FIELDS = ("kind", "model", "text", "tokens", "index", "ids_sha256", "band", "stride", "layer", "role",
               "candidate", "layers", "simulation")


@lru_cache(maxsize=None)
def _tokenizer(model: str):
    from .models import load_tokenizer

    return load_tokenizer(model)  # seconds to load (Gemma-3's 262K-token vocabulary): once per process


@lru_cache(maxsize=16)
def _token_ids(model: str, text: str):
    from .text import part

    return _tokenizer(model)(part(text), return_tensors="pt").input_ids[0]


@lru_cache(maxsize=64)
def _spread_window(model: str, text: str, tokens: int, count: int, index: int):
    from .text import part

    words = part(text).split()
    start = index * (len(words) // count)
    # every word is at least one token, so `tokens` words hold enough; the window is their first tokens
    chunk = " ".join(words[start:start + tokens])
    ids = _tokenizer(model)(chunk, return_tensors="pt").input_ids[0]
    if len(words) // count < tokens or ids.numel() < tokens:
        raise ValueError(f"text part {text!r} has {len(words)} words, too few for {count} disjoint windows of "
                         f"{tokens} tokens")
    return ids[:tokens].unsqueeze(0)


def window_ids(model: str, text: str, tokens: int, count: int, spread: bool) -> list:
    """``count`` token-id windows (1, tokens) of text part ``text``.

    Consecutive windows (``spread=False``) are cut from the start of the tokenized part, as
    ``calib.token_chunks`` cuts them. Spread windows (the validation's, over the 0.8M-token
    ``long_haystack``) are the first ``tokens`` tokens of the text from word ``i * (words // count)``
    on: only those words are tokenized (the whole part takes seconds), and two windows never share
    text while ``count * tokens`` is below the part's word count.
    """
    if spread:
        return [_spread_window(model, text, tokens, count, i) for i in range(count)]
    ids = _token_ids(model, text)
    if ids.numel() < tokens * count:
        raise ValueError(f"text part {text!r} has {ids.numel()} {model} tokens, need {tokens * count} "
                         f"({count} windows of {tokens})")
    return [ids[i * tokens:(i + 1) * tokens].unsqueeze(0) for i in range(count)]


def _ids_sha(ids) -> str:
    from .runner import ids_sha256

    return ids_sha256(ids)


def layer_inputs(ev, ids) -> np.ndarray:
    """float32 (layers, T, hidden) input states of every decoder layer for a window under stock
    attention, memory-mapped from ``<cache>/reference/`` (computed and written atomically once)."""
    import torch

    from .hooks import session
    from .models import cache_dir

    key = hashlib.sha256(np.ascontiguousarray(ids.numpy(), dtype=np.int64).tobytes()).hexdigest()[:24]
    path = cache_dir() / "reference" / f"{slug(ev.name)}-layer-inputs-{key}.npy"
    layers = ev.model.model.layers
    shape = (len(layers), ids.shape[1], ev.model.config.hidden_size)
    if path.is_file():
        try:
            arr = np.load(path, mmap_mode="r")
            if arr.shape == shape and arr.dtype == np.float32:
                return arr
        except (OSError, ValueError):
            pass
    out = np.empty(shape, dtype=np.float32)

    def keep(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            out[i] = h[0].detach().float().numpy()
        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with session("off"), torch.no_grad():
            ev.model.model(ids)
    finally:
        for h in handles:
            h.remove()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


@contextlib.contextmanager
def _only_layer(model, layer: int, spec):
    """Layer ``layer`` attends through ``hooks.session("simulate", spec)``, every other layer stock."""
    from . import hooks

    layers = model.model.layers
    state = {}

    def enter(module, args, kwargs):
        state["cm"] = hooks.session("simulate", spec)
        state["cm"].__enter__()

    def leave(module, args, kwargs, output):
        state.pop("cm").__exit__(None, None, None)

    handles = [layers[layer].register_forward_pre_hook(enter, with_kwargs=True),
               layers[layer].register_forward_hook(leave, with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if "cm" in state:  # the layer raised: leave its session
            state.pop("cm").__exit__(None, None, None)


@contextlib.contextmanager
def _skip_before(model, layer: int):
    """Layers ``0 .. layer - 1`` return their input unchanged (the caller passes layer ``layer``'s
    input states as ``inputs_embeds``)."""
    layers = model.model.layers
    for i in range(layer):
        layers[i].forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        yield
    finally:
        for i in range(layer):
            del layers[i].forward  # back to the class's forward


def _hidden_from(ev, ids, layer: int, spec, inputs):
    """Final hidden states (T - 1, hidden) with only ``layer`` simulated under ``spec`` (module
    docstring); ``inputs`` from ``layer_inputs`` (None: run every layer from the token ids)."""
    import torch

    with _only_layer(ev.model, layer, spec):
        if inputs is None:
            return ev._hidden(ids)
        h = torch.from_numpy(np.array(inputs[layer]))[None]
        with _skip_before(ev.model, layer):
            return ev.model.model(inputs_embeds=h).last_hidden_state[0, :-1]


_REF_LOGITS: dict = {}


def _ref_logits(ev, ids, stride: int):
    """float32 logits of the reference at every ``stride``-th position, formed once per window and
    process (the cells of a window share them: the vocabulary head is the largest fixed cost of a
    cell). One window's at a time: 1.6 GB for an 8K SmolLM2 window, 1.1 GB for Gemma-3 at stride 8."""
    import torch

    from .runner import ids_sha256

    key = (ev.name, ids_sha256(ids), stride)
    if key not in _REF_LOGITS:
        _REF_LOGITS.clear()
        ref = ev._reference(ids)[stride - 1::stride]
        _REF_LOGITS[key] = torch.cat([ev._head(ref[lo:lo + 512]) for lo in range(0, ref.shape[0], 512)])
    return _REF_LOGITS[key]


def _stats(ev, ids, out, stride: int) -> dict:
    """``scores.window_stats`` at every ``stride``-th position (NLL of the quantized and the
    reference model, KL(fp32 || quant), top-1, per-bin changes), with the per-token means ``dnll``
    and ``kl`` (nats per token). The reference's logits are shared by the window's cells
    (``_ref_logits``; the same float32 logits ``window_stats`` forms, so the same sums)."""
    from .scores import window_stats

    rows = slice(stride - 1, None, stride)
    st = window_stats(_ref_logits(ev, ids, stride), out[rows], ids[0, 1:][rows], head=ev._head, ref_logits=True)
    st["dnll"] = (st["nll_q"] - st["nll_f"]) / st["n"]
    st["kl_per_token"] = st["kl"] / st["n"]
    return st


def _window(unit: dict):
    w = unit["window"]
    ids = window_ids(unit["model"], w["text"], w["tokens"], w["count"], w["spread"])[w["index"]]
    if _ids_sha(ids) != w["ids_sha256"]:
        raise ValueError(f"window {w['index']} of {w['text']!r} is not the one planned (token ids differ)")
    return ids


def _spec(unit: dict):
    from .methods import MethodSpec
    from .planfile import _plan_make, layer_spec

    sink, window = unit["band"]
    if unit["kind"] == "layer":
        return layer_spec(unit["candidate"], unit["layer"], unit["role"], sink, window)
    return MethodSpec(name="joint", make=_plan_make(tuple(map(tuple, unit["layers"]))), sink=sink, window=window)


_INPUTS: dict = {}


def compute_cell(ev, unit: dict) -> dict:
    """The cell of one unit (``layer_units``/``joint_units``), with its key fields, stats and timing."""
    from .hooks import SIMULATION, session
    from .provenance import finished

    t0, c0 = time.perf_counter(), time.process_time()
    ids = _window(unit)
    spec = _spec(unit)
    if unit["kind"] == "layer":
        key = (ev.name, unit["window"]["ids_sha256"])  # two models may share a tokenizer (and the ids)
        if key not in _INPUTS:
            _INPUTS.clear()  # one window's states at a time (units come ordered by window)
            _INPUTS[key] = layer_inputs(ev, ids)
        out = _hidden_from(ev, ids, unit["layer"], spec, _INPUTS[key])
    else:
        with session("simulate", spec):
            out = ev._hidden(ids)
    st = _stats(ev, ids, out, unit["stride"])
    # cpu_seconds (this process's CPU time) tells the cost apart from the machine's load
    return {**_key(unit), **st, "simulation": SIMULATION, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0, "finished": finished(), "provenance": ev.provenance("fp32")}


def _key(unit: dict) -> dict:
    from .hooks import SIMULATION

    w = unit["window"]
    out = {"kind": unit["kind"], "model": unit["model"], "text": w["text"], "tokens": w["tokens"], "index": w["index"],
           "ids_sha256": w["ids_sha256"], "band": list(unit["band"]), "stride": unit["stride"], "simulation": SIMULATION}
    if unit["kind"] == "layer":
        out.update(layer=unit["layer"], role=unit["role"], candidate=unit["candidate"])
    else:
        out["layers"] = [list(p) for p in unit["layers"]]
    return out


def read_cell(unit: dict) -> dict | None:
    """The stored cell of a unit, None when absent; ``ValueError`` naming the file when it was made
    with other settings."""
    stored = _read(unit["path"])
    if stored is None:
        return None
    want = _key(unit)
    if any(stored.get(k) != v for k, v in want.items()):
        bad = [k for k, v in want.items() if stored.get(k) != v]
        raise ValueError(f"{unit['path']}: a cell made with other settings ({', '.join(bad)}); delete it to recompute")
    return stored


def _windows(model: str, text: str, tokens: int, count: int, spread: bool) -> list[dict]:
    return [{"text": text, "tokens": tokens, "count": count, "spread": spread, "index": i, "ids_sha256": _ids_sha(ids)}
            for i, ids in enumerate(window_ids(model, text, tokens, count, spread))]


def _folder(out, model, band, w: dict, stride: int) -> Path:
    tag = "none" if band == (0, 0) else f"{band[0]}-{band[1]}"
    return Path(out) / slug(model) / "cells" / f"band{tag}" / f"{w['text']}-T{w['tokens']}-s{stride}" / f"w{w['index']}"


def layer_units(model: str, out, band, candidates, tokens: int, count: int, stride: int = 1,
                text: str = "calibration", layers=None) -> list[dict]:
    """The layer cells of a sensitivity table: every (window, layer, role, candidate), ordered by
    window then layer. Windows are consecutive from the start of ``text``."""
    from .models import model_info

    band = tuple(int(x) for x in band)
    layers = range(model_info(model).layers) if layers is None else layers
    units = []
    for w in _windows(model, text, tokens, count, spread=False):
        folder = _folder(out, model, band, w, stride)
        for layer in layers:
            for role in ROLES:
                for c in candidates:
                    units.append({"kind": "layer", "model": model, "window": w, "band": band, "stride": stride,
                                  "layer": layer, "role": role, "candidate": c,
                                  "path": folder / f"L{layer:02d}-{role}-{c}.json"})
    return units


def table_key(layers, band) -> str:
    """Short digest of a per-layer table and band: the joint cells' folder name."""
    text = json.dumps([[list(p) for p in layers], list(band)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def joint_units(model: str, out, band, layers, tokens: int, count: int, stride: int = 1, text: str = "long_haystack",
                spread: bool = True) -> list[dict]:
    """The joint cells of a per-layer table on ``count`` windows of ``text`` (spread over it)."""
    band = tuple(int(x) for x in band)
    layers = [list(p) for p in layers]
    return [{"kind": "joint", "model": model, "window": w, "band": band, "stride": stride, "layers": layers,
             "path": _folder(out, model, band, w, stride) / f"joint-{table_key(layers, band)}.json"}
            for w in _windows(model, text, tokens, count, spread)]


_WORKER_EVALUATORS: dict = {}


def _evaluator(model: str):
    from .runner import Evaluator

    if model not in _WORKER_EVALUATORS:
        _WORKER_EVALUATORS[model] = Evaluator(model, calibrate=False)
    return _WORKER_EVALUATORS[model]


def _worker(unit: dict) -> dict:
    """A Ray task: one cell (the evaluator is built once per worker process)."""
    return compute_cell(_evaluator(unit["model"]), unit)


def run_cells(units: list[dict], ray: str | None = None, num_gpus: float = 0.0, progress: bool | None = None,
              evaluator=None) -> dict:
    """Compute the missing cells of ``units`` and return ``{"cells", "done_before", "ran"}``.

    ``ray``: run them as Ray tasks (``runner.ray_map``); else serially in this process (on
    ``evaluator`` if given, else one built for the units' model), with a progress bar.
    """
    from tqdm import tqdm

    todo = [u for u in units if read_cell(u) is None]
    summary = {"cells": len(units), "done_before": len(units) - len(todo), "ran": 0}
    if not todo:
        return summary
    show = sys.stderr.isatty() if progress is None else progress
    desc = f"kvq-plan {todo[0]['model']} ({todo[0]['kind']} cells)"
    if ray is not None:
        from .runner import ray_map

        def done(i, cell):
            _write(todo[i]["path"], cell)
            summary["ran"] += 1

        ray_map(_worker, [(u,) for u in todo], done, ray, num_gpus, show, desc + " (ray)")
        return summary
    ev = evaluator if evaluator is not None else _evaluator(todo[0]["model"])
    for u in tqdm(todo, desc=desc, unit="cell", disable=not show, file=sys.stderr):
        _write(u["path"], compute_cell(ev, u))
        summary["ran"] += 1
    return summary
