"""Charts of the evaluation, drawn only from its JSON results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["comparison_table", "figures", "load_results", "markdown_table", "paired_cells",
           "paired_comparison", "plot_results", "summary_table"]


def load_results(folder, model: str, methods=None) -> dict:
    """{"lm": {method: row}, "layers": {method: row}, "niah": [cell, ...]} of one model.

    ``methods`` (optional) keeps only those methods ("fp32" included only if listed): the needle
    cells are then paired over these methods alone (``paired_cells``), so a cell filled for a
    subset of methods counts for that subset.
    """
    root = Path(folder) / model
    if not root.is_dir():
        raise FileNotFoundError(f"no results for {model!r} in {folder}")
    keep = None if methods is None else set(methods)
    out = {"lm": {}, "layers": {}, "niah": []}
    for task in ("lm", "layers"):
        for f in sorted((root / task).glob("*.json")):
            row = json.loads(f.read_text())
            if keep is None or row["method"] in keep:
                out[task][row["method"]] = row
    for f in sorted((root / "niah").glob("*.json")):
        cell = json.loads(f.read_text())
        if keep is not None:
            cell["results"] = {m: r for m, r in cell["results"].items() if m in keep}
        if cell["results"]:
            out["niah"].append(cell)
    return out


def paired_cells(cells: list[dict]) -> list[dict]:
    """The needle cells that hold every method seen at their context.

    Accuracies are compared on the same samples: a cell that a run filled for only some methods
    (``kvq-eval run --methods fp32`` on new cells, say) is left out of every method's mean until
    the other methods are added to it.
    """
    by_ctx: dict = {}
    for cell in cells:
        by_ctx.setdefault(cell["context"], []).append(cell)
    out = []
    for group in by_ctx.values():
        methods = set().union(*(cell["results"] for cell in group))
        out += [cell for cell in group if methods <= set(cell["results"])]
    return out


def _niah_scores(cells: list[dict]) -> dict:
    acc: dict = {}
    for cell in paired_cells(cells):
        for method, r in cell["results"].items():
            acc.setdefault(method, {}).setdefault(cell["context"], []).append(r["score"])
    return acc


def niah_accuracy(cells: list[dict]) -> dict:
    """{method: {context: mean score}} over variants, depths and seeds (``paired_cells`` only)."""
    return {m: {c: float(np.mean(v)) for c, v in sorted(by.items())} for m, by in _niah_scores(cells).items()}


def niah_counts(cells: list[dict]) -> dict:
    """{method: {context: number of needle cells}} (the sample size behind each accuracy; the same
    for every method at a context, see ``paired_cells``)."""
    return {m: {c: len(v) for c, v in sorted(by.items())} for m, by in _niah_scores(cells).items()}


def paired_comparison(cells: list[dict], a: str, b: str) -> dict:
    """Method ``a`` against method ``b`` on the needle cells that hold both, per context.

    Parameters
    ----------
    cells : list of dict
        Needle cells (``load_results(...)["niah"]``).
    a, b : str
        Two different method names ("fp32" included).

    Returns
    -------
    dict
        ``{context: {"n", "wins", "losses", "ties", "mean_diff", "p_sign"}}``: the number of cells
        holding both methods, the cells where ``a`` scores above ``b``, below, equal, the mean score
        difference ``a - b``, and the one-sided exact sign-test p-value.

    Notes
    -----
    Each cell is one needle sample scored by both methods over the same prefill, so the cells are
    matched pairs. The sign test drops ties and asks how likely at least ``wins`` wins are out of
    ``wins + losses`` untied cells if neither method were better:
    ``p = P(W >= wins), W ~ Binomial(wins + losses, 1/2)`` (1.0 when every cell ties). It needs no
    assumption on the score distribution (0/1, or thirds for multi-value). Cells are not quite
    independent (they share the haystack text and the calibrated tables), so p is a guide to how
    much the sample says, not an exact error rate.
    """
    if not isinstance(a, str) or not isinstance(b, str):
        raise TypeError("methods a and b must be str")
    if a == b:
        raise ValueError(f"methods a and b must differ, got {a!r} twice")
    seen = set().union(*(cell["results"] for cell in cells)) if cells else set()
    for name, m in (("a", a), ("b", b)):
        if m not in seen:
            raise ValueError(f"method {name}={m!r} has no needle cell; present: {sorted(seen)}")
    diffs: dict = {}
    for cell in cells:
        r = cell["results"]
        if a in r and b in r:
            diffs.setdefault(cell["context"], []).append(r[a]["score"] - r[b]["score"])
    if not diffs:
        raise ValueError(f"no needle cell holds both {a!r} and {b!r}; add one to the other's cells "
                         f"with kvq-eval run --methods {a},{b}")
    out = {}
    for ctx, d in sorted(diffs.items()):
        d = np.asarray(d, dtype=float)
        wins, losses = int(np.sum(d > 0)), int(np.sum(d < 0))
        m = wins + losses
        p = sum(math.comb(m, k) for k in range(wins, m + 1)) / 2.0 ** m
        out[ctx] = {"n": int(d.size), "wins": wins, "losses": losses, "ties": int(d.size) - m,
                    "mean_diff": float(d.mean()), "p_sign": float(p)}
    return out


def comparison_table(cmp: dict, a: str, b: str) -> str:
    """``paired_comparison`` as a Markdown table, one row per context."""
    head = ["context", "cells", f"{a} > {b}", f"{a} < {b}", "ties", f"mean {a} − {b}", "p (sign test, one-sided)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ctx, r in cmp.items():
        lines.append(f"| {ctx} | {r['n']} | {r['wins']} | {r['losses']} | {r['ties']} | "
                     f"{r['mean_diff']:+.2f} | {r['p_sign']:.3g} |")
    return "\n".join(lines)


def summary_table(res: dict) -> list[dict]:
    """One row per method: stored bits, perplexity, KL, top-1, NIAH accuracy per context."""
    acc = niah_accuracy(res["niah"])
    rows = []
    for method in sorted(set(res["lm"]) | set(acc)):
        lm = res["lm"].get(method, {})
        layers = res["layers"].get(method, {})
        rows.append({"method": method, "bits_per_element": layers.get("bits_per_element"),
                     "ppl": lm.get("ppl"), "ppl_fp32": lm.get("ppl_fp32"), "kl": lm.get("kl"),
                     "top1_agreement": lm.get("top1_agreement"), "niah": acc.get(method, {})})
    return rows


def markdown_table(res: dict) -> str:
    """The summary as a Markdown table (README), fp32 first, then by stored bits.

    Columns: the method's nominal bits per element; the bits it actually stored per element on the
    ``layers`` task's 1024 tokens (side information and its 16-bit band included, which dominates
    for NOVA-KV, OSCAR, KIVI and QJL at this length); perplexity and its change against fp32;
    KL(fp32 || method) per token; top-1 agreement; mean attention-output relative error over
    layers; needle accuracy per context, over the cells that hold every method (``paired_cells``),
    with their number in the header (``n``).
    """
    rows = summary_table(res)
    counts = niah_counts(res["niah"])
    contexts = sorted({c for r in rows for c in r["niah"]})
    n_at = {c: min(by.get(c, 0) for by in counts.values()) for c in contexts}
    from .methods import METHODS

    head = ["method", "nominal bits", "stored bits", "ppl", "Δppl", "KL", "top-1", "attn err"]
    head += [f"NIAH {c // 1024 if c % 1024 == 0 else c}{'K' if c % 1024 == 0 else ''} (n={n_at[c]})"
             for c in contexts]
    fp32 = [r for r in rows if r["method"] == "fp32"]
    rest = sorted((r for r in rows if r["method"] != "fp32"),
                  key=lambda r: (r["bits_per_element"] is None, r["bits_per_element"] or 0, r["method"]))

    def fmt(x, spec):
        return "–" if x is None else format(x, spec)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in fp32 + rest:
        err = res["layers"].get(r["method"], {}).get("attn_rel_err")
        dppl = None if not r["ppl"] or not r["ppl_fp32"] else 100 * (r["ppl"] / r["ppl_fp32"] - 1)
        dppl_text = "–" if r["method"] == "fp32" or dppl is None else f"{dppl:+.1f}%"
        nominal = METHODS.get(r["method"], {}).get("nominal_bits")
        cells = [r["method"], "32" if r["method"] == "fp32" else fmt(nominal, "g"),
                 "32" if r["method"] == "fp32" else fmt(r["bits_per_element"], ".3g"),
                 fmt(r["ppl"], ".2f"), dppl_text,
                 fmt(r["kl"], ".4f"), fmt(r["top1_agreement"], ".3f"),
                 fmt(float(np.mean(err)) if err else None, ".3f")]
        cells += [fmt(r["niah"].get(c), ".2f") for c in contexts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures(res: dict, model: str) -> dict:
    """The evaluation's charts as matplotlib figures, drawn from ``load_results`` output.

    Returns ``{"accuracy_vs_bits": Figure, "niah_vs_context": Figure}`` (the second only when there
    are needle results). The figures are built with the object-oriented API, so no pyplot backend is
    touched: they can be saved anywhere or shown inline in a notebook.
    """
    from matplotlib.figure import Figure

    rows = [r for r in summary_table(res) if r["method"] != "fp32"]
    out = {}
    fig = Figure(figsize=(15, 4.5))
    axes = fig.subplots(1, 3)
    for ax, key, label in ((axes[0], "ppl", "perplexity"), (axes[1], "kl", "KL(fp32 || quantized) per token"),
                           (axes[2], "top1_agreement", "top-1 agreement with fp32")):
        for r in rows:
            if r["bits_per_element"] is None or r[key] is None:
                continue
            ax.scatter(r["bits_per_element"], r[key], s=25)
            ax.annotate(r["method"], (r["bits_per_element"], r[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if key == "ppl" and "fp32" in res["lm"]:
            ax.axhline(res["lm"]["fp32"]["ppl"], color="black", lw=1, ls="--", label="fp32")
            ax.legend(fontsize=8)
        if key in ("ppl", "kl"):
            ax.set_yscale("log")
        ax.set_xlabel("stored bits per element (incl. 16-bit band)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{model}: quality vs stored bits")
    fig.tight_layout()
    out["accuracy_vs_bits"] = fig
    acc = niah_accuracy(res["niah"])
    if acc:
        # a method x context grid with the accuracy written in each cell: with ~18 methods and
        # one-seed cells, overlapping lines would hide most of them
        from .methods import METHODS

        counts = niah_counts(res["niah"])
        contexts = sorted({c for by in acc.values() for c in by})
        methods = sorted(acc, key=lambda m: (m != "fp32", METHODS.get(m, {}).get("nominal_bits", 32.0), m))
        grid = np.array([[acc[m].get(c, np.nan) for c in contexts] for m in methods])
        fig = Figure(figsize=(2.2 + 1.3 * len(contexts), 1.2 + 0.32 * len(methods)))
        ax = fig.subplots()
        im = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        for i in range(len(methods)):
            for j in range(len(contexts)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                            color="black" if grid[i, j] > 0.6 else "white")
        n_at = [min(by.get(c, 0) for by in counts.values()) for c in contexts]
        ax.set_xticks(range(len(contexts)), [f"{c}\n(n={n})" for c, n in zip(contexts, n_at)])
        ax.set_yticks(range(len(methods)),
                      [m if m == "fp32" else f"{m} ({METHODS.get(m, {}).get('nominal_bits', float('nan')):g} b)"
                       for m in methods])
        ax.set_xlabel("context (tokens); n = needle cells averaged")
        fig.colorbar(im, ax=ax, label="needle accuracy")
        ax.set_title(f"{model}: needle-in-a-haystack accuracy vs context")
        fig.tight_layout()
        out["niah_vs_context"] = fig
    return out


def plot_results(folder, model: str, prefix, methods=None) -> list[Path]:
    """Write ``PREFIX_accuracy_vs_bits.png`` and ``PREFIX_niah_vs_context.png`` (see ``figures``;
    ``methods`` as in ``load_results``)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(load_results(folder, model, methods), model).items():
        path = Path(f"{prefix}_{name}.png")
        fig.savefig(path, dpi=110, metadata={"Software": None})
        paths.append(path)
    return paths
