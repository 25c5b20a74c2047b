"""The plan search: measure, model, allocate, validate on held-out windows, correct, write the plan.

``search(SearchConfig(...))`` finds the cheapest per-(layer, role) plan (``kvq_eval.planfile``) that
meets a perplexity target at a context length:

1. **Sensitivity** (``kvq_eval.sensitivity`` layer cells): for every layer, role and candidate, the
   KL divergence from fp32 and the NLL change per token with only that item quantized, on
   ``calib_windows`` consecutive windows of the ``calibration`` text (the text NOVA-KV/OSCAR
   calibrate on, disjoint from every evaluation text), with the plan's band.
2. **Model and allocation** (``kvq_eval.plan``): additive model over items (window means, clipped at
   0; optionally TurboQuantMSE widths above ``extrapolate_above`` bits predicted by the exact
   distortion ratio), least stored bits subject to the predicted loss ``<= budget`` by the exact
   dynamic program. The items are KL per token by default (``metric="kl"``): the expected NLL
   change of a calibrated model, never negative, and far less noisy than one window's NLL change,
   which on SmolLM2's layer 0 measured -3.2e-4 nats at 4 bits between +1.1e-3 at 3 and +4e-5 at 5
   (one quantization realization moves which tokens lose). The target stays the NLL change:
   validation measures it, and the correction absorbs the KL-to-NLL scale.
3. **Validation**: the allocated plan is simulated whole on ``valid_windows`` 8K windows spread over
   the ``long_haystack`` text (joint cells; never calibration text, never the ``heldout`` text of
   the final perplexity evaluation, read elsewhere only as needle filler), and its quality is the
   Student t interval over those windows (``stats.t_interval``).
4. **Correction**: the first budget is the target itself, ``log(1 + target)`` nats per token. While
   the validated upper bound ``U`` misses the target ``tau``, or undershoots it by more than
   ``slack`` (a dearer-than-needed plan), the next budget is ``budget * tau / U`` (clamped to a
   factor 4 either way): the budget the model would need if the validated upper bound scaled with
   it; once one budget met the target and another missed it, a step outside that bracket is
   replaced by the bracket's geometric mean (``_next_budget``). The search stops when a budget
   gives a plan already validated. At most ``rounds`` validations; the plan is the cheapest
   validated one whose upper bound meets the target (if none does, the one with the lowest upper
   bound, marked as missing it).
5. **Model check** (``check_model``): the chosen plan is also simulated whole on the calibration
   windows, where the additive model's prediction is exactly the sum of the measured items, so the
   difference is the model's error alone (the validation mixes it with the change of text).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass

import numpy as np

from .models import slug
from .plan import allocate, extrapolate_tq, model_losses
from .planfile import Plan, candidate_make, check_candidate, stored_bits
from .sensitivity import ROLES, joint_units, layer_units, read_cell, run_cells

__all__ = ["SearchConfig", "search", "sensitivity_table", "parse_candidates", "default_name", "TQ_ALL"]

TQ_ALL = tuple(f"tq_mse{b}" for b in range(1, 9))
_FIELD = {"kl": "kl_per_token", "dnll": "dnll"}  # SearchConfig.metric -> the cells' per-token field
_TQ = re.compile(r"tq_mse([1-8])")


def parse_candidates(text: str) -> tuple[str, ...]:
    """``"tq_mse2-6"`` (a TurboQuantMSE bit range) and/or comma-separated candidate names."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        m = re.fullmatch(r"tq_mse([1-8])-([1-8])", item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"candidates: empty bit range {item!r}")
            out += [f"tq_mse{b}" for b in range(lo, hi + 1)]
        elif item:
            out.append(item)
    if not out:
        raise ValueError(f"candidates: no candidate in {text!r}")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class SearchConfig:
    """What ``search`` looks for and how much it measures.

    Attributes
    ----------
    model : str
    target : float
        Fractional perplexity increase at ``context`` tokens (0.01 = 1 %), upper end of the
        validated t interval.
    candidates : tuple of str
        Per-(layer, role) choices (``planfile.check_candidate``).
    band : (int, int)
        Global float16 band (sink, recent window).
    context : int
        Window length of calibration and validation (the plan's context).
    calib_windows, valid_windows : int
        Calibration windows (consecutive from the start of ``calibration``) and validation windows
        (spread over ``long_haystack``; at least 2 for an interval).
    stride : int
        Score every ``stride``-th position (``kvq_eval.sensitivity``).
    rounds : int
        Most validations (module Notes, step 4).
    slack : float
        A validated upper bound within ``[tau (1 - slack), tau]`` ends the correction.
    extrapolate_above : int or None
        TurboQuantMSE candidates above this many bits are not measured but predicted from the
        highest measured width by the distortion ratio (``plan.extrapolate_tq``).
    check_model : bool
        Simulate the chosen plan on the calibration windows too (module Notes, step 5).
    metric : {"kl", "dnll"}
        The items of the additive model: KL(fp32 || quant) per token (default) or the NLL change
        per token (module Notes, step 2).
    name : str or None
        The plan's name (default ``default_name``).
    """

    model: str = "smollm2"
    target: float = 0.01
    candidates: tuple = TQ_ALL[1:]
    band: tuple = (0, 64)
    context: int = 8192
    calib_windows: int = 3
    valid_windows: int = 4
    stride: int = 1
    rounds: int = 4
    slack: float = 0.15
    extrapolate_above: int | None = None
    check_model: bool = True
    metric: str = "kl"
    name: str | None = None

    def __post_init__(self):
        from .models import canonical_model, model_info

        object.__setattr__(self, "model", canonical_model(self.model))  # raises for an unknown model
        model_info(self.model)
        t = self.target
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"target must be a fractional perplexity increase in (0, 1], got {t!r}")
        cands = tuple(self.candidates) if isinstance(self.candidates, (list, tuple)) else ()
        if not cands:
            raise ValueError("candidates must name at least one candidate")
        for c in cands:
            check_candidate(c, model_info(self.model).head_dim)
        object.__setattr__(self, "candidates", tuple(dict.fromkeys(cands)))
        band = tuple(self.band) if isinstance(self.band, (list, tuple)) else ()
        if len(band) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in band):
            raise ValueError(f"band must be two non-negative integers (sink, window), got {self.band!r}")
        object.__setattr__(self, "band", band)
        for name, lo in (("context", 16), ("calib_windows", 1), ("valid_windows", 2), ("stride", 1), ("rounds", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.stride >= self.context:
            raise ValueError(f"stride must be below context ({self.context}), got {self.stride}")
        if isinstance(self.slack, bool) or not isinstance(self.slack, (int, float)) or not 0 <= self.slack < 1:
            raise ValueError(f"slack must be a number in [0, 1), got {self.slack!r}")
        if self.metric not in ("kl", "dnll"):
            raise ValueError(f"metric must be 'kl' or 'dnll', got {self.metric!r}")
        e = self.extrapolate_above
        if e is not None:
            if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= 7:
                raise ValueError(f"extrapolate_above must be an integer in 1..7 or None, got {e!r}")
            if f"tq_mse{e}" not in self.candidates:
                raise ValueError(f"extrapolate_above={e}: tq_mse{e} must be a (measured) candidate")

    @property
    def measured(self) -> tuple[str, ...]:
        """The candidates measured (the others are extrapolated)."""
        e = self.extrapolate_above
        return tuple(c for c in self.candidates if e is None or not (_TQ.fullmatch(c) and int(c[6:]) > e))


def default_name(cfg: SearchConfig) -> str:
    """``<model>-<band>-t<target %>``, e.g. ``smollm2-0-64-t1``."""
    band = "none" if cfg.band == (0, 0) else f"{cfg.band[0]}-{cfg.band[1]}"
    return f"{slug(cfg.model)}-{band}-t{100 * cfg.target:g}"


def sensitivity_table(cfg: SearchConfig, units: list[dict]) -> dict:
    """The measured items (``"raw"``, (layers, 2, candidates, windows); NaN where extrapolated) and the
    model's losses (``"model"``, (layers, 2, candidates)) from the stored layer cells."""
    from .models import model_info

    info = model_info(cfg.model)
    cands = list(cfg.candidates)
    raw = np.full((info.layers, 2, len(cands), cfg.calib_windows), np.nan)
    for u in units:
        cell = read_cell(u)
        if cell is None:
            raise ValueError(f"{u['path']}: sensitivity cell missing (run the search to compute it)")
        raw[u["layer"], ROLES.index(u["role"]), cands.index(u["candidate"]), u["window"]["index"]] = cell[_FIELD[cfg.metric]]
    mean = raw.mean(axis=-1)
    model = np.where(np.isnan(mean), 0.0, mean)
    if cfg.extrapolate_above is not None:
        tq = {int(c[6:]): i for i, c in enumerate(cands) if _TQ.fullmatch(c)}
        measured = {b: i for b, i in tq.items() if b <= cfg.extrapolate_above}
        for layer in range(info.layers):
            for r in range(2):
                got = extrapolate_tq({b: mean[layer, r, i] for b, i in measured.items()}, sorted(tq), info.head_dim)
                for b, i in tq.items():
                    model[layer, r, i] = got[b]
    return {"raw": raw, "model": model_losses(model)}


def _rates(cfg: SearchConfig) -> np.ndarray:
    """(2, candidates) stored bits per element of each candidate for keys and values."""
    from .accounting import method_rate
    from .models import model_info

    d = model_info(cfg.model).head_dim
    return np.array([[method_rate(candidate_make(c)(0, 0, role, d, None), d) for c in cfg.candidates] for role in ROLES])


def _allocate(cfg, losses, rates, budget):
    items = [(layer, r) for layer in range(losses.shape[0]) for r in range(2)]
    alloc = allocate([rates[r] for _, r in items], [losses[layer, r] for layer, r in items], budget)
    layers = [[None, None] for _ in range(losses.shape[0])]
    for (layer, r), j in zip(items, alloc.choice):
        layers[layer][r] = cfg.candidates[j]
    return alloc, tuple(tuple(p) for p in layers)


def _interval(values) -> dict:
    from .stats import t_interval

    v = np.asarray(values, dtype=np.float64)
    lo, hi = t_interval(v)
    pct = lambda x: 100.0 * math.expm1(x)  # noqa: E731
    return {"windows": [float(x) for x in v], "mean": float(v.mean()), "ci": [float(lo), float(hi)],
            "dppl": pct(float(v.mean())), "dppl_ci": [pct(lo), pct(hi)]}


def _joint(cfg, work, layers, text, count, spread, ray, evaluator):
    """The joint cells of a table on ``count`` windows: (cells, token-id digests, summed seconds)."""
    units = joint_units(cfg.model, work, cfg.band, layers, cfg.context, count, cfg.stride, text=text, spread=spread)
    run_cells(units, ray=ray, evaluator=evaluator)
    cells = [read_cell(u) for u in units]
    return cells, [u["window"]["ids_sha256"] for u in units], sum(c["seconds"] for c in cells)


def _next_budget(rounds: list[dict], tau: float) -> float:
    """The correction's next budget (module Notes, step 4): the last budget times ``tau / U`` (a factor
    4 at most either way), kept strictly inside the bracket of the budgets already validated (the
    largest that met the target, the smallest that missed it) by their geometric mean otherwise."""
    last = rounds[-1]
    upper = last["validation"]["ci"][1]
    step = min(4.0, max(0.25, tau / upper)) if upper > 0 else 4.0
    budget = last["budget_nats"] * step
    met = [r["budget_nats"] for r in rounds if r["meets_target"]]
    missed = [r["budget_nats"] for r in rounds if not r["meets_target"]]
    lo, hi = (max(met) if met else 0.0), (min(missed) if missed else math.inf)
    if lo < hi and not lo < budget < hi and lo > 0 and hi < math.inf:
        budget = math.sqrt(lo * hi)
    return budget


def search(cfg: SearchConfig, work, ray: str | None = None, progress: bool | None = None, log=print) -> Plan:
    """Find, validate and return the plan (module Notes); cells go under ``work`` (resumable).

    Parameters
    ----------
    cfg : SearchConfig
    work : path
        Folder of the sensitivity and joint cells (shared by searches of one model and band).
    ray : str, optional
        Run the cells as Ray tasks (``local``, ``auto`` or an address).
    log : callable
        Receives one line per step.
    """
    from .models import model_info
    from .provenance import environment

    t0 = time.perf_counter()
    evaluator = None
    if ray is None:
        from .sensitivity import _evaluator

        evaluator = _evaluator(cfg.model)
    units = layer_units(cfg.model, work, cfg.band, cfg.measured, cfg.context, cfg.calib_windows, cfg.stride)
    summary = run_cells(units, ray=ray, progress=progress, evaluator=evaluator)
    cell_seconds = sum(read_cell(u)["seconds"] for u in units)
    log(f"sensitivity: {summary['cells']} cells ({summary['ran']} run now, {summary['done_before']} stored), "
        f"{cell_seconds:.0f} s of cell time")
    table = sensitivity_table(cfg, units)
    losses, rates = table["model"], _rates(cfg)
    tau = math.log1p(cfg.target)
    budget, rounds, seen = tau, [], {}
    for k in range(cfg.rounds):
        alloc, layers = _allocate(cfg, losses, rates, budget)
        if layers in seen:
            log(f"round {k}: budget {budget:.5f} gives the plan of round {seen[layers]} again; stopping")
            break
        cells, val_ids, seconds = _joint(cfg, work, layers, "long_haystack", cfg.valid_windows, True, ray, evaluator)
        q = _interval([c["dnll"] for c in cells])
        q["kl_windows"] = [c["kl_per_token"] for c in cells]
        bits = stored_bits(Plan("probe", cfg.model, layers, *cfg.band, cfg.context, cfg.target))
        rnd = {"round": k, "budget_nats": budget, "allocator": alloc.method, "feasible": alloc.feasible,
               "predicted_nats": alloc.loss, "predicted_dppl": 100.0 * math.expm1(alloc.loss),
               "bits_per_element": bits["bits_per_element"], "rate": bits["rate"], "validation": q,
               "meets_target": q["ci"][1] <= tau, "layers": [list(p) for p in layers], "seconds": seconds}
        rounds.append(rnd)
        seen[layers] = k
        log(f"round {k}: budget {budget:.5f} nats -> {bits['bits_per_element']:.3f} bits, predicted "
            f"{rnd['predicted_dppl']:+.3f} %{'' if alloc.feasible else ' (the least the candidates reach)'}, "
            f"validated {q['dppl']:+.3f} % [{q['dppl_ci'][0]:+.3f}, {q['dppl_ci'][1]:+.3f}]")
        if tau * (1 - cfg.slack) <= q["ci"][1] <= tau:
            break
        budget = _next_budget(rounds, tau)
    ok = [r for r in rounds if r["meets_target"]]
    chosen = min(ok, key=lambda r: (r["bits_per_element"], r["validation"]["ci"][1])) if ok else \
        min(rounds, key=lambda r: r["validation"]["ci"][1])
    layers = tuple(tuple(p) for p in chosen["layers"])
    info = model_info(cfg.model)
    record = {
        "search": {**asdict(cfg), "band": list(cfg.band), "candidates": list(cfg.candidates),
                   "measured": list(cfg.measured)},
        "rates": {c: {"key": float(rates[0, i]), "value": float(rates[1, i])} for i, c in enumerate(cfg.candidates)},
        "calibration": {"text": "calibration", "tokens": cfg.context, "stride": cfg.stride,
                        "windows": list(dict.fromkeys(u["window"]["ids_sha256"] for u in units)),
                        "cells": len(units), "cell_seconds": cell_seconds},
        "sensitivity": {"candidates": list(cfg.candidates), "metric": cfg.metric,
                        "unit": {"kl": "KL(fp32 || quant) per token (nats)", "dnll": "NLL change per token (nats)"}[cfg.metric],
                        "measured": {role: [[None if np.isnan(x) else float(x) for x in table["raw"][layer, r].mean(-1)]
                                            for layer in range(info.layers)] for r, role in enumerate(ROLES)},
                        "model": {role: [[float(x) for x in losses[layer, r]] for layer in range(info.layers)]
                                  for r, role in enumerate(ROLES)}},
        "model": {"kind": "additive", "metric": cfg.metric, "clip_below": 0.0, "extrapolate_above": cfg.extrapolate_above,
                  "allocator": chosen["allocator"], "budget_nats": chosen["budget_nats"],
                  "predicted_nats": chosen["predicted_nats"], "predicted_dppl": chosen["predicted_dppl"]},
        "validation": {"text": "long_haystack", "tokens": cfg.context, "spread": True, "stride": cfg.stride,
                       "windows": val_ids, "rounds": rounds, "chosen": chosen["round"]},
        "quality": {"text": "long_haystack", "windows": cfg.valid_windows, "dppl": chosen["validation"]["dppl"],
                    "ci": chosen["validation"]["dppl_ci"], "target_dppl": 100.0 * cfg.target,
                    "meets_target": chosen["meets_target"]},
    }
    if cfg.check_model:
        cells, _, _ = _joint(cfg, work, layers, "calibration", cfg.calib_windows, False, ray, evaluator)
        measured = [c[_FIELD[cfg.metric]] for c in cells]
        choice = [[cfg.candidates.index(c) for c in p] for p in layers]
        raw = table["raw"]
        item = lambda layer, r, w: raw[layer, r, choice[layer][r], w] if not np.isnan(  # noqa: E731
            raw[layer, r, choice[layer][r], w]) else losses[layer, r, choice[layer][r]]
        per_window = [float(sum(item(layer, r, w) for layer in range(info.layers) for r in range(2)))
                      for w in range(cfg.calib_windows)]
        record["model_check"] = {
            "text": "calibration", "metric": cfg.metric, "predicted_windows": per_window,
            "measured_windows": [float(x) for x in measured], "dnll_windows": [c["dnll"] for c in cells],
            "predicted_model": chosen["predicted_nats"], "measured_mean": float(np.mean(measured)),
            "ratio": float(np.mean(measured) / chosen["predicted_nats"]) if chosen["predicted_nats"] > 0 else None,
            "note": "predicted_windows: the sum of the plan's measured (unclipped) items on each window, "
                    "extrapolated items at their model value; measured_windows: the whole plan simulated, in "
                    "the model's metric; dnll_windows: its NLL change per token"}
        log(f"model check (calibration windows, {cfg.metric}): predicted {chosen['predicted_nats']:.5f}, measured "
            f"{np.mean(measured):.5f} nats per token (NLL change {np.mean([c['dnll'] for c in cells]):.5f})")
    record["provenance"] = environment()
    record["wall_seconds"] = time.perf_counter() - t0
    return Plan(cfg.name or default_name(cfg), cfg.model, layers, *cfg.band, cfg.context, cfg.target, record)

