"""The planner's study: per-layer plans at several targets against the cheapest uniform settings.

``run_study`` (``kvq-plan study``), for one model and each target:

1. searches the plan (``kvq_eval.planner``; the sensitivity cells are shared by every target, and a
   plan file already written by an identical search is read back, so the study resumes);
2. evaluates it like any method (``kvq_eval.runner.run_grid`` with the plan registered): perplexity on
   the held-out windows of ``context`` tokens (``eval_windows`` consecutive windows from the start of
   ``heldout``, protocol v3) and, unless ``needles=0``, the needle test at ``needle_contexts`` (the
   single-needle variant, depths 0.1..0.9, ``needles / 5`` samples per depth), where the uniform
   baseline is run on the same samples (the entries the baseline folder already holds for them,
   fp32's included, are copied: ``kvq-eval run --reuse``; a calibrated baseline runs on the
   calibration length its perplexity cells record);
3. finds the cheapest uniform setting meeting the same target among the baseline folder's
   perplexity cells of ``context`` tokens (``kvq-eval`` results: the upper end of the window t
   interval at most the target), read after the searches, and records the baseline's entries that
   have no such cell yet (``baseline_missing``: a comparison against an incomplete grid says so); it
   compares: a paired test over the windows both hold (same
   text, same token ids where recorded; ``plot.paired_ppl``), McNemar's test and the paired
   log-probability test on the needle samples (``plot.paired_comparison``);
4. records where the bits went (keys and values per layer).

Everything lands in ``<out>/<model>/study.json`` (written whole; the cells it reads are under
``<out>/<model>/``); ``plot_study`` draws the chart and ``study_table`` the README's table from that
JSON alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .models import slug

__all__ = ["run_study", "uniform_settings", "baseline_gaps", "plot_study", "study_table", "NEEDLE_DEPTHS"]

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def uniform_settings(baseline, model: str, tokens: int) -> list[dict]:
    """Every perplexity entry of a ``kvq-eval`` results folder at ``tokens`` tokens with an interval:
    ``{"entry", "bits", "dppl", "ci", "windows"}``, by stored bits (plans excluded)."""
    from .plot import load_results, ppl_summary

    res = load_results(baseline, model)
    out = []
    for entry, by_t in ppl_summary(res).items():
        row = by_t.get(tokens)
        if row is None or row["ci"] is None or entry.startswith("plan:"):
            continue
        out.append({"entry": entry, "bits": row["bits"], "dppl": row["dppl"], "ci": list(row["ci"]),
                    "windows": row["windows"]})
    return sorted(out, key=lambda r: (r["bits"], r["entry"]))


def baseline_gaps(baseline, model: str, tokens: int) -> list[str]:
    """Entries of a ``kvq-eval`` results folder with a perplexity cell at some context but none (with an
    interval) at ``tokens``: the uniform settings the comparison cannot see yet, by name (plans
    excluded). Empty when the baseline's grid is complete at ``tokens``."""
    from .plot import load_results, ppl_summary

    summ = ppl_summary(load_results(baseline, model))
    return sorted(e for e, by_t in summ.items()
                  if not e.startswith("plan:") and (by_t.get(tokens) is None or by_t[tokens]["ci"] is None))


def _cheapest(uniform: list[dict], target_pct: float) -> dict | None:
    ok = [u for u in uniform if u["ci"][1] <= target_pct]
    return min(ok, key=lambda u: (u["bits"], u["ci"][1])) if ok else None


def _baseline_calib(base_res: dict, entries, tokens: int, where) -> int:
    """The calibration length the baseline ``entries``' perplexity cells at ``tokens`` record (their
    needles run on the same calibration), or 1024 (``kvq-eval run``'s default) when none is
    calibrated; ``ValueError`` when they record different lengths."""
    calib = {base_res["ppl"][e][tokens].get("calib_tokens") for e in entries} - {None}
    if len(calib) > 1:
        raise ValueError(f"{where}: the uniform baselines were calibrated on {sorted(calib)} tokens; "
                         f"their needles need one calibration")
    return calib.pop() if calib else 1024


def _search_record(cfg) -> dict:
    return {**asdict(cfg), "band": list(cfg.band), "candidates": list(cfg.candidates), "measured": list(cfg.measured)}


def _plan(cfg, out: Path, ray, progress, log):
    """The plan of ``cfg``: read back when an identical search wrote it, else searched and written."""
    from .planfile import load_plan, save_plan
    from .planner import default_name, search

    path = out / slug(cfg.model) / "plans" / f"{cfg.name or default_name(cfg)}.json"
    if path.is_file():
        plan = load_plan(path, model=cfg.model)
        if plan.record.get("search") == _search_record(cfg):
            log(f"{path}: the plan of this search, read back")
            return plan, path
    plan = search(cfg, out, ray=ray, progress=progress, log=log)
    save_plan(plan, path)
    return plan, path


def _paired(plan_row: dict, base_row: dict, a: str, b: str, tokens: int) -> dict | None:
    """Paired window test of the plan's and the uniform setting's cells, or None (with the reason)
    when they do not hold the same windows."""
    from .plot import paired_ppl

    if plan_row.get("text") != base_row.get("text"):
        return {"error": f"different texts ({plan_row.get('text')} vs {base_row.get('text')})"}
    wa, wb = plan_row["windows"], base_row["windows"]
    n = min(len(wa), len(wb))
    ids_a, ids_b = [w.get("ids_sha256") for w in wa[:n]], [w.get("ids_sha256") for w in wb[:n]]
    if any(x is not None and y is not None and x != y for x, y in zip(ids_a, ids_b)):
        return {"error": "the windows' token ids differ"}
    res = {"ppl": {a: {tokens: {"windows": wa[:n]}}, b: {tokens: {"windows": wb[:n]}}}}
    try:
        out = paired_ppl(res, a, b)[tokens]
    except ValueError as exc:
        return {"error": str(exc)}
    out["ids_checked"] = all(x is not None and y is not None for x, y in zip(ids_a, ids_b))
    return out


def run_study(configs, out, baseline, ray: str | None = None, needles: int = 30, needle_contexts=(4096, 8192),
              eval_windows: int = 7, progress: bool | None = None, log=print) -> Path:
    """Run (or resume) the study of ``configs`` (``planner.SearchConfig``, one per target, one model and
    context) and write ``<out>/<model>/study.json`` (module docstring); returns its path."""
    from .grid import _write, parse_entry
    from .plot import load_results, niah_summary, paired_comparison, ppl_summary
    from .planfile import register_plan, stored_bits
    from .runner import run_grid

    configs = list(configs)
    if not configs or len({(c.model, c.context) for c in configs}) != 1:
        raise ValueError("a study needs at least one search config, all of one model and context")
    if isinstance(needles, bool) or not isinstance(needles, int) or needles < 0 or needles % len(NEEDLE_DEPTHS):
        raise ValueError(f"needles must be a non-negative multiple of {len(NEEDLE_DEPTHS)}, got {needles!r}")
    model, tokens = configs[0].model, configs[0].context
    out, root = Path(out), Path(out) / slug(configs[0].model)
    plans = []
    for cfg in configs:
        plan, path = _plan(cfg, out, ray, progress, log)
        register_plan(plan)
        plans.append((cfg, plan, path))
    eval_dir = root.parent / "eval"
    run_grid(model, [p.method for _, p, _ in plans], eval_dir, tasks=("ppl",), ppl_windows=((tokens, eval_windows),),
             ray=ray, progress=progress)
    # the baseline as it is now, after the searches (hours, while its grid may still be filling)
    uniform = uniform_settings(baseline, model, tokens)
    gaps = baseline_gaps(baseline, model, tokens)
    if gaps:
        log(f"{model}: {len(gaps)} entries of {baseline} have no {tokens}-token perplexity cell yet "
            f"({', '.join(gaps[:6])}{', ...' if len(gaps) > 6 else ''}); the cheapest uniform setting is the "
            f"cheapest among the {len(uniform)} that have one (study.json: baseline_missing)")
    base_of = {cfg.target: _cheapest(uniform, 100 * cfg.target) for cfg in configs}
    base_res = load_results(baseline, model)
    if needles:
        calib_tokens = _baseline_calib(base_res, [u["entry"] for u in base_of.values() if u], tokens, baseline)
        groups: dict = {}
        for b in {u["entry"] for u in base_of.values() if u}:
            method, band, _ = parse_entry(b)
            groups.setdefault(band.label, []).append(method)
        for i, band in enumerate(sorted(groups) or ["none"]):
            methods = groups.get(band, []) + ([p.method for _, p, _ in plans] if i == 0 else [])
            # the baseline's needle entries (and fp32's) on the same prompts are copied, not recomputed
            run_grid(model, methods, eval_dir, contexts=tuple(needle_contexts), tasks=("niah",), variants=("single",),
                     depths=NEEDLE_DEPTHS, samples=needles // len(NEEDLE_DEPTHS), bands=(band,), ray=ray,
                     progress=progress, reuse=baseline, calib_tokens=calib_tokens)
    res = load_results(eval_dir, model)
    summ = ppl_summary(res)
    niah = niah_summary(res["niah"])
    rows = []
    for cfg, plan, path in plans:
        bits = stored_bits(plan)
        base = base_of[cfg.target]
        row = {"target_pct": 100 * cfg.target, "plan": {
            "name": plan.name, "entry": plan.entry, "file": str(path), "bits": bits["bits_per_element"],
            "key_rate": bits["key_rate"], "value_rate": bits["value_rate"],
            "key_bits": plan.bits("key"), "value_bits": plan.bits("value"), "layers": [list(p) for p in plan.layers],
            "validated": plan.record["quality"], "rounds": len(plan.record["validation"]["rounds"]),
            "model_check": plan.record.get("model_check"), "search_seconds": plan.record.get("wall_seconds")}}
        held = summ.get(plan.entry, {}).get(tokens)
        row["plan"]["heldout"] = None if held is None else {k: held[k] for k in ("dppl", "ci", "windows", "kl", "top1")}
        row["plan"]["heldout_meets_target"] = None if held is None else held["ci"][1] <= 100 * cfg.target
        row["uniform"] = base
        if base is not None:
            row["uniform_bits_saved"] = base["bits"] - bits["bits_per_element"]
            row["paired"] = _paired(res["ppl"][plan.entry][tokens], base_res["ppl"][base["entry"]][tokens],
                                    plan.entry, base["entry"], tokens) if held is not None else None
            try:
                row["needles_paired"] = {str(c): v for c, v in paired_comparison(res["niah"], plan.entry,
                                                                                 base["entry"]).items()}
            except ValueError as exc:
                row["needles_paired"] = {"error": str(exc)}
        row["needles"] = {e: {str(c): r for c, r in niah.get(e, {}).items()}
                          for e in ([plan.entry] + ([base["entry"]] if base else []))}
        rows.append(row)
    study = {"model": model, "context": tokens, "baseline": str(baseline), "eval": str(eval_dir),
             "eval_windows": eval_windows, "needles": needles, "needle_contexts": list(needle_contexts),
             "uniform": uniform, "baseline_missing": gaps, "targets": rows}
    path = root / "study.json"
    _write(path, json.loads(json.dumps(study, default=_jsonable)))
    return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"{type(x).__name__} is not JSON")


def plot_study(study_path, prefix) -> list[Path]:
    """The study's chart from its JSON: per target, the stored bits of keys and values per layer, and
    the held-out perplexity change against stored bits of the plans and the uniform settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = json.loads(Path(study_path).read_text())
    rows = study["targets"]
    if not rows:
        raise ValueError(f"{study_path}: no target in the study")
    fig, axes = plt.subplots(1, len(rows) + 1, figsize=(4.2 * (len(rows) + 1), 3.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        kb, vb = row["plan"]["key_bits"], row["plan"]["value_bits"]
        x = np.arange(len(kb))
        ax.bar(x - 0.2, [b if b is not None else np.nan for b in kb], 0.4, label="keys", color="tab:blue")
        ax.bar(x + 0.2, [b if b is not None else np.nan for b in vb], 0.4, label="values", color="tab:orange")
        ax.set_xlabel("layer")
        ax.set_ylabel("TurboQuantMSE bits")
        ax.set_title(f"target {row['target_pct']:g} %: {row['plan']['bits']:.2f} stored bits", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    uni = study["uniform"]
    if uni:
        ub = np.array([u["bits"] for u in uni])
        ud = np.array([u["dppl"] for u in uni])
        err = np.array([[u["dppl"] - u["ci"][0] for u in uni], [u["ci"][1] - u["dppl"] for u in uni]])
        ax.errorbar(ub, ud, yerr=err, fmt="o", color="0.6", ms=3, lw=0.8, label="uniform settings")
    for row in rows:
        h = row["plan"].get("heldout")
        if h:
            ax.errorbar([row["plan"]["bits"]], [h["dppl"]], yerr=[[h["dppl"] - h["ci"][0]], [h["ci"][1] - h["dppl"]]],
                        fmt="s", ms=5, label=f"plan, target {row['target_pct']:g} %")
        ax.axhline(row["target_pct"], color="0.8", lw=0.6, ls="--")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("stored bits per element")
    ax.set_ylabel(f"perplexity change at {study['context']} tokens (%), 95% t-CI")
    ax.set_title(f"{study['model']}: held-out windows", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(f"{prefix}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [out]


def _pct_ci(dppl: float, ci) -> str:
    return f"{dppl:+.2f}% [{ci[0]:+.2f}, {ci[1]:+.2f}]"


def study_table(study: dict) -> str:
    """The study (``run_study``'s JSON) as a Markdown table, one row per target: the plan's stored
    bits and held-out perplexity change (t interval over windows), the cheapest uniform setting
    meeting the same target with its bits, how many uniform settings it was chosen from (and how many
    of the baseline's entries had no cell at the study's context yet: a pick from an incomplete grid
    says so), the bits the plan saves, the paired window test of plan against uniform (perplexity
    ratio, 95 % t interval, the windows both hold), and single-needle exact match of both per needle
    context. ``KeyError``/``TypeError`` on a JSON that is not a study
    (``kvq_eval.readme`` names the file)."""
    from .plot import _ctx

    contexts = [str(c) for c in study["needle_contexts"]] if study["needles"] else []
    tokens = _ctx(study["context"])
    head = ["target", "plan: stored bits", f"plan Δppl {tokens} held-out [95% t-CI] (windows)", "within target",
            "cheapest uniform setting (stored bits)", f"uniform settings compared (lacking {tokens} cells)",
            "bits saved", f"plan vs uniform, paired {tokens} [95% t-CI] (windows)"]
    head += [f"needle exact {_ctx(int(c))}: plan / uniform (n)" for c in contexts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missing = len(study["baseline_missing"])
    compared = f"{len(study['uniform'])}" + (f" ({missing})" if missing else "")
    for row in study["targets"]:
        plan, base, held = row["plan"], row["uniform"], row["plan"]["heldout"]
        cells = [f"≤ {row['target_pct']:g} %", f"{plan['bits']:.2f}",
                 "–" if held is None else f"{_pct_ci(held['dppl'], held['ci'])} ({held['windows']})",
                 "–" if held is None else ("yes" if plan["heldout_meets_target"] else "no")]
        if base is None:
            cells += ["none meets it", compared, "–", "–"]
        else:
            paired = row.get("paired") or {}
            cells += [f"{base['entry']} ({base['bits']:.2f})", compared, f"{row['uniform_bits_saved']:+.2f}",
                      "–" if "ci" not in paired else
                      f"{_pct_ci(paired['ratio_pct'], [100 * np.expm1(x) for x in paired['ci']])} ({paired['windows']})"]
        for c in contexts:
            got = [row["needles"].get(e, {}).get(c) for e in (plan["entry"], base["entry"] if base else None)]
            cells.append("–" if got[0] is None else f"{got[0]['exact']:.2f} / "
                         + ("–" if got[1] is None else f"{got[1]['exact']:.2f}") + f" ({got[0]['n']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
