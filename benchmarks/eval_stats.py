"""The perplexity statistics: buffered rows (``scores.window_stats``) against whole chunks.

Run from the repository root (about a minute on 2 cores)::

    python benchmarks/eval_stats.py [--out benchmarks/results/eval_stats.json]

Float32 logits of 512 positions (one chunk of ``window_stats``) over Gemma-3's 262,144-token and
SmolLM2's 49,152-token vocabularies, random with a fixed seed: the float64 statistics (NLLs, KL,
top-1) by ``window_stats_direct`` (the definitions in whole-chunk arrays) and by ``window_stats``
(the same operations, a few positions at a time in reused buffers), timed in the same run, best of
``--repeats``. The record says whether the two gave the same numbers bit for bit; the ratio, not
the seconds, is the result. Nothing asserts on the outcome.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def main(argv=None) -> dict:
    import torch

    from kvq_eval.scores import window_stats, window_stats_direct

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/eval_stats.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    for name, vocab in (("gemma3", 262144), ("smollm2", 49152)):
        g = torch.Generator().manual_seed(0)
        ref = 4 * torch.randn((512, vocab), generator=g)
        out = ref + 0.5 * torch.randn((512, vocab), generator=g)
        target = torch.randint(0, vocab, (512,), generator=g)
        seconds, results = {}, {}
        for form, fn in (("direct", window_stats_direct), ("buffered", window_stats)):
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                results[form] = fn(ref, out, target)
                best = min(best, time.perf_counter() - t0)
            seconds[form] = best
        row = {"vocabulary": name, "vocab": vocab, "positions": 512, "seconds": seconds,
               "speedup": seconds["direct"] / seconds["buffered"], "identical": results["direct"] == results["buffered"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = {"rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor()}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
