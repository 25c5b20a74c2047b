"""Do two runs of the same grid agree? (issue 56: cells that reproduce across machines)

``kvq-eval reproduce A B --model M`` pairs every needle sample and perplexity window that two result
folders both hold (the same prompt, the same window tokens) and says, per entry, how often the
numbers are bit-identical, how far apart they are and whether the difference is more than noise:
the tool for "are the committed numbers what my machine gets?", and how
``results/numerics`` bounds what a processor's numeric path moves.

Notes
-----
The float32 forward's last bits depend on the kernels each library picks for the processor (MKL,
ATen, oneDNN, OpenBLAS, Numba), and a quantizer turns a last-bit change of a key near a decision
threshold into another code, which an attention read can turn into a visible change of one needle
answer's log-probability. Such a change is a perturbation of the same size on either path, so it
has no sign: a paired t interval over samples (``stats.paired_test``) that holds 0 finds no
difference between the two distributions at that many samples (it does not prove them equal; its
width says how large a difference could hide), and McNemar's exact test does the same for the
exact-match outcomes. Two runs of a calibrated method (NOVA-KV) on different machines also use
different calibrations, each shared by all of its run's samples: the paired interval then measures
that one pair of calibrations, not the spread over calibrations (``--calib-seed`` draws more).
Units are needle samples and perplexity windows, as everywhere in the evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .stats import MIN_UNITS, mcnemar_exact, paired_test

__all__ = ["compare_runs", "format_comparison"]

# what makes two needle cells the same prompt, and two perplexity windows the same tokens
_NEEDLE_INPUTS = ("keys", "values", "offset", "prompt_tokens", "context", "depth", "variant", "haystack")


def _environments(entries: list[dict]) -> list[dict]:
    """The distinct (processor, numeric path, calibration digests) the entries were made with."""
    seen: dict[str, dict] = {}
    for e in entries:
        p = e.get("provenance") or {}
        env = {"cpu_model": p.get("cpu_model"), "cpu": p.get("cpu"), "numerics": p.get("numerics", "native"),
               "artifacts": p.get("artifacts") or {}, "recorded": bool(p)}
        seen.setdefault(json.dumps(env, sort_keys=True), env)
    return list(seen.values())


def _needle_rows(a_dir: Path, b_dir: Path, model: str) -> dict:
    """entry -> (variant, context) -> list of (a entry, b entry) on the same prompts."""
    rows: dict = {}
    for fa in sorted((a_dir / model / "niah").glob("*.json")):
        fb = b_dir / model / "niah" / fa.name
        if not fb.exists():
            continue
        ca, cb = json.loads(fa.read_text()), json.loads(fb.read_text())
        for k in _NEEDLE_INPUTS:
            if ca.get(k) != cb.get(k):
                raise ValueError(f"{fa.name}: the two folders hold different prompts ({k} differs), "
                                 f"not two runs of one grid")
        for entry in sorted(set(ca["results"]) & set(cb["results"])):
            rows.setdefault(entry, {}).setdefault((ca["variant"], int(ca["context"])), []).append(
                (ca["results"][entry], cb["results"][entry]))
    return rows


def _needle_summary(pairs: list[tuple[dict, dict]]) -> dict:
    la = np.array([a["logprob"] for a, _ in pairs], dtype=float)
    lb = np.array([b["logprob"] for _, b in pairs], dtype=float)
    ea = [int(a["exact"]) for a, _ in pairs]
    eb = [int(b["exact"]) for _, b in pairs]
    out = {"n": len(pairs), "identical": int(sum(a["logprob"] == b["logprob"] and a["answer"] == b["answer"]
                                                 for a, b in pairs)),
           "exact_a": int(sum(ea)), "exact_b": int(sum(eb)), "mcnemar": mcnemar_exact(ea, eb),
           "max_abs_logprob_diff": float(np.max(np.abs(lb - la))),
           "environments_a": _environments([a for a, _ in pairs]),
           "environments_b": _environments([b for _, b in pairs])}
    if len(pairs) >= MIN_UNITS:
        t = paired_test(lb, la)
        out["logprob_diff"] = {"mean": t["mean_diff"], "ci": list(t["ci"]), "p_t": t["p_t"],
                               "p_signflip": t["p_signflip"]}
    return out


def _ppl_summary(a_cell: dict, b_cell: dict) -> dict | None:
    """Windows both cells hold (matched by their token ids' digest): the change of the mean NLL per
    token of the quantized forward (b - a) and of the float32 one."""
    wb = {w["ids_sha256"]: w for w in b_cell.get("windows", []) if "ids_sha256" in w}
    pairs = [(w, wb[w["ids_sha256"]]) for w in a_cell.get("windows", []) if w.get("ids_sha256") in wb]
    if not pairs:
        return None
    qa = np.array([w["nll_q"] / w["n"] for w, _ in pairs])
    qb = np.array([w["nll_q"] / w["n"] for _, w in pairs])
    fa = np.array([w["nll_f"] / w["n"] for w, _ in pairs])
    fb = np.array([w["nll_f"] / w["n"] for _, w in pairs])
    out = {"n": len(pairs), "tokens": int(pairs[0][0]["n"]),
           "identical": int(sum(a["nll_q"] == b["nll_q"] for a, b in pairs)),
           "max_abs_nll_diff": float(np.max(np.abs(qb - qa))),
           "max_abs_fp32_nll_diff": float(np.max(np.abs(fb - fa))),
           "environments_a": _environments([a_cell]), "environments_b": _environments([b_cell])}
    if len(pairs) >= MIN_UNITS:
        t = paired_test(qb, qa)
        out["nll_diff"] = {"mean": t["mean_diff"], "ci": list(t["ci"]), "p_t": t["p_t"],
                           "p_signflip": t["p_signflip"]}
    return out


def compare_runs(a, b, model: str) -> dict:
    """Pair what two result folders both hold for ``model`` and summarize the agreement per entry.

    Parameters
    ----------
    a, b : str or Path
        Result folders of ``kvq-eval run`` (e.g. the committed ``results/eval_v3`` and a rerun of
        part of its grid on another machine).
    model : str
        The model folder name inside both (``smollm2``, ``gemma3``).

    Returns
    -------
    dict
        ``{"a", "b", "model", "niah": {entry: {"<variant>@<context>": summary}}, "ppl": {cell name:
        summary}}``. A needle summary holds ``n`` samples, ``identical`` (same log-probability and
        answer), ``exact_a``/``exact_b``, ``mcnemar`` (``stats.mcnemar_exact`` of a vs b),
        ``max_abs_logprob_diff``, ``logprob_diff`` (b - a: mean, paired t ``ci``, ``p_t``,
        ``p_signflip``; from ``stats.MIN_UNITS`` samples) and the environments each side's entries
        record. A perplexity summary holds the same per window of mean NLL per token.

    Raises
    ------
    ValueError
        A folder without the model, nothing in common, or cells of one name that hold different
        prompts.
    """
    a, b = Path(a), Path(b)
    for name, d in (("a", a), ("b", b)):
        if not (d / model).is_dir():
            raise ValueError(f"{name}: {d} holds no results for model {model!r}")
    niah = {entry: {f"{v}@{c}": _needle_summary(p) for (v, c), p in sorted(groups.items())}
            for entry, groups in _needle_rows(a, b, model).items()}
    ppl = {}
    for fa in sorted((a / model / "ppl").glob("*.json")):
        fb = b / model / "ppl" / fa.name
        if fb.exists():
            s = _ppl_summary(json.loads(fa.read_text()), json.loads(fb.read_text()))
            if s is not None:
                ppl[fa.stem] = s
    if not niah and not ppl:
        raise ValueError(f"{a} and {b} share no needle sample or perplexity window of {model!r}")
    return {"a": str(a), "b": str(b), "model": model, "niah": niah, "ppl": ppl}


def _num(x: float) -> str:
    """Signed, 3 decimals; below 0.001 (and not 0) in scientific notation, so that a float32
    rounding difference does not print as 0."""
    return f"{x:+.3f}" if x == 0 or abs(x) >= 1e-3 else f"{x:+.1e}"


def format_comparison(result: dict) -> str:
    """A Markdown table of ``compare_runs``'s needle and perplexity summaries."""
    lines = [f"{result['b']} against {result['a']} ({result['model']}): b - a", "",
             "| entry | cells | n | identical | exact a / b (McNemar p) | mean diff [95% CI] | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for entry, groups in result["niah"].items():
        for key, s in groups.items():
            d = s.get("logprob_diff")
            ci = f"{_num(d['mean'])} [{_num(d['ci'][0])}, {_num(d['ci'][1])}] nats" if d else "-"
            lines.append(f"| {entry} | needle {key} | {s['n']} | {s['identical']} | {s['exact_a']} / {s['exact_b']} "
                         f"({s['mcnemar']['p']:.2g}) | {ci} | {s['max_abs_logprob_diff']:.3g} |")
    for name, s in result["ppl"].items():
        d = s.get("nll_diff")
        ci = f"{d['mean']:+.2e} [{d['ci'][0]:+.2e}, {d['ci'][1]:+.2e}] nats/token" if d else "-"
        lines.append(f"| {name} | perplexity {s['tokens']} | {s['n']} | {s['identical']} | - | {ci} nats/token | "
                     f"{s['max_abs_nll_diff']:.3g} |")
    return "\n".join(lines) + "\n"
