# %% [markdown]
# # 04 · NOVA-KV on SmolLM2's own attention
#
# We capture SmolLM2-135M's post-RoPE Q/K/V exactly, calibrate NOVA-KV on the calibration part of
# the text, then look at three things: the key transform's coefficient spectrum, the equal-volume
# groups, and the held-out logit MSE of NOVA-KV against rotation-based quantizers at about
# 2 bits. To keep the notebook short, only two layers are calibrated here. The evaluation
# (notebook 05) calibrates every layer.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from codebooks import equal_volume_groups
from codebooks.nova import calibrate
from kvq_ref import QuaRot, TurboQuantMSE
from kvq_eval.calib import capture, token_chunks
from kvq_eval.models import load_model
from kvq_eval.text import part
from kvq_ref.nova import NovaKV, Oscar

FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)
model, tok, info = load_model("smollm2")
layers = (3, 20)
calib = [capture(model, ids) for ids in token_chunks(tok, part("calibration"), 512, 2)]
held = capture(model, token_chunks(tok, part("evaluation"), 512, 1)[0])
stats, nova = calibrate([{l: s[l] for l in layers} for s in calib], info.head_dim, iterations=10)
print(f"calibrated {len(nova.heads)} heads; Sigma_q eigenvalues floored: "
      f"{[nova.head(l, 0).key.n_floored for l in layers]}")

# %% [markdown]
# ## The key transform's spectrum
# The coefficient variances λ are the eigenvalues of Σ_q^½ C_k Σ_q^½. Their spread tells how
# unevenly the queries look at the keys, and so how much there is to gain from bits placed where
# they look.

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
for l in layers:
    lam = nova.head(l, 0).key.variances
    axes[0].semilogy(lam, label=f"layer {l}, KV head 0")
    print(f"layer {l:2d}: lambda max/median/min = {lam[0]:.3g} / {np.median(lam):.3g} / {lam[-1]:.3g}"
          f"  (top 8 hold {lam[:8].sum() / lam.sum():.0%} of the logit energy)")
axes[0].set_xlabel("coefficient")
axes[0].set_title("key-transform coefficient variances λ")
axes[0].legend()

# %% [markdown]
# ## Equal-volume groups
# Each group of 4 coefficients gets one 256-entry codebook. Groups with equal products of
# variances are the ones at which a fixed-rate code reaches the variable-rate optimum; the gap is
# the AM/GM excess.

# %%
lam = np.maximum(nova.head(layers[0], 0).key.variances, 1e-300)
for method in ("consecutive", "round_robin", "greedy", "swap"):
    grouping = equal_volume_groups(lam, 4, method)
    axes[1].plot(np.sort(grouping.log_volumes), ".-", label=f"{method} (gap {grouping.gap:.3f})")
    print(f"{method:12s} gap {grouping.gap:.4f}")
axes[1].set_xlabel("group (sorted)")
axes[1].set_ylabel("group log volume (mean ln λ)")
axes[1].set_title(f"groups of 4, layer {layers[0]}")
axes[1].legend(fontsize=8)

# %% [markdown]
# ## Held-out logit MSE at about 2 bits

# %%
results = {}
for l in layers:
    q, k, v = (x.astype(np.float64) for x in held[l])
    d = k.shape[-1]
    qq = q[0:3, -64:].reshape(-1, d)  # the GQA group of KV head 0, last 64 positions
    truth = qq @ k[0].T
    for name, m in {"NOVA-KV": NovaKV(nova.head(l, 0), "key"), "OSCAR": Oscar(nova.head(l, 0), "key"),
                    "TurboQuantMSE-2": TurboQuantMSE(d, 2), "QuaRot INT2": QuaRot(d, 2, group=d)}.items():
        enc = m.encode(k[0])
        mse = np.mean((m.inner_product(qq, enc) - truth) ** 2)
        results.setdefault(name, []).append(mse)
        print(f"layer {l:2d} {name:16s} {enc.bits_per_element:5.3f} bits  logit MSE {mse:9.4f}")
width = 0.8 / len(results)
for i, (name, mses) in enumerate(results.items()):
    axes[2].bar(np.arange(len(layers)) + i * width, mses, width, label=name)
axes[2].set_xticks(np.arange(len(layers)) + 0.4 - width / 2, [f"layer {l}" for l in layers])
axes[2].set_yscale("log")
axes[2].set_title("held-out logit MSE at ≈2 bits")
axes[2].legend(fontsize=8)
fig.tight_layout()
fig.savefig(FIG / "04_nova_kv.png", dpi=90)
