"""Which setting to deploy: the cheapest stored-bits entry within a perplexity target (``kvq-eval recommend``).

For each target (a perplexity increase over fp32 in %, at one window length, 8K by default) and
each band class (``"none"``: settings without a 16-bit band; ``"any"``: every setting, a band allowed,
so that a band-free setting that is cheaper wins there too), the entry with the fewest stored bits whose
perplexity change is within the target *at the upper end of its 95 % t interval over windows*
(``kvq_eval.stats``): a setting that only meets the target on average is not recommended. With it,
its needle recall (exact match of the single needle, Wilson interval) and the answer's
log-probability change against fp32 at the contexts where it has samples.

Each entry's interval holds for that entry; the pick is the cheapest of the ``N`` entries looked at,
and a setting whose true change lies just above the target passes its own bound with probability up
to 2.5 %, so among many such settings one of them is picked far more often than that. The *joint*
pick keeps the guarantee through the selection: every entry's bound is the upper end of its
``1 - 0.05 / N`` interval (Bonferroni), so with probability at least 97.5 % every bound holds at once
and the joint pick's true change is within the target whichever entry it is.
"""

from __future__ import annotations

from .grid import parse_entry
from .plot import _ctx, _pct, _window_dnll, niah_summary, ppl_summary
from .stats import t_interval

__all__ = ["recommend", "recommend_table", "TARGETS", "BAND_CLASSES"]

TARGETS = (0.5, 1.0, 3.0)
BAND_CLASSES = ("none", "any")
MIN_WINDOWS = 4  # fewer windows give no usable upper bound (t_{n-1} grows fast below 4)
LEVEL = 0.95  # the entries' own intervals (plot.ppl_summary, 95 %); the joint pick's are 1 - (1 - LEVEL) / N


def _in_class(entry: str, cls: str) -> bool:
    """Whether ``entry`` belongs to band class ``cls``: "none" holds the entries without a band, "any" all."""
    if cls == "any":
        return True
    band = parse_entry(entry)[1]
    return band is not None and band.label == "none"


def recommend(res: dict, targets=TARGETS, tokens: int = 8192, contexts=(4096, 8192)) -> list[dict]:
    """One row per (target, band class): the cheapest entry meeting the target, or ``entry`` None.

    Parameters
    ----------
    res : dict
        ``plot.load_results`` of one model.
    targets : sequence of float > 0
        Perplexity increases over fp32, in %.
    tokens : int
        Window length of the perplexity cells the targets apply to.
    contexts : sequence of int
        Needle contexts whose single-needle recall is reported.

    Returns
    -------
    list of dict
        ``target``, ``band`` (``"none"``/``"any"``), ``entry``, ``bits``, ``dppl``, ``ci``,
        ``windows`` and ``needles`` (``{context: niah_summary row}``); ``candidates``: how many
        entries of the band class have a cell of at least ``MIN_WINDOWS`` windows (0: none yet);
        ``joint``: the cheapest entry whose upper bound at level ``1 - (1 - LEVEL) / candidates``
        is within the target (module docstring), ``{"entry", "bits", "upper"}`` (upper: that bound,
        in %), or None.
    """
    for t in targets:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"targets must be positive percentages, got {t!r}")
    pp = ppl_summary(res)
    cand = [(e, by[tokens]) for e, by in pp.items()
            if tokens in by and by[tokens]["ci"] is not None and by[tokens]["windows"] >= MIN_WINDOWS]
    nh = niah_summary([c for c in res["niah"] if c["variant"] == "single"])
    joint = {}  # band class -> [(bits, entry, upper bound at the Bonferroni level)]
    for cls in BAND_CLASSES:
        members = [(e, p) for e, p in cand if _in_class(e, cls)]
        level = 1.0 - (1.0 - LEVEL) / max(len(members), 1)
        joint[cls] = [(p["bits"], e, _pct(t_interval(_window_dnll(res["ppl"][e][tokens]["windows"]), level)[1]))
                      for e, p in members]
    rows = []
    for t in targets:
        for cls in BAND_CLASSES:
            ok = [(p["bits"], e, p) for e, p in cand if _in_class(e, cls) and p["ci"][1] <= t]
            row = {"target": float(t), "band": cls, "entry": None, "candidates": len(joint[cls]), "joint": None}
            if ok:
                bits, e, p = min(ok, key=lambda x: (x[0], x[1]))
                row.update(entry=e, bits=bits, dppl=p["dppl"], ci=p["ci"], windows=p["windows"],
                           needles={c: nh[e][c] for c in contexts if c in nh.get(e, {})})
            jok = [x for x in joint[cls] if x[2] <= t]
            if jok:
                bits, e, upper = min(jok, key=lambda x: (x[0], x[1]))
                row["joint"] = {"entry": e, "bits": bits, "upper": upper}
            rows.append(row)
    return rows


def recommend_table(res: dict, targets=TARGETS, tokens: int = 8192, contexts=(4096, 8192)) -> str:
    """``recommend`` as a Markdown table."""
    head = ["target", "16-bit band", "setting", "stored bits", f"Δppl {_ctx(tokens)} [95% t-CI] (windows)"]
    for c in contexts:
        head += [f"needle exact {_ctx(c)} [Wilson 95%] (n)", f"Δlog-prob {_ctx(c)} [95% t-CI]"]
    head.append("joint pick (Bonferroni): bits, Δppl bound")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recommend(res, targets, tokens, contexts):
        label = "none" if r["band"] == "none" else "allowed"
        j = r["joint"]
        jcell = ("–" if not r["candidates"] else f"none of {r['candidates']}" if j is None else
                 f"{'same' if j['entry'] == r['entry'] else j['entry']}: {j['bits']:.2f}, "
                 f"≤ {j['upper']:+.2f}% (of {r['candidates']})")
        if r["entry"] is None:
            n = r["candidates"]  # said with its count: a grid still filling must not read as "nothing can"
            why = (f"none of {n} entries with {_ctx(tokens)} cells meets it" if n > 1 else
                   f"the one entry with {_ctx(tokens)} cells does not meet it" if n else f"no {_ctx(tokens)} cell yet")
            cells = [f"≤ {r['target']:g} %", label, why, "–", "–"] + ["–", "–"] * len(contexts) + [jcell]
        else:
            cells = [f"≤ {r['target']:g} %", label, r["entry"], f"{r['bits']:.2f}",
                     f"{r['dppl']:+.2f}% [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}] ({r['windows']})"]
            for c in contexts:
                x = r["needles"].get(c)
                if x is None:
                    cells += ["–", "–"]
                    continue
                cells.append(f"{x['exact']:.2f} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}] ({x['n']})")
                cells.append("–" if "dlogprob" not in x else
                             f"{x['dlogprob']:+.2f} [{x['dlogprob_ci'][0]:+.2f}, {x['dlogprob_ci'][1]:+.2f}]")
            cells.append(jcell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_targets(text: str) -> list[float]:
    """``"0.5,1,3"`` -> [0.5, 1.0, 3.0] (``ValueError`` naming ``--targets`` otherwise)."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--targets: expected positive numbers separated by commas, got {text!r}") from None
    if not out or any(not (x > 0 and x < float("inf")) for x in out):
        raise ValueError(f"--targets: expected positive numbers separated by commas, got {text!r}")
    return out
