"""The evaluation's streaming simulation: the fast form against the dense definition, and its noise floor.

Run from the repository root (needs the evaluation extra and the SmolLM2 wheel; about 5 minutes
on 2 cores)::

    python benchmarks/eval_simulate.py [--tokens 8192] [--out benchmarks/results/eval_simulate.json]

Why
---
Perplexity at 8K-token windows (``kvq-eval run --ppl-windows 8192x4``) spends most of its time in
``kvq_eval.hooks``' teacher-forced simulation. ``simulate_dense`` (``SIMULATION`` 1) forms (g * 1024,
T) float64 arrays per query block and scores every key, future ones included; ``_simulate``
(``SIMULATION`` 2) scores the middle through the method's effective keys with torch's CPU
flash-attention kernel (float64) and the band separately, merged by log-sum-exp. Both run here on
the same captured layers (same run, so the ratio is the result, not the seconds):

* ``layers``: seconds per layer for both forms, their ratio and the largest output difference
  relative to the output scale, for a few layers, methods and bands at ``--tokens`` and 2048
  (the 2048-token q/k/v are the prefix of the long capture: attention is causal);
* ``noise_floor``: one 1024-token held-out window's mean NLL through the whole model with each
  form. The two agree to a float32 ulp per layer, yet the NLL moves: an ulp flips a few
  quantization codes in later layers. Set beside each method's NLL cost, this is how far apart
  two equally valid simulations are, the resolution of any single-window comparison.

Nothing asserts on the outcome.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

LAYERS = (0, 15)
CONFIGS = (("tq_mse4", "none"), ("tq_mse4", "64,256"), ("kivi4", "none"))
NOISE = ("tq_mse4", "tq_mse3", "kivi2")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results/eval_simulate.json")
    args = ap.parse_args(argv)

    import torch

    from kvq_eval.band import parse_band
    from kvq_eval.calib import token_chunks
    from kvq_eval.hooks import SIMULATION, _simulate, session, simulate_dense
    from kvq_eval.runner import Evaluator
    from kvq_eval.scores import window_stats
    from kvq_eval.text import part

    torch.set_grad_enabled(False)
    ev = Evaluator("smollm2", calibrate=False)
    ids = token_chunks(ev.tok, part("heldout"), args.tokens, 1)[0]
    with session("capture") as cap:
        ev.model(ids)
    scaling = ev.model.model.layers[0].self_attn.scaling
    rows = []
    for tokens in (2048, args.tokens):
        for layer in LAYERS:
            q, k, v = (torch.from_numpy(x[:, :tokens].copy())[None] for x in cap.captured[layer][0])
            module = SimpleNamespace(layer_idx=layer, sliding_window=None)
            for method, band in CONFIGS:
                spec = ev.spec(method, parse_band(band))
                t0 = time.perf_counter()
                dense, _ = simulate_dense(module, q, k, v, scaling, spec)
                t1 = time.perf_counter()
                fast, _ = _simulate(module, q, k, v, scaling, spec)
                t2 = time.perf_counter()
                rows.append({"tokens": tokens, "layer": layer, "method": method, "band": band,
                             "dense_s": t1 - t0, "fast_s": t2 - t1, "speedup": (t1 - t0) / (t2 - t1),
                             "max_rel_diff": float((fast - dense).abs().max() / dense.abs().max())})
                print(json.dumps(rows[-1]), flush=True)
    del cap
    window = token_chunks(ev.tok, part("heldout"), 1024, 1)[0]
    ref = ev._reference(window)
    noise = []
    for method in NOISE:
        spec = ev.spec(method, parse_band("none"))
        row = {"method": method, "tokens": 1024}
        for name, dense in (("fast", False), ("dense", True)):
            with session("simulate", spec, dense=dense):
                out = ev.model(window).logits[0, :-1]
            s = window_stats(ref, out, window[0, 1:])
            row[f"nll_{name}"], row["nll_fp32"] = s["nll_q"] / s["n"], s["nll_f"] / s["n"]
        row["cost"] = row["nll_fast"] - row["nll_fp32"]
        row["fast_minus_dense"] = row["nll_fast"] - row["nll_dense"]
        noise.append(row)
        print(json.dumps(row), flush=True)
    speed = [r["speedup"] for r in rows if r["tokens"] == args.tokens]
    res = {"benchmark": "eval_simulate", "simulation": SIMULATION, "tokens": args.tokens,
           "machine": {"cpu_count": torch.get_num_threads(), "python": platform.python_version(),
                       "torch": torch.__version__},
           "layers": rows, "median_speedup": float(np.median(speed)), "noise_floor": noise}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"median speedup at {args.tokens} tokens: {res['median_speedup']:.1f}x -> {out}")
    return res


if __name__ == "__main__":
    main()
