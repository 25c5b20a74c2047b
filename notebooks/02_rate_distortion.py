# %% [markdown]
# # 02 · Rate-distortion: bounds, exact curves, and Monte Carlo
#
# `theory` turns TurboQuant's theorems into functions. This notebook puts the exact Lloyd-Max
# curve between the Shannon lower bound and the TurboQuant upper bound, compares fixed-rate with
# entropy-coded quantization, and checks the inner-product bias and the QJL variance with Monte
# Carlo overlays.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from codebooks import SphereMarginal, lloyd_max
from theory import (ECSQ_CONSTANT, TQ_CONSTANT, bias_factor, entropy_coded_curve, lloyd_max_curve, panter_dite,
                    qjl_variance, shannon_lower_bound, turboquant_mse_bound)

FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)
d = 128
bits = np.arange(1, 11)

# %% [markdown]
# ## Distortion vs bits, and the gap to the lower bound

# %%
lm = lloyd_max_curve(SphereMarginal(d), bits)
ec = entropy_coded_curve(SphereMarginal(d), bits.astype(float))
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
axes[0].fill_between(bits, shannon_lower_bound(bits.astype(float)), turboquant_mse_bound(bits.astype(float)),
                     alpha=0.15, label="between the bounds")
axes[0].semilogy(bits, lm, "o-", label=f"Lloyd-Max, d={d}")
axes[0].semilogy(bits, ec, "s-", label="entropy-coded uniform")
axes[0].semilogy(bits, panter_dite(SphereMarginal(d), bits), ":", label="Panter-Dite")
axes[0].legend()
axes[1].plot(bits, lm * 4.0**bits, "o-", label="Lloyd-Max / SLB")
axes[1].plot(bits, ec * 4.0**bits, "s-", label="entropy-coded / SLB")
axes[1].axhline(TQ_CONSTANT, ls="--", color="gray", label="√3π/2")
axes[1].axhline(ECSQ_CONSTANT, ls=":", color="gray", label="πe/6")
axes[1].legend()
fig.tight_layout()
fig.savefig(FIG / "02_rate_distortion.png", dpi=90)
print("gap at 1 bit:", round(lm[0] * 4, 4), " at 10 bits:", round(lm[-1] * 4**10, 4), " limit:", round(TQ_CONSTANT, 4))

# %% [markdown]
# ## Inner-product bias of an MSE codebook, with Monte Carlo
# After a random rotation, E⟨y, x̂⟩ = β·⟨y, x⟩ with β = E[X·Q(X)]/E[X²] (d·E[X·Q(X)] for unit
# vectors). For the Gaussian at 1 bit β is 2/π. The Monte Carlo points are the regression slope
# of ⟨y, x̂⟩ on ⟨y, x⟩ over 20,000 rotated unit vectors, with ±2 standard errors.

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((20000, d))
x /= np.linalg.norm(x, axis=1, keepdims=True)  # uniform on the sphere: already "rotated"
y = rng.standard_normal(d)
y /= np.linalg.norm(y)
exact, mc, se = [], [], []
for b in bits[:6]:
    cb = lloyd_max(SphereMarginal(d), int(b))
    u, w = x @ y, cb.levels[cb.quantize(x)] @ y
    slope = np.dot(u, w) / np.dot(u, u)
    resid = w - slope * u
    exact.append(bias_factor(cb))
    mc.append(slope)
    se.append(np.sqrt(resid.var(ddof=1) / np.dot(u, u)))
    print(f"{b} bit(s): bias factor exact {exact[-1]:.5f}, Monte Carlo {slope:.5f} ± {2 * se[-1]:.5f}")

# %% [markdown]
# ## QJL estimator variance
# The variance of the estimator √(π/2)/m·‖k‖·⟨Sq, sign(Sk)⟩ is exactly
# ((π/2)‖q‖²‖k‖² − ⟨q,k⟩²)/m. Each Monte Carlo point is the sample variance over 2,000
# independent Gaussian sketches. Its ±2 standard errors use the sample fourth moment.

# %%
q, k = rng.standard_normal(32), rng.standard_normal(32)
ms = np.array([8, 16, 32, 64, 128])
var_exact, var_mc, var_se = [], [], []
for m in ms:
    S = rng.standard_normal((2000, m, 32))
    est = np.sqrt(np.pi / 2) / m * np.linalg.norm(k) * np.einsum("nmd,d,nm->n", S, q, np.sign(S @ k))
    c = est - est.mean()
    var_exact.append(qjl_variance(int(m), np.linalg.norm(q), np.linalg.norm(k), q @ k))
    var_mc.append(c.var(ddof=1))
    var_se.append(np.sqrt((np.mean(c**4) - c.var() ** 2) / len(c)))
    print(f"m={m:4d}: variance exact {var_exact[-1]:8.4f}  Monte Carlo {var_mc[-1]:8.4f} ± {2 * var_se[-1]:.4f}"
          f"  mean {est.mean():7.3f} vs <q,k> {q @ k:.3f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
axes[0].plot(bits[:6], exact, "-", label="exact β(b)")
axes[0].errorbar(bits[:6], mc, yerr=2 * np.array(se), fmt="o", label="Monte Carlo ± 2 SE")
axes[0].axhline(2 / np.pi, ls=":", color="gray", label="2/π")
axes[0].set_xlabel("bits")
axes[0].set_title(f"inner-product bias factor, d={d}")
axes[0].legend()
axes[1].loglog(ms, var_exact, "-", label="exact ((π/2)‖q‖²‖k‖² − ⟨q,k⟩²)/m")
axes[1].errorbar(ms, var_mc, yerr=2 * np.array(var_se), fmt="o", label="Monte Carlo ± 2 SE")
axes[1].set_xlabel("sketch size m")
axes[1].set_title("QJL estimator variance")
axes[1].legend(fontsize=8)
fig.tight_layout()
fig.savefig(FIG / "02_bias_and_variance.png", dpi=90)
