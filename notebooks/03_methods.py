# %% [markdown]
# # 03 · Every method on the same vectors
#
# `kvq_ref` is the specification of each method. This notebook runs every method on the same
# vectors and reports, for each one, the stored bits per element (computed from the bytes
# actually stored), the reconstruction error and the inner-product error. It also decodes an
# example and lays out the bytes of a turbo3 block.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvq_ref import (KIVI, QJL, PolarQuant, QuaRot, TurboBlock, TurboQuantMSE, TurboQuantProd, TurboQuantSplit)

rng = np.random.default_rng(0)
d, n = 128, 512
keys = rng.standard_normal((n, d)) * np.linspace(0.3, 2.0, d)  # uneven channels, like real keys
queries = rng.standard_normal((8, d))
FIG = Path("out/notebooks")
FIG.mkdir(parents=True, exist_ok=True)

methods = {
    "TurboQuantMSE 2": TurboQuantMSE(d, 2),
    "TurboQuantMSE 3": TurboQuantMSE(d, 3),
    "TurboQuantMSE 4": TurboQuantMSE(d, 4),
    "TurboQuantProd 3": TurboQuantProd(d, 3),
    "TurboQuant 2.5 (split)": TurboQuantSplit.calibrate(keys, 2.5),
    "QJL keys": QJL(d),
    "PolarQuant": PolarQuant(d),
    "KIVI-2 keys": KIVI(d, 2, "key", group=32, residual=32),
    "QuaRot INT2": QuaRot(d, 2),
    "turbo3": TurboBlock("turbo3"),
    "turbo4": TurboBlock("turbo4"),
}

# %%
truth = queries @ keys.T
rows = []
print(f"{'method':24s} {'bits/elem':>9s} {'rel. MSE':>9s} {'logit RMSE':>10s}")
for name, m in methods.items():
    enc = m.encode(keys)
    rel = np.sum((m.decode(enc) - keys) ** 2) / np.sum(keys**2)
    err = np.sqrt(np.mean((m.inner_product(queries, enc) - truth) ** 2))
    rows.append((name, enc.bits_per_element, rel, err))
    print(f"{name:24s} {enc.bits_per_element:9.3f} {rel:9.4f} {err:10.3f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
for ax, col, label in ((axes[0], 2, "relative reconstruction MSE"), (axes[1], 3, "logit RMSE")):
    for row in rows:
        ax.scatter(row[1], row[col])
        below = row[0].startswith("turbo")  # turbo3/4 sit on TurboQuantMSE 3/4: label them underneath
        ax.annotate(row[0], (row[1], row[col]), fontsize=7, xytext=(3, -10 if below else 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per element")
    ax.set_ylabel(label)
fig.suptitle(f"every kvq_ref method on the same {n} keys, d={d}")
fig.tight_layout()
fig.savefig(FIG / "03_methods.png", dpi=90)

# %% [markdown]
# ## A decoded example

# %%
q = TurboQuantMSE(d, 3)
enc = q.encode(keys[:1])
print("first 6 coordinates:", np.round(keys[0, :6], 3))
print("decoded (3 bits):   ", np.round(q.decode(enc)[0, :6], 3))
print("stored:", {k: (v.dtype.name, v.shape) for k, v in enc.arrays.items()})

# %% [markdown]
# ## The turbo3 byte layout
# docs/references/turboquant.md (the fork's block formats): an fp16 scale, then `qs[32]` with the low 2 bits of each 3-bit index
# (element j at bits 2·(j%4) of byte j/4), then `signs[16]` with the high bits (bit j%8 of byte
# j/8). Total 50 bytes per 128 values, 3.125 bits per value.

# %%
tb = TurboBlock("turbo3")
raw = tb.to_bytes(tb.encode(keys[:1]))
print(len(raw), "bytes:", raw[:2].hex(), "| qs:", raw[2:34].hex()[:32], "... | signs:", raw[34:50].hex())
idx, scales = tb.unpack(np.frombuffer(raw, dtype=np.uint8)[None])
print("first 8 indices:", idx[0, :8], " scale (fp16):", scales[0])
