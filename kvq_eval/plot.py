"""Tables, paired comparisons and charts of the evaluation, drawn only from its JSON results.

Every mean comes with its interval over independent units (``kvq_eval.stats``): perplexity and
long-decode changes over windows, log-probability changes over needle samples (Student t
intervals), needle exact match with a Wilson interval. Needle entries are compared with fp32 (and
with each other) on the samples that hold both; two entries' perplexity or decode cells on the
windows both hold (paired t interval, paired t and exact sign-flip p-values).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .models import slug
from .niah import VARIANTS
from .stats import MIN_UNITS, mcnemar_exact, paired_test, t_interval, wilson_interval

__all__ = ["load_results", "ppl_summary", "niah_summary", "paired_comparison", "comparison_table",
           "markdown_table", "position_table", "layers_table", "figures", "plot_results", "paired_ppl",
           "ppl_comparison_table", "paired_decode", "decode_summary", "decode_table"]

_REQUIRED = {"ppl": ("entry", "tokens", "windows", "bits_per_element", "band"),
             "niah": ("variant", "context", "sample", "results"),
             "decode": ("entry", "windows", "prefix", "new_tokens"),
             "layers": ("entry", "attn_rel_err", "logit_mse", "bits_per_element")}


#: types of the fields the tables read (a field of another type was a traceback deep in a table)
_TYPES = {"entry": str, "tokens": int, "windows": list, "band": dict, "variant": str, "context": int,
          "sample": int, "results": dict, "prefix": int, "new_tokens": int, "attn_rel_err": list, "logit_mse": list,
          "bits_per_element": (int, float)}
_MAX_RESULT_BYTES = 64 << 20


def _load(path: Path, task: str) -> dict:
    from codebooks._atomic import read_file
    from codebooks._validate import parse_json

    try:  # a regular file of bounded size (a directory or FIFO named *.json is named, never read or waited on),
        row = parse_json(read_file(path, _MAX_RESULT_BYTES))  # JSON of bounded nesting, finite numbers
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable result file ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}: a result file holds a JSON object, got {type(row).__name__}")
    missing = [k for k in _REQUIRED[task] if k not in row]
    if missing:
        raise ValueError(f"{path}: not a kvq-eval {task} result (missing {', '.join(missing)}); "
                         f"delete it or recompute it with kvq-eval run")
    for k in _REQUIRED[task]:
        if not isinstance(row[k], _TYPES[k]) or isinstance(row[k], bool):
            raise ValueError(f"{path}: field {k!r} is a {type(row[k]).__name__}, not a kvq-eval {task} result")
    rows = row["results"].values() if task == "niah" else row["windows"] if "windows" in row else ()
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: {'results' if task == 'niah' else 'windows'} must hold JSON objects")
    return row


def load_results(folder, model: str, entries=None) -> dict:
    """``{"ppl": {entry: {tokens: row}}, "niah": [cell], "decode": {entry: {(prefix, new_tokens): row}},
    "layers": {entry: row}}``.

    ``entries`` (optional) keeps only those entries (``fp32``, ``<method>@<band>[+qprefill]``);
    needle cells keep fp32 as well, the reference of every entry's log-probability change.
    Raises ``FileNotFoundError`` when the folder has no results of ``model`` and ``ValueError``
    naming the file for anything that is not a result of this protocol (v1 folders included).
    """
    root = Path(folder) / slug(model)
    if not root.is_dir():
        raise FileNotFoundError(f"no results for {model!r} in {folder}")
    if (root / "lm").is_dir():
        raise ValueError(f"{root / 'lm'}: results of the v1 protocol (before issue 15); this kvq-eval reads "
                         f"ppl/, niah/, decode/, layers/ folders (tables of v1 results: kvq-eval at 04860e8)")
    keep = None if entries is None else set(entries)
    out = {"ppl": {}, "niah": [], "decode": {}, "layers": {}}
    for f in sorted((root / "ppl").glob("*.json")):
        row = _load(f, "ppl")
        if keep is None or row["entry"] in keep:
            out["ppl"].setdefault(row["entry"], {})[int(row["tokens"])] = row
    for f in sorted((root / "decode").glob("*.json")):
        row = _load(f, "decode")
        if keep is None or row["entry"] in keep:
            out["decode"].setdefault(row["entry"], {})[(int(row["prefix"]), int(row["new_tokens"]))] = row
    for f in sorted((root / "layers").glob("*.json")):
        row = _load(f, "layers")
        if keep is None or row["entry"] in keep:
            out["layers"][row["entry"]] = row
    for f in sorted((root / "niah").glob("*.json")):
        cell = _load(f, "niah")
        if keep is not None:
            cell["results"] = {e: r for e, r in cell["results"].items() if e in keep or e == "fp32"}
        if cell["results"]:
            out["niah"].append(cell)
    return out


def _pct(x: float) -> float:
    return 100.0 * math.expm1(x)


def _window_ci(d: np.ndarray):
    """t interval of the mean of per-window values as a perplexity change in %, or None with fewer
    than ``MIN_UNITS`` windows (no spread to estimate)."""
    if d.size < MIN_UNITS:
        return None
    lo, hi = t_interval(d)
    return _pct(lo), _pct(hi)


def _window_dnll(windows: list[dict]) -> np.ndarray:
    """Per-window mean NLL change against fp32, nats per token (the statistical unit)."""
    return np.array([(w["nll_q"] - w["nll_f"]) / w["n"] for w in windows])


def _dppl(windows: list[dict]) -> dict:
    """Perplexity change against fp32 with a t interval over windows (per-window mean NLL change
    per token; its mean and interval bounds as ``100 (exp(.) - 1)``)."""
    d = _window_dnll(windows)
    n = sum(w["n"] for w in windows)
    return {"windows": len(windows), "dppl": _pct(float(d.mean())), "ci": _window_ci(d),
            "ppl": math.exp(sum(w["nll_q"] for w in windows) / n),
            "ppl_fp32": math.exp(sum(w["nll_f"] for w in windows) / n),
            "kl": sum(w["kl"] for w in windows) / n, "top1": sum(w["top1"] for w in windows) / n}


def ppl_summary(res: dict) -> dict:
    """{entry: {tokens: {"dppl", "ci", "ppl", "ppl_fp32", "kl", "top1", "windows", "bits",
    "band_pairs"}}}."""
    out = {}
    for entry, by_t in res["ppl"].items():
        for t, row in by_t.items():
            out.setdefault(entry, {})[t] = {**_dppl(row["windows"]), "bits": row["bits_per_element"],
                                            "band_pairs": row["band_pairs"]}
    return out


def niah_summary(cells: list[dict]) -> dict:
    """{entry: {context: {"n", "exact", "ci", "dlogprob", "dlogprob_ci", "bits", "calibrations"}}}:
    exact match with its Wilson interval, the log-probability change against fp32 with a paired t
    interval over the samples holding both the entry and fp32 (at least ``MIN_UNITS`` of them), and
    how many calibrations the samples' provenance names (0 for methods without one; above 1 the
    rate pools samples of two calibrations, each a draw of its own: docs/evaluation.md)."""
    by: dict = {}
    for cell in cells:
        r = cell["results"]
        for e, x in r.items():
            d = by.setdefault(e, {}).setdefault(cell["context"], {"exact": [], "dlp": [], "bits": [], "calib": set()})
            digest = ((x.get("provenance") or {}).get("artifacts") or {}).get("calibration")
            if digest:
                d["calib"].add(digest)
            d["exact"].append(int(x["exact"]))
            d["bits"].append(x.get("bits_per_element", 32.0))
            if "fp32" in r and e != "fp32":
                d["dlp"].append((x["logprob"], r["fp32"]["logprob"]))
    out = {}
    for e, ctxs in by.items():
        for c, d in sorted(ctxs.items()):
            n, k = len(d["exact"]), sum(d["exact"])
            row = {"n": n, "exact": k / n, "ci": wilson_interval(k, n), "bits": float(np.mean(d["bits"])),
                   "calibrations": len(d["calib"])}
            if len(d["dlp"]) >= MIN_UNITS:
                a, b = np.array(d["dlp"]).T
                pt = paired_test(a, b)
                row.update(dlogprob=pt["mean_diff"], dlogprob_ci=pt["ci"], paired=pt["n"])
            out.setdefault(e, {})[c] = row
    return out


def paired_comparison(cells: list[dict], a: str, b: str) -> dict:
    """Entry ``a`` against entry ``b`` on the needle samples holding both, per context.

    Returns
    -------
    dict
        ``{context: {"n", "a_only", "b_only", "both", "neither", "p_mcnemar", "dlogprob", "ci", "p_t",
        "p_signflip"}}``: McNemar's exact test on exact match and the paired test of the
        log-probability difference ``a - b`` over samples (t interval, paired t and sign-flip
        p-values, ``kvq_eval.stats.paired_test``); a context with fewer than ``MIN_UNITS`` shared
        samples has only the McNemar columns and ``dlogprob`` (``ci`` and the p-values None).
    """
    _check_pair(a, b)
    seen = set().union(*(cell["results"] for cell in cells)) if cells else set()
    for name, m in (("a", a), ("b", b)):
        if m not in seen:
            raise ValueError(f"entry {name}={m!r} has no needle sample; present: {sorted(seen)}")
    pairs: dict = {}
    for cell in cells:
        r = cell["results"]
        if a in r and b in r:
            pairs.setdefault(cell["context"], []).append((r[a]["exact"], r[b]["exact"], r[a]["logprob"],
                                                          r[b]["logprob"]))
    if not pairs:
        raise ValueError(f"no needle sample holds both {a!r} and {b!r}; run them on the same cells")
    out = {}
    for ctx, rows in sorted(pairs.items()):
        ea, eb, la, lb = (np.array(x) for x in zip(*rows))
        mc = mcnemar_exact(ea, eb)
        pt = (paired_test(la, lb) if la.size >= MIN_UNITS else
              {"mean_diff": float(la[0] - lb[0]), "ci": None, "p_t": None, "p_signflip": None})
        out[ctx] = {"n": mc["n"], "a_only": mc["a_only"], "b_only": mc["b_only"], "both": mc["both"],
                    "neither": mc["neither"], "p_mcnemar": mc["p"], "dlogprob": pt["mean_diff"], "ci": pt["ci"],
                    "p_t": pt["p_t"], "p_signflip": pt["p_signflip"]}
    return out


def _check_pair(a, b) -> None:
    if not isinstance(a, str) or not isinstance(b, str):
        raise TypeError("entries a and b must be str")
    if a == b:
        raise ValueError(f"entries a and b must differ, got {a!r} twice")


def _paired_windows(wa: list[dict], wb: list[dict], what: str) -> dict:
    """Paired test over windows of two entries' cells of the same windows (``paired_ppl``)."""
    if len(wa) != len(wb) or any(x["n"] != y["n"] for x, y in zip(wa, wb)):
        raise ValueError(f"{what}: the two entries hold different windows ({len(wa)} vs {len(wb)}); "
                         f"compare cells of the same settings")
    if len(wa) < MIN_UNITS:
        raise ValueError(f"{what}: {len(wa)} window(s); a paired test needs at least {MIN_UNITS}")
    # the entries' NLL difference on the same tokens, per window (fp32's NLL cancels)
    per = np.array([(x["nll_q"] - y["nll_q"]) / x["n"] for x, y in zip(wa, wb)])
    pt = paired_test(per, np.zeros_like(per))
    return {"windows": len(wa), "dnll": pt["mean_diff"], "ci": pt["ci"], "p_t": pt["p_t"],
            "p_signflip": pt["p_signflip"], "ratio_pct": _pct(pt["mean_diff"]), "window_dnll": [float(x) for x in per]}


def paired_ppl(res: dict, a: str, b: str) -> dict:
    """Entry ``a`` against entry ``b`` on the perplexity windows both were run on, per window length.

    The unit is the window: per window, the two entries' NLL difference per token on the same
    tokens; their mean with a paired t interval, the paired t p-value and the exact sign-flip
    p-value (``kvq_eval.stats.paired_test``). Blocks inside a window are not units: their spread
    understates the spread between windows.

    Returns
    -------
    dict
        ``{tokens: {"windows", "dnll", "ci", "p_t", "p_signflip", "ratio_pct", "window_dnll"}}``: mean
        NLL difference ``a - b`` in nats per token with its 95 % t interval and p-values, the same as
        a perplexity ratio ``100 (exp(dnll) - 1)`` %, and the per-window differences.
    """
    _check_pair(a, b)
    ppl = res["ppl"]
    return {t: _paired_windows(ppl[a][t]["windows"], ppl[b][t]["windows"], f"{a!r} and {b!r} at {t} tokens")
            for t in sorted(set(ppl.get(a, {})) & set(ppl.get(b, {})))}


def paired_decode(res: dict, a: str, b: str) -> dict:
    """``paired_ppl`` for the long-decode cells: entry ``a`` against ``b`` on the generated tokens
    of the windows both decoded, per (prefix, new tokens) setting, the window the unit."""
    _check_pair(a, b)
    dec = res["decode"]
    return {k: _paired_windows(dec[a][k]["windows"], dec[b][k]["windows"], f"{a!r} and {b!r} decoding {k}")
            for k in sorted(set(dec.get(a, {})) & set(dec.get(b, {})))}


def decode_summary(res: dict) -> dict:
    """{entry: {(prefix, new_tokens): {"windows", "tokens", "dppl", "ci", "kl", "top1", "bits", "prefill"}}}.

    Over the generated tokens of every window: the perplexity change against fp32's full forward
    with a t interval over windows (None with one window), KL per token and top-1 agreement. fp32's own row measures incremental decoding against one
    full forward: its floor.
    """
    out = {}
    for entry, by in res["decode"].items():
        for k, row in by.items():
            w = row["windows"]
            n = sum(x["n"] for x in w)
            out.setdefault(entry, {})[k] = {
                "windows": len(w), "tokens": n, "dppl": _pct(sum(x["nll_q"] - x["nll_f"] for x in w) / n),
                "ci": _window_ci(_window_dnll(w)), "kl": sum(x["kl"] for x in w) / n, "top1": sum(x["top1"] for x in w) / n,
                "bits": float(np.mean([x.get("bits_per_element", 32.0) for x in w])), "prefill": row["prefill"]}
    return out


def decode_table(res: dict) -> str:
    """``decode_summary`` as a Markdown table, one row per (entry, setting), sorted by stored bits."""
    dec = decode_summary(res)
    if not dec:
        raise ValueError("no decode cells (run kvq-eval run --tasks decode)")
    head = ["entry", "prefill", "prefix + new", "bits", "Δppl [95% t-CI] (windows)", "KL", "top-1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(e, k, r) for e, by in dec.items() for k, r in by.items()]
    for e, (pre, new), r in sorted(rows, key=lambda x: (x[0] != "fp32", x[2]["bits"], x[0], x[1])):
        lines.append(f"| {e} | {r['prefill']} | {pre} + {new} | {r['bits']:.2f} | {r['dppl']:+.2f}%"
                     f"{_ci(r['ci'], '+.2f')} ({r['windows']}) | {r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(lines)


def ppl_comparison_table(cmp: dict, a: str, b: str) -> str:
    """``paired_ppl`` (or ``paired_decode``) as a Markdown table, one row per window length (or
    decode setting)."""
    head = ["window", "windows", f"Δ NLL {a} − {b} (nats/token) [95% t-CI]", "ppl ratio", "paired t p",
            "sign-flip p", "per window"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, r in cmp.items():
        per = ", ".join(f"{x:+.4f}" for x in r["window_dnll"])
        label = _ctx(t) if isinstance(t, int) else f"decode {t[0]} + {t[1]}"
        lines.append(f"| {label} | {r['windows']} | {r['dnll']:+.4f}{_ci(r['ci'], '+.4f')} | {r['ratio_pct']:+.2f}% | "
                     f"{r['p_t']:.3g} | {r['p_signflip']:.3g} | {per} |")
    return "\n".join(lines)


def comparison_table(cmp: dict, a: str, b: str) -> str:
    """``paired_comparison`` as a Markdown table, one row per context."""
    head = ["context", "samples", f"only {a} exact", f"only {b} exact", "both", "neither", "McNemar p",
            f"Δ log-prob {a} − {b} [95% t-CI]", "paired t p", "sign-flip p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ctx, r in cmp.items():
        lines.append(f"| {ctx} | {r['n']} | {r['a_only']} | {r['b_only']} | {r['both']} | {r['neither']} | "
                     f"{r['p_mcnemar']:.3g} | {r['dlogprob']:+.2f}{_ci(r['ci'], '+.2f')} | {_p(r['p_t'])} | "
                     f"{_p(r['p_signflip'])} |")
    return "\n".join(lines)


def _ci(ci, fmt: str) -> str:
    """`` [lo, hi]`` of an interval, or nothing where there is none (fewer than ``MIN_UNITS`` units)."""
    return "" if ci is None else f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _p(p) -> str:
    return "–" if p is None else f"{p:.3g}"


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def markdown_table(res: dict, variant: str | None = None) -> str:
    """One row per entry (fp32 first, then by stored bits): perplexity change per window length with
    its t interval over windows and pair-weighted stored bits; per needle context the stored bits of the
    decoding cache (mean over samples), exact match with its Wilson interval and the
    log-probability change against fp32 (``variant`` restricts the needle samples to one variant);
    ``(n; k calibrations)`` where a column's samples name k > 1 calibrations."""
    pp = ppl_summary(res)
    cells = [c for c in res["niah"] if variant is None or c["variant"] == variant]
    nh = niah_summary(cells)
    lengths = sorted({t for by in pp.values() for t in by})
    contexts = sorted({c for by in nh.values() for c in by})
    head = ["entry"]
    for t in lengths:
        head += [f"bits @{_ctx(t)}", f"Δppl {_ctx(t)} [95% t-CI] (windows)", f"KL {_ctx(t)}"]
    for c in contexts:
        head += [f"cache bits {_ctx(c)}", f"exact {_ctx(c)} [Wilson 95%] (n)", f"Δlog-prob {_ctx(c)} [95% t-CI]"]
    entries = sorted(set(pp) | set(nh), key=lambda e: (e != "fp32", _bits_key(e, pp, nh), e))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        row = [e]
        for t in lengths:
            p = pp.get(e, {}).get(t)
            row += (["–"] * 3 if p is None else
                    [f"{p['bits']:.2f}", f"{p['dppl']:+.2f}%{_ci(p['ci'], '+.2f')} ({p['windows']})",
                     f"{p['kl']:.4f}"])
        for c in contexts:
            x = nh.get(e, {}).get(c)
            if x is None:
                row += ["–", "–", "–"]
                continue
            row.append(f"{x['bits']:.2f}")
            mixed = f"; {x['calibrations']} calibrations" if x.get("calibrations", 0) > 1 else ""
            row.append(f"{x['exact']:.2f} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}] ({x['n']}{mixed})")
            row.append("–" if "dlogprob" not in x else
                       f"{x['dlogprob']:+.2f} [{x['dlogprob_ci'][0]:+.2f}, {x['dlogprob_ci'][1]:+.2f}]")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _bits_key(e, pp, nh) -> float:
    for source in (pp.get(e, {}), nh.get(e, {})):
        for _, x in sorted(source.items()):
            return x["bits"]
    return math.inf


def figures(res: dict, model: str, variant: str = "single") -> dict:
    """``{"quality_vs_bits": Figure}``: against the stored bits as the cache holds them, with
    interval bars, three panels: perplexity change (per window length), needle exact match (Wilson
    interval) and the answer's log-probability change against fp32 on the same samples (paired
    t interval), both per context and for the needle ``variant`` only (neither is
    comparable across variants, and a pooled point would mix samples of different difficulty).

    The log-probability panel is the one that separates methods where exact match saturates (the
    multi-query needle, where fp32 itself finds few answers); it is drawn on a symlog axis (linear
    within 1 nat of fp32)."""
    from matplotlib.figure import Figure

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    pp = ppl_summary(res)
    nh = niah_summary([c for c in res["niah"] if c["variant"] == variant])
    fig = Figure(figsize=(18, 4.5))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for t in sorted({t for by in pp.values() for t in by}):
        pts = [(e, by[t]) for e, by in sorted(pp.items()) if t in by]
        x = [p["bits"] for _, p in pts]
        y = [p["dppl"] for _, p in pts]
        # a point without an interval (one window) gets no bar
        err = np.array([[0.0, 0.0] if p["ci"] is None else [p["dppl"] - p["ci"][0], p["ci"][1] - p["dppl"]]
                        for _, p in pts]).T
        ax1.errorbar(x, y, yerr=err, fmt="o", ms=4, capsize=2, label=f"{_ctx(t)} windows")
        for (e, _), xi, yi in zip(pts, x, y):
            ax1.annotate(e, (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax1.set_yscale("symlog", linthresh=1.0)
    ax1.set_xlabel("stored bits per element (band and tables included, pair-weighted)")
    ax1.set_ylabel("perplexity change vs fp32 (%)\n(t 95% CI over windows)")
    ax1.grid(True, alpha=0.3)
    if pp:
        ax1.legend(fontsize=8)
    else:  # an empty panel must not read as a drawing error
        ax1.text(0.5, 0.5, "no perplexity cells yet", ha="center", va="center", transform=ax1.transAxes)
    contexts = sorted({c for by in nh.values() for c in by})
    for c in contexts:
        pts = [(e, by[c]) for e, by in sorted(nh.items()) if c in by and e != "fp32"]
        x = [p["bits"] for _, p in pts]
        y = [p["exact"] for _, p in pts]
        err = np.array([[p["exact"] - p["ci"][0], p["ci"][1] - p["exact"]] for _, p in pts]).T
        if pts:
            ax2.errorbar(x, y, yerr=err, fmt="o", ms=4, capsize=2, label=f"{_ctx(c)} (n={pts[0][1]['n']})")
        fp = nh.get("fp32", {}).get(c)
        if fp:
            ax2.axhline(fp["exact"], lw=0.8, ls="--", color="gray")
        lp = [(e, p) for e, p in pts if "dlogprob" in p]
        if lp:
            err = np.array([[p["dlogprob"] - p["dlogprob_ci"][0], p["dlogprob_ci"][1] - p["dlogprob"]]
                            for _, p in lp]).T
            ns = sorted({p["paired"] for _, p in lp})
            n = str(ns[0]) if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"
            ax3.errorbar([p["bits"] for _, p in lp], [p["dlogprob"] for _, p in lp], yerr=err, fmt="o",
                         ms=4, capsize=2, label=f"{_ctx(c)} (n={n} paired)")
            if c == contexts[-1]:  # name the longest context's points only, the others would overlap
                for e, p in lp:
                    ax3.annotate(e, (p["bits"], p["dlogprob"]), fontsize=6, xytext=(3, 3),
                                 textcoords="offset points")
    ax2.set_xlabel("stored bits per element of the needle cache")
    ax2.set_ylabel(f"{variant} needle exact match (Wilson 95% CI)\ndashed: fp32")
    ax2.set_ylim(-0.05, 1.05)
    ax2.grid(True, alpha=0.3)
    if nh:
        ax2.legend(fontsize=8)
    ax3.axhline(0.0, lw=0.8, ls="--", color="gray")
    ax3.set_yscale("symlog", linthresh=1.0)
    ax3.set_xlabel("stored bits per element of the needle cache")
    ax3.set_ylabel(f"{variant} needle: answer log-prob vs fp32\n(nats, paired t 95% CI)")
    ax3.grid(True, alpha=0.3)
    if ax3.containers:
        ax3.legend(fontsize=8)
    fig.suptitle(f"{model}: quality vs stored bits")
    fig.tight_layout()
    return {"quality_vs_bits": fig}


def plot_results(folder, model: str, prefix, entries=None, variant: str = "single") -> list[Path]:
    """Write ``PREFIX_quality_vs_bits.png`` (``figures``; ``entries`` as in ``load_results``)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(load_results(folder, model, entries), model, variant).items():
        path = Path(f"{prefix}_{name}.png")
        fig.savefig(path, dpi=110, metadata={"Software": None})
        paths.append(path)
    return paths


def position_table(res: dict, tokens: int) -> str:
    """Where in a ``tokens``-token perplexity window the loss sits: per entry, the mean NLL change
    against fp32 (nats per token) in each of the position bins the cells store, over windows."""
    rows = {e: by[tokens] for e, by in res["ppl"].items() if tokens in by}
    if not rows:
        raise ValueError(f"no perplexity cell with {tokens}-token windows; present: "
                         f"{sorted({t for by in res['ppl'].values() for t in by})}")
    bins = len(next(iter(rows.values()))["windows"][0]["dnll_bins"])
    edges = [round(tokens * i / bins) for i in range(bins + 1)]
    head = ["entry"] + [f"{edges[i]}–{edges[i + 1]}" for i in range(bins)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e, row in sorted(rows.items()):
        mean = np.mean([w["dnll_bins"] for w in row["windows"]], axis=0)
        lines.append("| " + " | ".join([e] + [f"{x:+.3f}" for x in mean]) + " |")
    return "\n".join(lines)


def layers_table(res: dict) -> str:
    """Per-layer attention-output relative error (``layers`` cells), one row per entry; then the
    exact keys' mean share and logit SNR (``keyopts.key_structure``) when a cell records them (the
    same window for every method, so one cell gives them)."""
    if not res["layers"]:
        raise ValueError("no layers cells (run kvq-eval run --tasks layers)")
    n = max(len(r["attn_rel_err"]) for r in res["layers"].values())
    head = ["entry"] + [f"L{i}" for i in range(n)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e, r in sorted(res["layers"].items()):
        lines.append("| " + " | ".join([e] + [f"{x:.3f}" for x in r["attn_rel_err"]]) + " |")
    exact = next((r for _, r in sorted(res["layers"].items()) if "key_mean_share" in r), None)
    if exact is not None:
        for label, key in (("exact keys: mean share", "key_mean_share"), ("exact keys: logit SNR", "logit_snr")):
            lines.append("| " + " | ".join([label] + [f"{x:.3f}" for x in exact[key]]) + " |")
    return "\n".join(lines)
