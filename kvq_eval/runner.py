"""Evaluation tasks and the resumable grid runner (one JSON file per cell), serial or on Ray.

Tasks
-----
``ppl``
    Teacher-forced next-token prediction on evaluation text never used for calibration: windows of
    up to ``text.SHORT_WINDOW_MAX`` tokens spread over the ``short`` part, longer windows
    consecutive from the start of ``heldout`` (``text.ppl_text``: the two never share text). Per
    window of ``T`` tokens the summed NLL of the quantized and the fp32 model, KL(fp32 || quant),
    top-1 agreement and the NLL change per position bin, with the streaming semantics of ``hooks``
    (each position reads older tokens through the method, the band per ``kvq_eval.band``). Windows
    are stored one by one, with the sha256 of their token ids: the window is the statistical unit of
    the tables (``kvq_eval.stats``).
``niah``
    One needle sample (``niah``) per cell file, one entry per (method, band, prefill mode): exact
    match of the greedy answer and the teacher-forced log-probability of the reference answer.
    ``prefill="exact"`` prefills the document once in full precision (shared by every entry) and
    quantizes it into the cache; ``prefill="quantized"`` prefills it with streaming-quantized
    attention (per entry), so the cached keys and values of later layers carry the error too.
``decode``
    A long decode: a held-out prefix is prefilled (exact or quantized), then ``new_tokens`` tokens
    of the continuation are fed one at a time over the quantized cache, each written to it (and
    quantized once it leaves the band) as it comes: NLL, KL and top-1 against fp32 per token.
``layers``
    Per layer, from exactly captured Q/K/V of one window: attention-output relative error and logit
    MSE of the method's cache (band included) for the last 64 query positions.

Results go to ``OUT/<model>/<task>/<cell>.json``. A run computes only what is missing; a needle
cell gains the entries a later run adds (same sample: its keys, values and prompt length must
match), and a serial run stores each of a prompt's entries as it finishes (a perplexity cell each
window, beside the file), so that a stopped run loses at most the entry or window in progress.
Calibrated methods record ``calib_tokens`` (and ``calib_seed`` when not 0); an entry made with
another calibration is recomputed. Every entry records its band, stored bits
(``kvq_eval.accounting``), wall time, when it finished (UTC, ``provenance.finished``: dry-run
estimates price from the newest records) and ``provenance`` (protocol, code commit, threads,
versions, calibration artifact digests).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
import warnings
from types import SimpleNamespace

import numpy as np

from kvq_ref.attention import QuantizedKV, attention_prefill, exact_attention, logit_mse, relative_error

from .accounting import cache_bits, pair_weighted_bits, spec_rates
from .band import Band
from .calib import capture, calibration_tables, token_chunks
from .grid import (PREFILL_MODES, _calibrated, cell_lock, _check_calib_seed, _check_calib_tokens, _merge_niah,
                   _missing, _partial_path, _write, entry_id, parse_entry, plan)
from .hooks import SIMULATION, QuantizedCache, cache_kwargs, register, session
from .keyopts import key_structure
from .methods import make_spec, method_info
from .models import cache_dir, canonical_model, load_model, slug
from .niah import VARIANTS, exact_match, haystack_part, make_sample
from .provenance import PROTOCOL, environment, finished, provenance
from .scores import window_stats
from .text import part, ppl_text

__all__ = ["Evaluator", "run_grid", "ray_map", "entry_id", "parse_entry", "PREFILL_MODES"]


def ids_sha256(ids) -> str:
    """sha256 of a window's token ids as little-endian int64: what a stored window was computed on."""
    return hashlib.sha256(np.ascontiguousarray(ids.numpy(), dtype="<i8").tobytes()).hexdigest()


def _check_attention_hooked(model, info, name: str) -> None:
    """``ValueError`` unless every decoder layer's attention reaches the ``kvq`` attention function.

    transformers only warns when a model cannot take a registered attention implementation (its
    layers do not go through the AttentionInterface) and keeps its own attention: every "quantized"
    run would then silently be the fp32 one. A 4-token forward in capture mode counts the layers
    whose attention the function saw.
    """
    import torch

    with session("capture") as s:
        model(torch.arange(4).unsqueeze(0))
    if len(s.captured) != info.layers:
        raise ValueError(f"model {name!r}: kvq-eval saw the attention of {len(s.captured)} of its {info.layers} layers; "
                         f"it needs a model whose attention goes through transformers' AttentionInterface")


class Evaluator:
    """A loaded model with its calibration, running the tasks for any method and band.

    Parameters
    ----------
    model_name : str
        ``"smollm2"``, ``"gemma3"`` or a local model's folder or GGUF file (``kvq_eval.models``).
    calibrate : bool
        Build the calibration tables (cached) for the calibrated methods.
    calib_tokens : int
        Length of each of the two calibration sequences (``benchmarks/nova_position.py``).
    calib_seed : int
        The calibration's k-means seed (0 by default): another seed is another draw of the same
        calibration, which is how ``make numerics`` measures what a calibration draw moves.
    """

    def __init__(self, model_name: str = "smollm2", calibrate: bool = True, calib_tokens: int = 1024,
                 calib_seed: int = 0):
        import torch

        _check_calib_tokens(calib_tokens)
        _check_calib_seed(calib_seed)
        torch.set_grad_enabled(False)
        self.name = model_name = canonical_model(model_name)
        self.calib_tokens, self.calib_seed = calib_tokens, calib_seed
        self.model, self.tok, self.info = load_model(model_name)
        register()
        self.model.set_attn_implementation("kvq")
        _check_attention_hooked(self.model, self.info, model_name)
        self.tables = (calibration_tables(self.model, self.tok, model_name, length=calib_tokens, seed=calib_seed)
                       if calibrate else None)
        self._rates: dict = {}
        self.env = environment()

    def provenance(self, method: str) -> dict:
        """The record an entry of ``method`` carries (``kvq_eval.provenance``); a plan's records the
        digest of its file (``kvq_eval.planfile``)."""
        if method.startswith("plan:"):
            from .planfile import registered_plans

            return provenance(self.env, {"plan": registered_plans()[method][1]})
        if method == "fp32" or not method_info(method).get("calibrated"):
            return provenance(self.env)
        return provenance(self.env, self.tables.digests(official=method.split(":")[0] == "nova_official"))

    def spec(self, method: str, band: Band | None = None):
        """The method's spec with the run's band (``None``: the method's own band)."""
        spec = make_spec(method, self.tables if method_info(method).get("calibrated") else None)
        return spec if band is None else dataclasses.replace(spec, sink=band.sink, window=band.window)

    def rates(self, spec) -> dict:
        key = (spec.name, id(spec.tables))
        if key not in self._rates:
            i = self.info
            self._rates[key] = spec_rates(spec, i.layers, i.kv_heads, i.head_dim)
        return self._rates[key]

    def _band_record(self, spec, T: int) -> dict:
        r = self.rates(spec)
        i = self.info
        acc = pair_weighted_bits(T, spec.sink, spec.window, r["group"], r["rate"], r["table_bits"],
                                 i.layers, i.kv_heads, i.head_dim)
        return {"band": {"sink": spec.sink, "window": spec.window, "group": r["group"]},
                "method_rate": r["rate"], "table_bits": r["table_bits"], "bits_per_element": acc["bits"],
                "band_pairs": acc["band_pairs"]}

    # --- ppl ------------------------------------------------------------------------------------
    def ppl(self, method: str, band: Band | None, tokens: int, windows: int, done=(), on_window=None) -> dict:
        """Per-window NLL, KL and top-1 of ``windows`` consecutive held-out windows (module docstring).

        ``done``: rows of the first windows, already computed (a resumed cell); ``on_window(rows)``
        is called after each new window with every row so far.
        """
        spec = self.spec(method, band)
        rows = list(done)
        text = ppl_text(tokens)
        for ids in self.ppl_windows(tokens, windows)[len(rows):]:
            t0 = time.perf_counter()
            ref = self._reference(ids)
            with session("simulate", spec):
                out = self._hidden(ids)
            rows.append({**window_stats(ref, out, ids[0, 1:], head=self._head), "ids_sha256": ids_sha256(ids),
                         "seconds": time.perf_counter() - t0, "finished": finished()})
            if on_window is not None:
                on_window(rows)
        return {"method": method, "tokens": tokens, "text": text, "windows": rows, "simulation": SIMULATION,
                "protocol": PROTOCOL, "provenance": self.provenance(method), **self._band_record(spec, tokens)}

    def ppl_windows(self, tokens: int, windows: int) -> list:
        """The token ids (1, tokens) of the perplexity windows (module docstring)."""
        text = ppl_text(tokens)
        return token_chunks(self.tok, part(text), tokens, windows, spread=text == "short")

    def _hidden(self, ids):
        """Final hidden states (T - 1, hidden) of a window: what the language-model head turns into
        the logits predicting tokens 1..T-1 (``_head``)."""
        return self.model.model(ids).last_hidden_state[0, :-1]

    def _head(self, hidden):
        """Logits of hidden-state rows exactly as the model's forward forms them (its head, then
        the final soft-capping where the model has one)."""
        import torch

        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _reference(self, ids):
        """float32 final hidden states (T - 1, hidden) of a window under stock attention, computed
        once per machine.

        Every method of a grid needs the same reference for a window (at 8K tokens its forward is a
        quarter of a perplexity cell), so it is kept under ``<cache>/reference/``, named by the
        model and a hash of the token ids, written atomically; an unreadable or mis-shaped file is
        recomputed. Hidden states, not logits: 19 MB for an 8K SmolLM2 window instead of 1.6 GB
        of logits (8.6 GB for Gemma's vocabulary); ``_head`` forms the logits chunk by chunk.
        """
        import torch

        key = hashlib.sha256(np.ascontiguousarray(ids.numpy(), dtype=np.int64).tobytes()).hexdigest()[:24]
        path = cache_dir() / "reference" / f"{slug(self.name)}-hidden-{key}.npy"
        if path.is_file():
            try:
                arr = np.load(path)
                if arr.ndim == 2 and arr.shape[0] == ids.shape[1] - 1 and arr.dtype == np.float32:
                    return torch.from_numpy(arr)
            except (OSError, ValueError):
                pass
        with session("off"):
            ref = self._hidden(ids).float().contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, ref.numpy())
        os.replace(tmp, path)
        return ref

    # --- layers ---------------------------------------------------------------------------------
    def layers(self, method: str, band: Band | None, tokens: int = 1024, queries: int = 64) -> dict:
        """Per-layer attention-output relative error and logit MSE from captured Q/K/V, and the
        exact keys' structure (``keyopts.key_structure``, head mean; the same for every method)."""
        spec = self.spec(method, band)
        ids = token_chunks(self.tok, part("heldout"), tokens, 1)[0]
        cap = capture(self.model, ids)
        rel, lmse, share, snr = [], [], [], []
        for layer in sorted(cap):
            q, k, v = (x.astype(np.float64) for x in cap[layer])
            g = q.shape[0] // k.shape[0]
            errs, mses = [], []
            structure = [key_structure(q[h * g:(h + 1) * g, -queries:].reshape(-1, k.shape[-1]), k[h])
                         for h in range(k.shape[0])]
            share.append(float(np.mean([s[0] for s in structure])))
            snr.append(float(np.mean([s[1] for s in structure])))
            for h in range(k.shape[0]):
                d = k.shape[-1]
                cache = QuantizedKV.build(k[h], v[h], spec.key(layer, h, d), spec.value(layer, h, d),
                                          sink=spec.sink, window=spec.window)
                qq = q[h * g:(h + 1) * g, -queries:]
                errs.append(relative_error(attention_prefill(qq, cache), exact_attention(qq, k[h], v[h])))
                mses.append(logit_mse(qq, k[h], cache))
            rel.append(float(np.mean(errs)))
            lmse.append(float(np.mean(mses)))
        return {"method": method, "attn_rel_err": rel, "logit_mse": lmse, "key_mean_share": share,
                "logit_snr": snr, "tokens": tokens, "queries": queries, "provenance": self.provenance(method),
                **self._band_record(spec, tokens)}

    # --- caches ---------------------------------------------------------------------------------
    def _prefill(self, ids, spec=None, logits: bool = True):
        """(DynamicCache holding ``ids``, logits of the last position): exact (``spec`` None) or
        with streaming-quantized attention.

        ``logits=False`` (the needle, which scores the answer from the cache alone) gives ``None``
        for the logits and has the model form them for the last position only: the full forward
        forms them for every position, 8.6 GB and 1.4e12 multiply-adds for Gemma's vocabulary at
        8K tokens (1.6 GB for SmolLM2), which two 8K workers on 24 GiB cannot hold at once. The cache
        is the same either way (the head is after the last layer). The decode keeps the full
        forward: its last logits are a result, and the head over one row rounds differently.
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        keep = {} if logits else {"logits_to_keep": 1}
        with session("off") if spec is None else session("simulate", spec):
            out = self.model(ids, **cache_kwargs(self.model, cache), use_cache=True, **keep).logits
        # a copy of the last row: a view would keep all positions' logits alive (8.6 GB for Gemma
        # at 8K) as long as the shared prefill is
        return cache, (out[0, -1].clone() if logits else None)

    def _calls(self, method, band, prefill, exact, doc, logits: bool = True):
        """(make a fresh cache, the session of its calls, the spec or None, last prefill logits) for
        one entry; ``exact`` is the shared exact ``_prefill`` of ``doc``; ``logits`` as in
        ``_prefill`` for a quantized prefill."""
        if method == "fp32":
            return (lambda: copy.deepcopy(exact[0])), (lambda c: session("off")), None, exact[1]
        spec = self.spec(method, band)
        base, last = exact if prefill == "exact" else self._prefill(doc, spec, logits)
        return (lambda: QuantizedCache.from_cache(base, spec)), (lambda c: session("cache", spec, c)), spec, last

    def _step(self, ids, cache, ctx):
        with ctx(cache):
            return self.model(ids, **cache_kwargs(self.model, cache), use_cache=True).logits[0]

    # --- niah -----------------------------------------------------------------------------------
    def niah(self, entries, variant: str, context: int, depth: float, sample: int, max_new: int | None = None,
             on_entry=None) -> dict:
        """One needle sample scored by every entry (``entry_id`` strings), one exact prefill shared.

        ``on_entry(part)``, if given, receives each entry as it finishes: the cell's fields with that
        entry alone in ``results`` (and the prefill's record in ``prefills`` of the first part only),
        so that a caller can store it before the next one (an 8K prompt's entries take minutes)."""
        import torch

        s = make_sample(self.tok, variant, context, depth, sample)
        doc = self.tok(s.document, add_special_tokens=not s.chat, return_tensors="pt").input_ids
        question = self.tok(s.question, add_special_tokens=False, return_tensors="pt").input_ids
        ref = self.tok(s.reference, add_special_tokens=False, return_tensors="pt").input_ids
        max_new = max_new or ref.shape[1] + 6
        t0 = time.perf_counter()
        exact = self._prefill(doc, logits=False)  # the answer is scored from the cache alone
        # the shared prefill, timed apart from the entries (at 8K it can cost more than all of them):
        # the dry run's estimate adds it once per prompt that still lacks an entry
        prefills = [{"seconds": time.perf_counter() - t0, "finished": finished()}]
        eos = self.tok.eos_token_id
        head = {"variant": variant, "context": context, "depth": depth, "sample": sample, "keys": list(s.keys),
                "values": list(s.values), "offset": s.offset, "chat": s.chat, "haystack": haystack_part(context),
                "prompt_tokens": int(doc.shape[1] + question.shape[1])}
        results = {}
        for name in entries:
            t0 = time.perf_counter()
            method, band, prefill = parse_entry(name)
            fresh, ctx, spec, _ = self._calls(method, band, prefill, exact, doc, logits=False)
            # teacher-forced log-probability of the reference answer, on a copy of the document's
            # cache (encoded once per entry: the greedy pass below reads the original)
            cache = fresh()
            forked = cache.fork() if isinstance(cache, QuantizedCache) else copy.deepcopy(cache)
            logits = self._step(torch.cat([question, ref], 1), forked, ctx).double()
            lp = torch.log_softmax(logits[question.shape[1] - 1:-1], -1)
            logprob = float(lp.gather(1, ref[0, :, None]).sum())
            # greedy answer
            nxt = int(self._step(question, cache, ctx)[-1].argmax())
            gen = [nxt]
            while len(gen) < max_new and nxt != eos:
                nxt = int(self._step(torch.tensor([[nxt]]), cache, ctx)[-1].argmax())
                gen.append(nxt)
            answer = self.tok.decode(gen, skip_special_tokens=True)
            entry = {"exact": int(exact_match(s, answer)), "logprob": logprob, "answer": answer,
                     "reference_tokens": int(ref.shape[1]), "prefill": prefill}
            if prefill == "quantized":
                entry["simulation"] = SIMULATION
            if spec is not None:
                entry["bits_per_element"] = cache_bits(cache, self.rates(spec)["table_bits"])
                entry["band"] = {"sink": spec.sink, "window": spec.window}
                if _calibrated(method):
                    entry["calib_tokens"] = self.calib_tokens
                    if self.calib_seed:
                        entry["calib_seed"] = self.calib_seed
            else:
                entry["bits_per_element"] = 32.0
            entry["seconds"], entry["finished"] = time.perf_counter() - t0, finished()
            entry["provenance"] = self.provenance(method)
            results[name] = entry
            if on_entry is not None:
                on_entry({**head, "prefills": prefills if len(results) == 1 else [], "results": {name: entry}})
        return {**head, "prefills": prefills, "results": results}

    # --- decode ---------------------------------------------------------------------------------
    def decode(self, name: str, prefix: int = 1024, new_tokens: int = 512, windows: int = 1) -> dict:
        """Long decode of ``new_tokens`` held-out tokens after a ``prefix``-token prefill (module docstring)."""
        import torch

        method, band, prefill = parse_entry(name)
        rows = []
        for ids in token_chunks(self.tok, part("heldout"), prefix + new_tokens, windows):
            t0 = time.perf_counter()
            with session("off"):
                ref = self.model(ids).logits[0, prefix - 1:-1].double()
            doc = ids[:, :prefix]
            fresh, ctx, spec, last = self._calls(method, band, prefill, self._prefill(doc), doc)
            cache = fresh()
            outs = [last]  # the prefill's last position predicts the first new token
            for t in range(prefix, prefix + new_tokens - 1):
                outs.append(self._step(ids[:, t:t + 1], cache, ctx)[-1])
            out = torch.stack(outs).double()
            row = {**window_stats(ref, out, ids[0, prefix:]), "seconds": time.perf_counter() - t0,
                   "finished": finished()}
            if spec is not None:
                row["bits_per_element"] = cache_bits(cache, self.rates(spec)["table_bits"])
            rows.append(row)
        out = {"entry": name, "method": method, "prefill": prefill, "simulation": SIMULATION, "prefix": prefix, "new_tokens": new_tokens,
               "windows": rows, "provenance": self.provenance(method)}
        if spec is not None:
            out["band"] = {"sink": spec.sink, "window": spec.window}
        return out


# --- the run loop (the grid itself: kvq_eval.grid) ------------------------------------------------


def _partial_key(ev: Evaluator, unit: dict) -> dict:
    method = parse_entry(unit["entry"])[0]
    return {"entry": unit["entry"], "tokens": unit["tokens"], "windows": unit["windows"], "simulation": SIMULATION,
            "calib_tokens": ev.calib_tokens if _calibrated(method) else None, "protocol": PROTOCOL,
            "text": ppl_text(unit["tokens"]), "artifacts": ev.provenance(method).get("artifacts")}


def _resume_rows(ev: Evaluator, unit: dict) -> list:
    """Finished windows of an interrupted perplexity cell made with the same settings, else none."""
    path = _partial_path(unit)
    try:
        stored = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        stored = None
    if not stored or stored.get("key") != _partial_key(ev, unit) or not isinstance(stored.get("rows"), list):
        return []
    return stored["rows"][:unit["windows"]]


def compute(ev: Evaluator, unit: dict, need: list[str], resumable: bool = False) -> dict:
    """The new content of one unit (not yet merged with what is stored). ``resumable``: a perplexity
    cell saves each finished window beside its file and starts after the windows saved there."""
    task = unit["task"]
    if task == "niah":
        v, c, d, s = unit["cell"]
        return ev.niah(need, v, c, d, s)
    method, band, _ = parse_entry(unit["entry"])
    if task == "ppl":
        if resumable:
            key = _partial_key(ev, unit)
            res = ev.ppl(method, band, unit["tokens"], unit["windows"], done=_resume_rows(ev, unit),
                         on_window=lambda rows: _write(_partial_path(unit), {"key": key, "rows": rows}))
        else:
            res = ev.ppl(method, band, unit["tokens"], unit["windows"])
    elif task == "layers":
        res = ev.layers(method, band, unit["tokens"])
    else:
        res = ev.decode(unit["entry"], unit["prefix"], unit["new_tokens"], unit["windows"])
    res["entry"] = unit["entry"]
    if _calibrated(method):
        res["calib_tokens"] = ev.calib_tokens
        if ev.calib_seed:
            res["calib_seed"] = ev.calib_seed
    return res


def _run_unit(model: str, ev: Evaluator, unit: dict, need: list[str]) -> None:
    """Compute one unit and store it (the serial path). A needle prompt stores each entry as it
    finishes (``Evaluator.niah``'s ``on_entry``), so that a run stopped within a prompt keeps the
    entries it finished; the stored cell is the one a single write would make (the same results and
    prefill record, ``wall_seconds`` the sum of the parts)."""
    last = time.perf_counter()

    def store(part: dict) -> None:
        nonlocal last
        now = time.perf_counter()
        _finish(model, unit, part, now - last)
        last = now

    if unit["task"] == "niah":
        v, c, d, s = unit["cell"]
        ev.niah(need, v, c, d, s, on_entry=store)
    else:
        store(compute(ev, unit, need, resumable=True))


def _finish(model: str, unit: dict, res: dict, seconds: float) -> None:
    with cell_lock(unit["path"]):  # another run may be merging other entries into this cell
        if unit["task"] == "niah":
            res = _merge_niah(unit["path"], res)
        res.update({"model": model, "task": unit["task"]})
        res["wall_seconds"] = res.get("wall_seconds", 0.0) + seconds
        res["finished"] = finished()
        if unit["task"] == "ppl":  # a resumed cell's windows carry their own seconds
            res["wall_seconds"] = max(res["wall_seconds"], sum(w.get("seconds", 0.0) for w in res["windows"]))
        _write(unit["path"], res)
    if unit["task"] == "ppl":
        _partial_path(unit).unlink(missing_ok=True)


_WORKER_EVALUATORS: dict = {}


def _worker_compute(model: str, calibrate: bool, calib_tokens: int, unit: dict, need: list[str], plans=(),
                    calib_seed: int = 0):
    """A Ray task: (result, seconds); the evaluator is built once per worker process. A perplexity
    cell resumes from (and saves) its finished windows like a serial run: on a shared folder an
    interrupted Ray run also continues where it stopped. ``plans``: the driver's registered plans
    (their files' JSON), registered here too, after the thread count is fixed: registering builds
    kvq_ref quantizers, and Numba's threading layer starting first would move torch to every core."""
    import torch

    from .models import share_threads
    from .planfile import plan_from_json, register_plan

    share_threads(torch)
    for obj in plans:
        register_plan(plan_from_json(obj))
    key = (model, calibrate, calib_tokens, calib_seed)
    if key not in _WORKER_EVALUATORS:
        _WORKER_EVALUATORS[key] = Evaluator(model, calibrate=calibrate, calib_tokens=calib_tokens, calib_seed=calib_seed)
    t0 = time.perf_counter()
    res = compute(_WORKER_EVALUATORS[key], unit, need, resumable=True)
    return res, time.perf_counter() - t0


def ray_map(fn, calls: list, on_result, address, num_gpus: float, show: bool, desc: str) -> None:
    """Run ``fn(*args)`` for every ``args`` in ``calls`` as Ray tasks (one CPU and ``num_gpus`` each)
    and call ``on_result(index, result)`` in the driver as each finishes, with a progress bar.

    ``address``: ``"local"`` (or None) starts a Ray instance on this machine, ``"auto"`` or an
    address joins a running cluster (``ValueError`` saying what to do when there is none). A Ray
    instance started here is shut down at the end. Shared by the grid (``run_grid``) and the
    planner's sensitivity cells (``kvq_eval.sensitivity``).
    """
    import ray
    from tqdm import tqdm

    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=None if address in (None, "local") else address, ignore_reinit_error=True,
                     log_to_driver=False)
        except ConnectionError as exc:
            raise ValueError(f"--ray {address}: no Ray cluster to join ({exc}); start one with 'ray start --head' "
                             f"or run on a local Ray instance with --ray local") from None
    try:
        task = ray.remote(num_gpus=num_gpus, num_cpus=1)(fn)
        pending = {task.remote(*args): i for i, args in enumerate(calls)}
        bar = tqdm(total=len(pending), desc=desc, unit="cell", disable=not show)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            on_result(pending.pop(done[0]), ray.get(done[0]))
            bar.update()
        bar.close()
    finally:
        if started:
            ray.shutdown()


def _run_ray(model, todo, calibrate, calib_tokens, address, num_gpus, show, summary, calib_seed=0):
    from .planfile import plan_json, registered_plans

    plans = [plan_json(p) for p, _ in registered_plans().values()]

    def finished(i, out):
        _finish(model, todo[i][0], *out)
        summary["ran"] += 1

    ray_map(_worker_compute, [(model, calibrate, calib_tokens, unit, need, plans, calib_seed) for unit, need in todo],
            finished,
            address, num_gpus, show, f"kvq-eval {model} (ray)")


def _reuse(model: str, todo: list, out, old, calib_tokens: int, calib_seed: int = 0) -> dict:
    """``reuse.reuse_cells`` with this machine's windows and calibration digests."""
    from .calib import stored_digests, token_chunks
    from .models import load_tokenizer
    from .reuse import reuse_cells
    from .text import part

    tok = load_tokenizer(model)

    def window_ids(tokens, count):
        text = ppl_text(tokens)
        return [ids_sha256(x) for x in token_chunks(tok, part(text), tokens, count, spread=text == "short")]

    def digests(method):
        return stored_digests(model, calib_tokens, official=method.split(":")[0] == "nova_official", seed=calib_seed)

    def artifacts(method):  # what Evaluator.provenance(method) holds, for _partial_key
        d = digests(method) if _calibrated(method) else None
        return {"artifacts": d} if d else {}

    keyed = SimpleNamespace(calib_tokens=calib_tokens, provenance=artifacts)
    return reuse_cells(todo, out, old, window_ids, digests, lambda unit: _partial_key(keyed, unit))


def run_grid(model: str, methods, out, contexts=(1024,), tasks=("ppl", "niah"), variants=VARIANTS,
             depths=(0.25, 0.5, 0.75), samples: int = 10, bands=("none",), prefill=("exact",),
             ppl_windows=((1024, 8),), decode=(1024, 512, 1), calib_tokens: int = 1024, calib_seed: int = 0,
             progress: bool | None = None, ray: str | None = None, num_gpus: float = 0.0,
             summary: dict | None = None, reuse=None, reuse_only: bool = False) -> dict:
    """Run every missing cell of the grid and return a summary of what was run.

    Parameters
    ----------
    model : str
    methods : sequence of str
        Method names (``methods.METHODS``, ``<method>:keys``/``:values``); "fp32" is always added.
    out : path
        Results folder; cells already present are skipped (resumable).
    bands : sequence of str or Band
        Each a run setting applied to every method: ``"none"``, ``"S,W"``, or ``"own"`` (the
        method's built-in band).
    prefill : sequence of {"exact", "quantized"}
        Needle and decode prefill modes.
    ppl_windows : sequence of (tokens, count)
    decode : (prefix tokens, new tokens, windows)
    calib_tokens : int
        Calibration sequence length, recorded with every calibrated entry.
    calib_seed : int
        The calibration's k-means seed, recorded (as ``calib_seed``) with every calibrated entry
        when not 0; an entry of another seed counts as missing.
    ray : str, optional
        ``"auto"``/an address: run the cells as Ray tasks on that cluster; ``"local"``: start a
        local Ray instance. The driver writes the same per-cell JSON as a serial run.
    num_gpus : float
        GPUs each Ray task asks for.
    summary : dict, optional
        Filled in place as cells finish (``cells``, ``done_before``, ``ran``), so a caller that
        is interrupted still knows what was written.
    reuse : path, optional
        An older results folder: what it holds of the missing cells on the same inputs is copied
        first (``kvq_eval.reuse``; ``summary["reused"]`` counts it), the rest is computed.
    reuse_only : bool
        Copy what ``reuse`` holds and compute nothing (``summary["left"]``: the cells still missing).
    """
    import sys

    from tqdm import tqdm

    _check_calib_tokens(calib_tokens)
    _check_calib_seed(calib_seed)
    if reuse_only and reuse is None:
        raise ValueError("--reuse-only needs a folder to reuse (--reuse OLD)")
    units = plan(model, methods, out, contexts, tasks, variants, depths, samples, bands, prefill,
                 ppl_windows, decode)
    todo = [(u, need) for u in units if (need := _missing(u, calib_tokens, calib_seed))]
    summary = {} if summary is None else summary
    summary.update(cells=len(units), done_before=len(units) - len(todo), ran=0)
    if reuse is not None and todo:
        summary["reused"] = _reuse(model, todo, out, reuse, calib_tokens, calib_seed)
        todo = [(u, need) for u in units if (need := _missing(u, calib_tokens, calib_seed))]
        summary["done_before"] = len(units) - len(todo)
    if reuse_only:
        summary["left"] = len(todo)
        return summary
    if not todo:
        return summary
    calibrated = {parse_entry(e)[0] for _, need in todo for e in need} & {
        m for m in methods if m != "fp32" and _calibrated(m)}
    longest = max([u["cell"][1] for u, _ in todo if u["task"] == "niah"] +
                  [u.get("tokens", 0) for u, _ in todo] + [0])
    if calibrated and longest > calib_tokens:
        warnings.warn(f"calib_tokens={calib_tokens} is shorter than the context {longest}: "
                      f"{', '.join(sorted(calibrated))} will meet keys at positions they were not "
                      f"calibrated on (see benchmarks/nova_position.py)", stacklevel=2)
    show = sys.stderr.isatty() if progress is None else progress
    if ray is not None:
        _run_ray(model, todo, bool(calibrated), calib_tokens, ray, num_gpus, show, summary, calib_seed)
    else:
        ev = Evaluator(model, calibrate=bool(calibrated), calib_tokens=calib_tokens, calib_seed=calib_seed)
        for unit, need in tqdm(todo, desc=f"kvq-eval {model}", unit="cell", disable=not show, file=sys.stderr):
            _run_unit(model, ev, unit, need)
            summary["ran"] += 1
    return summary
