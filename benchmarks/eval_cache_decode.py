"""The evaluation's cache-mode decoding: growing buffers against per-step concatenation.

Run from the repository root (needs the evaluation extra and the SmolLM2 wheel; 71 s on 2 cores
here, the JSON's ``runtime_seconds``)::

    python benchmarks/eval_cache_decode.py [--contexts 2048,8192] [--steps 24]
        [--out benchmarks/results/eval_cache_decode.json]

Why
---
Needle cells decode a few dozen tokens over a ``kvq_eval.hooks.QuantizedCache`` holding an exact
prefill of up to 8K tokens. Each decode step used to copy every cached state: the store
concatenated each head's decoded float32 middle rows (and the float64 query matmul cast them
again), and transformers' ``DynamicLayer`` concatenated every layer's full-precision keys and
values. Today the store keeps decoded rows in a capacity-doubling float64 buffer (``_Rows``) and
the cache replicates a ``DynamicLayer`` whose states are prefix views of capacity-doubling buffers
(``_GrowingLayer``); a needle entry also encodes the prefill once and ``fork``s it instead of a
second ``from_cache``.

Both forms run here in one process on the same prefill (so the ratio is the result, not the
seconds): the ``concat`` baseline is today's ``QuantizedCache`` with the old behaviour put back
(stock ``DynamicLayer``, float32 rows concatenated at each write, as before commit 1776671), the
``buffers`` form is the shipped one. Per context it records

* ``step_s``: the median seconds of one teacher-forced decode step (one token, every layer) over
  ``--steps`` steps, for both forms, and ``speedup`` = concat / buffers;
* ``identical``: whether every step's logits are bit-for-bit equal between the forms (the float64
  buffer holds the float32 reconstructions exactly, so they must be);
* ``from_cache_s`` / ``fork_s``: encoding the prefill into a quantized cache against copying one
  already encoded (what a needle entry's second, teacher-forced pass now does).

``OMP_WAIT_POLICY`` (``kvq-eval`` defaults it to PASSIVE) is recorded, not varied: it is read once
when torch loads. Nothing asserts on the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

METHOD, BAND = "tq_mse3", "64,256"


class _ConcatRows:
    """The old decoded-rows store: a float32 array concatenated at every write."""

    def __init__(self, d: int):
        self.rows = np.empty((0, d), np.float32)

    def append(self, x: np.ndarray) -> None:
        self.rows = np.concatenate([self.rows, x])


def _concat_cache_class():
    from transformers.cache_utils import DynamicLayer

    from kvq_eval.hooks import QuantizedCache, _Store

    class ConcatCache(QuantizedCache):
        """``QuantizedCache`` with per-step concatenation (stock layers, float32 rows)."""

        def __init__(self, spec, **kwargs):
            super().__init__(spec, **kwargs)
            self.layer_class_to_replicate = DynamicLayer

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in self.stores:
                n_heads, d = key_states.shape[1], key_states.shape[-1]
                store = _Store(self.spec, layer_idx, n_heads, d)
                store.dec_k = [_ConcatRows(d) for _ in range(n_heads)]
                store.dec_v = [_ConcatRows(d) for _ in range(n_heads)]
                self.stores[layer_idx] = store
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return ConcatCache


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default="benchmarks/results/eval_cache_decode.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as kvq-eval does, before torch loads

    import torch

    from kvq_eval.band import parse_band
    from kvq_eval.calib import token_chunks
    from kvq_eval.hooks import QuantizedCache, cache_kwargs, session
    from kvq_eval.runner import Evaluator
    from kvq_eval.text import part

    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    ev = Evaluator("smollm2", calibrate=False)
    spec = ev.spec(METHOD, parse_band(BAND))
    forms = {"concat": _concat_cache_class(), "buffers": QuantizedCache}
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = token_chunks(ev.tok, part("heldout"), ctx + args.steps, 1)[0]
        base, _ = ev._prefill(ids[:, :ctx])
        row = {"context": ctx, "steps": args.steps}
        logits = {}
        for name, cls in forms.items():
            t0 = time.perf_counter()
            cache = cls.from_cache(base, spec)
            t1 = time.perf_counter()
            fork = cache.fork()
            t2 = time.perf_counter()
            del fork
            times, out = [], []
            for i in range(ctx, ctx + args.steps):
                t = time.perf_counter()
                with session("cache", spec, cache):
                    out.append(ev.model(ids[:, i:i + 1], **cache_kwargs(ev.model, cache), use_cache=True).logits[0, -1])
                times.append(time.perf_counter() - t)
            logits[name] = torch.stack(out)
            row[name] = {"from_cache_s": t1 - t0, "fork_s": t2 - t1, "step_s": float(np.median(times)),
                         "step_s_all": times}
            del cache
        row["speedup"] = row["concat"]["step_s"] / row["buffers"]["step_s"]
        row["identical"] = bool(torch.equal(logits["concat"], logits["buffers"]))
        row["from_cache_over_fork"] = row["buffers"]["from_cache_s"] / row["buffers"]["fork_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in forms}), flush=True)
    res = {"benchmark": "eval_cache_decode", "model": "smollm2", "method": METHOD, "band": BAND,
           "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                       "python": platform.python_version(), "torch": torch.__version__},
           "contexts": rows, "runtime_seconds": time.perf_counter() - t_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    speed = ", ".join(f"{r['context']}: {r['speedup']:.1f}x" for r in rows)
    print(f"decode step speedup: {speed} -> {out}")
    return res


if __name__ == "__main__":
    main()
