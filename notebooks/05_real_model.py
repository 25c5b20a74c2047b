# %% [markdown]
# # 05 · Real-model evaluation on SmolLM2-135M
#
# The grid is one command, `make eval` (`kvq-eval run ... --out results/eval_v3`, protocol v3: every
# method with the same 16-bit band, `--band none` and `--band 64,256`, single-needle tests of 30
# prompts at 1K, 4K and 8K tokens, perplexity on 8 windows of 1K and 7 held-out windows of 8K tokens,
# disjoint texts). Its JSON results are committed under `results/eval_v3/smollm2/` as they are
# computed. This notebook reads them (which setting to deploy, the table with intervals, quality
# against stored bits), then runs one short live evaluation.

# %%
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: F401  (in Jupyter: inline display of the figures below)

from kvq_eval.plot import figures, load_results, markdown_table
from kvq_eval.recommend import recommend_table

RESULTS = Path("results/eval_v3")
FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)
if (RESULTS / "smollm2").is_dir():
    res = load_results(RESULTS, "smollm2")
    # the cheapest stored-bits setting within 0.5 / 1 / 3 % perplexity of fp32 at 8K tokens (the upper
    # end of its interval), with and without a 16-bit band: the README's "which setting" table
    print(recommend_table(res))
    print(markdown_table(res, "single"))
    charts = figures(res, "smollm2")
    for name, fig in charts.items():
        fig.savefig(FIG / f"05_{name}.png", dpi=90)
else:
    charts = {}
    print("no committed results yet: run `make eval`")

# %% [markdown]
# Quality against the stored bits as the cache holds them (band and calibrated tables included),
# with 95 % intervals: a Student t interval over the perplexity windows (the window is the
# statistical unit), Wilson's for needle exact match, and a paired t interval over the 30 prompts for
# the answer's log-probability change against fp32.

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
