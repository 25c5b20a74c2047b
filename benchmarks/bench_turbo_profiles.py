"""Distortion of every TurboBlock profile on the same vectors (turbo2/3/4, 128 values per block).

Run from the repository root::

    python benchmarks/bench_turbo_profiles.py [--out benchmarks/results/turbo_profiles.json] [--vectors 20000]

Two data sets of ``--vectors`` float32 vectors of 128 values (seed 0), encoded by every shipped
profile (``kvq_ref.turbo_profiles``; profile ``kvq`` with seed 0):

* ``gaussian``: i.i.d. N(0, 1) coordinates.
* ``keys``: key-like vectors: a fixed per-channel offset (N(0, 1)) and log-normal per-channel scale
  (sigma 1) shared by all vectors, times N(0, 1) noise, so a few channels dominate.

Per profile and format: the mean relative error ``||x - x_hat||^2 / ||x||^2`` with its standard
error, the stored bits per value, and, against the fork profile ``fork@69d8e4be``, the share of
blocks whose bytes are identical and of indices that agree. The mean ratio of each profile's error
to the fork's on the same vectors comes with the standard error of the paired per-vector
difference. Each table is also audited exactly (``codebooks.audit``, no sampling) as a quantizer of
one coordinate of a rotated unit vector, SphereMarginal(128). ``kvq_block32`` gives profile
``kvq``'s 32-value blocks on the same vectors (four blocks per vector). Takes about 10 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from codebooks import SphereMarginal, audit
from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turbo_profiles import DEFAULT_PROFILE, profile_names

FMTS = ("turbo2", "turbo3", "turbo4")


def datasets(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The two float32 data sets (module docstring), shape (n, 128) each."""
    g = np.random.default_rng(seed)
    gauss = g.standard_normal((n, 128)).astype(np.float32)
    offset, scale = g.standard_normal(128), np.exp(g.standard_normal(128))
    keys = (offset + scale * g.standard_normal((n, 128))).astype(np.float32)
    return {"gaussian": gauss, "keys": keys}


def _mean_se(v: np.ndarray) -> tuple[float, float]:
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(v.size))


def run(n: int) -> dict:
    data = datasets(n)
    out: dict = {"profiles": {}, "tables": {}}
    for prof in profile_names():
        for fmt in FMTS:
            tb = TurboBlock(fmt, 128, profile=prof)
            rep = audit(SphereMarginal(128), tb.levels.astype(np.float64), tb.thresholds.astype(np.float64))
            out["tables"].setdefault(prof, {})[fmt] = {
                "excess_percent_over_lloyd_max": round(rep.excess_percent, 3),
                "d_times_distortion": round(128 * rep.distortion, 6)}
    for name, x in data.items():
        norms2 = np.sum(x.astype(np.float64) ** 2, axis=1)
        ref: dict = {}
        for prof in profile_names():
            rows = {}
            for fmt in FMTS:
                tb = TurboBlock(fmt, 128, profile=prof)
                enc = tb.encode(x)
                err = np.sum((x.astype(np.float64) - tb.decode(enc)) ** 2, axis=1) / norms2
                blocks = enc.arrays["blocks"]
                idx, _ = tb.unpack(blocks)
                if prof == DEFAULT_PROFILE:
                    ref[fmt] = (err, blocks, idx)
                e_ref, b_ref, i_ref = ref[fmt]
                mean, se = _mean_se(err)
                diff_mean, diff_se = _mean_se(err - e_ref)
                rows[fmt] = {
                    "relative_mse": round(mean, 6), "relative_mse_se": round(se, 6),
                    "bits_per_value": enc.bits_per_element,
                    "ratio_to_fork": round(mean / e_ref.mean(), 4),
                    "ratio_to_fork_se": round(diff_se / e_ref.mean(), 4),
                    "difference_to_fork": round(diff_mean, 6),
                    "blocks_identical_to_fork": round(float(np.mean(np.all(blocks == b_ref, axis=1))), 5),
                    "indices_equal_to_fork": round(float(np.mean(idx == i_ref)), 5),
                }
                print(f"{name:9s} {prof:22s} {fmt}: rel. MSE {mean:.5f} +- {se:.5f}  x{rows[fmt]['ratio_to_fork']:.3f}"
                      f" of the fork  blocks identical {rows[fmt]['blocks_identical_to_fork']:.2%}")
            out["profiles"].setdefault(prof, {})[name] = rows
        rows = {}
        for fmt in FMTS:  # profile kvq's 32-value blocks: each vector as four blocks with their own norm
            tb = TurboBlock(fmt, 32, profile="kvq")
            enc = tb.encode(x.reshape(-1, 4, 32))
            err = np.sum((x.astype(np.float64) - tb.decode(enc).reshape(-1, 128)) ** 2, axis=1) / norms2
            mean, se = _mean_se(err)
            rows[fmt] = {"relative_mse": round(mean, 6), "relative_mse_se": round(se, 6),
                         "bits_per_value": enc.bits_per_element}
            print(f"{name:9s} {'kvq, 32-value blocks':22s} {fmt}: rel. MSE {mean:.5f} +- {se:.5f}")
        out.setdefault("kvq_block32", {})[name] = rows
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/turbo_profiles.json"))
    p.add_argument("--vectors", type=int, default=20000)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    body = run(args.vectors)
    command = ["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    result = {"benchmark": "TurboBlock profiles: relative MSE and agreement with the fork on the same vectors",
              "command": shlex.join(command), "vectors": args.vectors, "seed": 0,
              "reference_profile": DEFAULT_PROFILE,
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "numpy": np.__version__},
              **body, "runtime_seconds": round(time.perf_counter() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    four = result["profiles"]["fork@69d8e4be+exact"]["gaussian"]["turbo4"]["ratio_to_fork"]
    print(f"wrote {args.out} (turbo4 with exact tables: x{four} of the fork's error on Gaussian vectors)")
    return result


if __name__ == "__main__":
    main()
