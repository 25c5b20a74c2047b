# %% [markdown]
# # 06 · Kernels that read the tables
#
# The Triton kernels in `gpu/` take their codebooks from the exported table files. Their
# rotations and layouts come from `kvq_ref`. On a CPU, `TRITON_INTERPRET=1` runs them as
# NumPy, which is enough to check them against the reference. The timings below come from
# `gpu/bench.py` on a GPU machine (`results/gpu/*.json`) when such a run has been committed.

# %%
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
import json
from pathlib import Path

import numpy as np
import torch

from gpu.tables import TableMismatchError, load_device_table
from gpu.triton.attention import decode_attention_mse
from gpu.triton.quantize import quantize_mse
from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode

# %% [markdown]
# ## Quantize: bit-exact against the reference

# %%
d, bits = 128, 3
q = TurboQuantMSE(d, bits)
table = load_device_table(d, bits)  # the shipped table set, validated (schema, checksums)
x = np.random.default_rng(0).standard_normal((54, d)).astype(np.float16)
packed, norms = quantize_mse(torch.from_numpy(x), q, table)
ref = q.encode(x)
print("codes identical:", np.array_equal(packed.numpy(), ref.arrays["codes"]),
      " norms identical:", np.array_equal(norms.numpy(), ref.arrays["norms"]))
try:
    quantize_mse(torch.from_numpy(x), TurboQuantMSE(d, 4), table)
except TableMismatchError as exc:
    print("refused before launch:", exc)

# %% [markdown]
# ## Fused decode attention against `kvq_ref.attention_decode`

# %%
rng = np.random.default_rng(1)
K, V = rng.standard_normal((2, 97, d))
cache = QuantizedKV.build(K, V, q, q)
qry = rng.standard_normal((3, d))
want = attention_decode(qry, cache)
ek, ev = cache.keys, cache.values
got = decode_attention_mse(torch.tensor(qry, dtype=torch.float32), torch.from_numpy(ek.arrays["codes"]),
                           torch.from_numpy(ek.arrays["norms"]), torch.from_numpy(ev.arrays["codes"]),
                           torch.from_numpy(ev.arrays["norms"]), q, q, table, table).numpy()
print("relative error vs reference:", float(np.linalg.norm(got - want) / np.linalg.norm(want)))

# %% [markdown]
# ## GPU timings (from results JSON, when present)

# %%
runs = sorted(p for p in Path("results/gpu").glob("bench_*.json") if "dryrun" not in p.name)
if not runs:
    print("no GPU run committed yet: `python gpu/bench.py` on a CUDA machine writes results/gpu/")
for path in runs:
    r = json.loads(path.read_text())
    # the reference bandwidth: the faster of the copy and FlashAttention's read (gpu/bench.py)
    ref = max([r["copy_bandwidth_gbs"]] + [row["sdpa_bandwidth_gbs"] for row in r["decode"]
                                           if row["sdpa_bandwidth_gbs"] == row["sdpa_bandwidth_gbs"]])
    print(f"{path.name}: {r['device']}, copy {r['copy_bandwidth_gbs']:.0f} GB/s, reference {ref:.0f} GB/s")
    for row in r["decode"]:
        print(f"  batch {row.get('batch', 1):>2} ctx {row['context']:>6} {row['bits']} bits: "
              f"{row['bandwidth_gbs'] / ref:.0%} of reference bw, x{row['speedup_vs_sdpa']:.2f} vs fp16 SDPA")
