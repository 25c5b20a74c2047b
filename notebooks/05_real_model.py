# %% [markdown]
# # 05 · Real-model evaluation on SmolLM2-135M
#
# The grid is one command, `make eval` (`kvq-eval run ... --out results/eval_v2`, every method
# with the same 16-bit band, `--band none` and `--band 64,256`, sampled needles at 1K/4K/8K and
# perplexity windows of 1K and 8K tokens). Its JSON results are committed under
# `results/eval_v2/smollm2/`. This notebook reads them (table with intervals, quality against
# stored bits), then runs one short live evaluation.

# %%
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: F401  (in Jupyter: inline display of the figures below)

from kvq_eval.plot import figures, load_results, markdown_table

RESULTS = Path("results/eval_v2")
FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)
if (RESULTS / "smollm2").is_dir():
    res = load_results(RESULTS, "smollm2")
    print(markdown_table(res, "single"))  # one needle variant: exact match is not comparable across them
    charts = figures(res, "smollm2")
    for name, fig in charts.items():
        fig.savefig(FIG / f"05_{name}.png", dpi=90)
else:
    charts = {}
    print("no committed results yet: run `make eval`")

# %% [markdown]
# Quality against the stored bits as the cache holds them (band and calibrated tables included),
# with 95 % intervals: bootstrap over perplexity windows, Wilson for needle exact match, and a
# paired bootstrap for the answer's log-probability change against fp32 (the third panel).

# %%
charts.get("quality_vs_bits")

# %% [markdown]
# ## One live run
# The evaluator loads the float32 model from its cache. Each method quantizes K and V the moment
# they are written; the band (here none, then the first 16 and last 64 tokens in 16 bits) is a
# run setting shared by every method.

# %%
import math

from kvq_eval.band import Band
from kvq_eval.runner import Evaluator

ev = Evaluator("smollm2", calibrate=False)
for method in ("tq_mse4", "tq_mse2"):
    for band in (Band(0, 0), Band(16, 64)):
        r = ev.ppl(method, band, tokens=256, windows=1)
        w = r["windows"][0]
        print(f"{method:8s} band {band.label:6s} stored bits {r['bits_per_element']:.2f}  "
              f"Δppl {100 * math.expm1((w['nll_q'] - w['nll_f']) / w['n']):+.2f}%  KL {w['kl'] / w['n']:.4f}")
cell = ev.niah(["fp32", "tq_mse4@none", "tq_mse2@none"], "single", 1024, 0.5, 1)
print("needle", cell["values"], {e: (x["exact"], round(x["logprob"], 2), x["answer"].strip()[:20])
                                 for e, x in cell["results"].items()})
