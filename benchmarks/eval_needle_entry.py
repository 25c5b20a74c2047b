"""A needle entry's encoding and attention: the fast forms against the ones they replaced.

Run from the repository root (seconds; the JSON's ``runtime_seconds``)::

    python benchmarks/eval_needle_entry.py [--tokens 8192] [--out benchmarks/results/eval_needle_entry.json]

Why
---
A needle entry encodes an exact prefill into a ``kvq_eval.hooks.QuantizedCache`` and then runs a
few dozen queries over it in float64; at 8K tokens the encoding and the teacher-forced pass's
attention were most of an entry. Three changes made them faster without changing a bit, and each
is timed here in one process against the form it replaced, on the same inputs (so the ratio is
the result, not the seconds), best of ``--repeats``:

* ``store_encode``: one layer's quantized store (``_Store.write``) for SmolLM2's shape (3 KV heads,
  d = 64) at ``--tokens`` tokens with TurboQuantMSE-3, the spec path (``q.encode``/``q.decode``)
  against ``kvq_ref.fast``'s fused kernels; ``identical``: codes, norms and decoded rows are equal;
* ``nova_nearest``: NOVA-KV's nearest-centroid search (groups of 4, 256 centroids) for
  ``--tokens`` tokens at d = 64 (SmolLM2) and 256 (Gemma-3), the general kernel (one token's K
  distances, then a scan) against the 16-token SIMD kernel for g = 4; ``identical``: the same codes;
* ``masked_softmax``: the attention weights of 3 x 49 queries (SmolLM2's group times a
  teacher-forced answer) over ``--tokens`` keys, ``_softmax(np.where(ok, z * s, -inf))`` in fresh
  arrays against ``_masked_softmax`` in place; ``identical``: bit for bit.

The one-minute load average is recorded: the ratios hold on a loaded machine, the seconds do not.
Nothing asserts on the outcome; the tests that pin the equalities are in
``tests/kvq_eval/test_simulate.py`` and ``tests/kvq_ref/test_nova.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def _best(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _row(name: str, seconds: dict, identical: bool, **extra) -> dict:
    old, new = list(seconds)  # the replaced form first
    row = {"case": name, **extra, "seconds": seconds, "speedup": seconds[old] / seconds[new], "identical": identical}
    print(json.dumps(row), flush=True)
    return row


def _store_encode(tokens: int, repeats: int) -> dict:
    import kvq_eval.hooks as hooks
    from kvq_eval.methods import make_spec

    spec = make_spec("tq_mse3")
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, tokens, 64)) * np.exp(rng.normal(0, 0.5, 64))
    v = rng.standard_normal((3, tokens, 64))
    fused = hooks._fused

    def build(use_fused):
        hooks._fused = fused if use_fused else (lambda q: False)
        try:
            store = hooks._Store(spec, 0, 3, 64)
            store.write(k, v)
            return store
        finally:
            hooks._fused = fused

    build(True)  # compile and load the Numba kernels outside the timing
    seconds, stores = {}, {}
    for form, use in (("spec", False), ("fused", True)):
        seconds[form], stores[form] = _best(lambda: build(use), repeats)
    a, b = stores["spec"], stores["fused"]
    same = all(np.array_equal(x.arrays[n], y.arrays[n]) for h in range(3)
               for x, y in ((a.enc_k[h], b.enc_k[h]), (a.enc_v[h], b.enc_v[h])) for n in x.arrays)
    same &= all(np.array_equal(x.rows, y.rows) for h in range(3) for x, y in ((a.dec_k[h], b.dec_k[h]), (a.dec_v[h], b.dec_v[h])))
    return _row("store_encode", seconds, bool(same), method="tq_mse3", heads=3, d=64, tokens=tokens)


def _nova_nearest(tokens: int, d: int, repeats: int) -> dict:
    from kvq_ref.nova import _nearest_centroids, _nearest_g4

    rng = np.random.default_rng(d)
    shapes = rng.standard_normal((tokens, d))
    groups = rng.permutation(d).reshape(d // 4, 4).astype(np.int64)
    by_coordinate = np.ascontiguousarray(rng.standard_normal((d // 4, 4, 256)).astype(np.float32).astype(np.float64))
    seconds, codes = {}, {}
    for form, kernel in (("general", _nearest_centroids), ("g4", _nearest_g4)):
        def run():
            out = np.empty((tokens, d // 4), np.uint8)
            kernel(shapes, groups, by_coordinate, out)
            return out

        run()  # compile or load the kernel outside the timing
        seconds[form], codes[form] = _best(run, repeats)
    return _row("nova_nearest", seconds, bool(np.array_equal(codes["general"], codes["g4"])), d=d, g=4,
                centroids=256, tokens=tokens)


def _masked_softmax(tokens: int, repeats: int) -> dict:
    from kvq_eval.hooks import _masked_softmax, _softmax

    rng = np.random.default_rng(1)
    rows, queries = 3 * 49, 49
    z = rng.standard_normal((rows, tokens)) * 4.0
    q_pos = np.arange(tokens - queries, tokens)
    ok = np.tile(np.arange(tokens)[None, :] <= q_pos[:, None], (3, 1))
    seconds, p = {}, {}
    seconds["fresh"], p["fresh"] = _best(lambda: _softmax(np.where(ok, z * 0.125, -np.inf)), repeats)
    seconds["in_place"], p["in_place"] = _best(lambda: _masked_softmax(z.copy(), ok, 0.125), repeats)
    return _row("masked_softmax", seconds, bool(np.array_equal(p["fresh"], p["in_place"])), rows=rows,
                tokens=tokens, note="in_place includes copying z (attend fills a fresh z anyway)")


def main(argv=None) -> dict:
    import numba

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/eval_needle_entry.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [_store_encode(args.tokens, args.repeats),
            _nova_nearest(args.tokens, 64, args.repeats), _nova_nearest(args.tokens, 256, args.repeats),
            _masked_softmax(args.tokens, args.repeats)]
    res = {"benchmark": "eval_needle_entry", "rows": rows, "numpy": np.__version__, "numba_threads": numba.get_num_threads(),
           "cpu": platform.processor(), "load_average_1min": os.getloadavg()[0],
           "runtime_seconds": time.perf_counter() - t0}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
