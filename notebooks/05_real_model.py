# %% [markdown]
# # 05 · Real-model evaluation on SmolLM2-135M
#
# The full grid is one command, `make eval`, which runs
# `kvq-eval run --model smollm2 --methods default --ctx 1024,2048,4096,8192 --seeds 0,1 --calib-tokens 4096`
# (the calibrated methods are fitted on 2 × 4096 tokens). Its JSON results are committed under
# `results/eval/smollm2/`. This notebook reads them, then runs one short
# live evaluation: perplexity against fp32 on 256 held-out tokens, and a needle at 1K tokens.

# %%
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: F401  (in Jupyter: inline display of the figures below)

from kvq_eval.plot import figures, load_results, summary_table

RESULTS = Path("results/eval")
FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)
if (RESULTS / "smollm2").is_dir():
    res = load_results(RESULTS, "smollm2")
    rows = summary_table(res)
    contexts = sorted({c for r in rows for c in r["niah"]})
    print(f"{'method':12s} {'bits':>6s} {'ppl':>8s} {'KL':>8s} {'top-1':>6s}  " +
          " ".join(f"{c:>6d}" for c in contexts))
    for r in rows:
        bits = f"{r['bits_per_element']:.2f}" if r["bits_per_element"] else "16+"
        ppl = f"{r['ppl']:.2f}" if r["ppl"] else "-"
        kl = f"{r['kl']:.4f}" if r["kl"] is not None else "-"
        top1 = f"{r['top1_agreement']:.3f}" if r["top1_agreement"] is not None else "-"
        print(f"{r['method']:12s} {bits:>6s} {ppl:>8s} {kl:>8s} {top1:>6s}  " +
              " ".join(f"{r['niah'].get(c, float('nan')):6.2f}" for c in contexts))
    charts = figures(res, "smollm2")
    for name, fig in charts.items():
        fig.savefig(FIG / f"05_{name}.png", dpi=90)
else:
    charts = {}
    print("no committed results yet: run `make eval`")

# %% [markdown]
# Quality against stored bits. The stored bits include each method's 16-bit band, which is why
# they sit above the nominal rates at these short contexts.

# %%
charts.get("accuracy_vs_bits")

# %% [markdown]
# Needle accuracy against context length (mean over needle variants and depths).

# %%
charts.get("niah_vs_context")

# %% [markdown]
# ## One live run
# The evaluator loads the float32 model from its cache. Each method quantizes K and V the
# moment they are written, keeping the method's 16-bit band.

# %%
from kvq_eval.runner import Evaluator

ev = Evaluator("smollm2", calibrate=False)
for method in ("fp32", "tq_mse4", "tq_mse2", "kivi4"):
    r = ev.lm(method, tokens=256, chunks=1)
    print(f"{method:8s} perplexity {r['ppl']:7.3f} (fp32 {r['ppl_fp32']:.3f})  KL {r['kl']:.4f}  "
          f"top-1 {r['top1_agreement']:.3f}")
cell = ev.niah(["fp32", "tq_mse4", "tq_mse2"], 1024, "single", 0.5, 1)
print("needle", cell["values"], {m: (x["score"], x["answer"].strip()[:20]) for m, x in cell["results"].items()})
