"""Rate-distortion figure drawn only from result JSON files (``kvq-theory plot``)."""

from __future__ import annotations

from pathlib import Path

from .results import Series, load_series

__all__ = ["plot_series", "plot_files", "PLOT_SUFFIXES"]

#: Image formats ``plot_series`` writes (the suffix decides; matplotlib would append ".png" to a
#: path without one, e.g. write ``DIR.png`` beside a folder named ``DIR``).
PLOT_SUFFIXES = (".png",)

_STYLE = {
    "lower_bound": dict(color="black", lw=1.2, ls="-"),
    "upper_bound": dict(lw=1.2, ls="--"),
    "approximation": dict(lw=1.0, ls=":"),
    "exact": dict(lw=1.6, ls="-", marker="o", ms=3),
    "monte_carlo": dict(lw=1.0, ls="-", marker="s", ms=3, capsize=2),
    "measured": dict(ls="none", marker="X", ms=8),
}


def _draw(ax, s: Series, y, label=None):
    style = dict(_STYLE[s.kind])
    label = label or s.name
    if s.kind == "monte_carlo" and s.y_err is not None:
        err = list(s.y_err)
        if y is not s.y:  # rescaled view: scale the error bars the same way
            err = [e * yy / y0 for e, yy, y0 in zip(s.y_err, y, s.y)]
        ax.errorbar(s.x, y, yerr=err, label=label, **style)
    else:
        style.pop("capsize", None)
        ax.plot(s.x, y, label=label, **style)


def plot_series(series: list[Series], out) -> Path:
    """Draw distortion vs bits (log), gap to the Shannon bound, inner product and bias panels.

    Panels appear for the quantities present. The band between the lower and upper bounds of the
    MSE panel is shaded. Measured points (audits of external tables) are drawn as crosses.

    Parameters
    ----------
    series : list of Series
    out : str or Path
        PNG path ending in .png (checked before drawing).

    Returns
    -------
    Path
    """
    from codebooks._atomic import check_output_file

    out = check_output_file(out, "out", PLOT_SUFFIXES)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_q: dict[str, list[Series]] = {}
    for s in series:
        by_q.setdefault(s.quantity, []).append(s)
    panels = []
    if "mse" in by_q:
        panels += ["mse", "gap"]
    panels += [q for q in ("inner_product", "bias") if q in by_q]
    ncols = 2
    nrows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(12, 4.6 * nrows), squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.ravel(), panels):
        group = by_q["mse" if panel == "gap" else panel]
        if panel in ("mse", "inner_product"):
            lows = [s for s in group if s.kind == "lower_bound"]
            highs = [s for s in group if s.kind == "upper_bound"]
            if lows and highs and lows[0].x == highs[0].x:
                ax.fill_between(lows[0].x, lows[0].y, highs[0].y, color="tab:blue", alpha=0.08,
                                label="between the bounds")
            for s in group:
                _draw(ax, s, s.y)
            ax.set_yscale("log")
            ax.set_ylabel("normalized MSE  E||x - x̂||²" if panel == "mse" else "d·E[(⟨y,x⟩-⟨y,x̂⟩)²]/||y||²")
            ax.set_title("distortion vs bits" if panel == "mse" else "inner-product distortion")
        elif panel == "gap":
            for s in group:
                _draw(ax, s, [y * 4.0**x for x, y in zip(s.x, s.y)])
            ax.set_ylabel("distortion / Shannon bound 4^-b")
            ax.set_title("gap to the lower bound")
        else:
            for s in group:
                _draw(ax, s, s.y)
            ax.set_ylabel("E[⟨y,x̂⟩] / ⟨y,x⟩")
            ax.set_title("inner-product bias of the MSE quantizer")
        ax.set_xlabel("bits per coordinate")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None}, format="png")
    plt.close(fig)
    return out


def plot_files(paths, out) -> Path:
    """Load JSON series from ``paths`` (``ResultsError`` on bad files) and plot them to ``out``."""
    return plot_series(load_series(paths), out)
