"""Encode+decode throughput of TurboQuantMSE on CPU (d=128, bits 2/3/4, 2^16 vectors).

Run from the repository root::

    python benchmarks/bench_kvq_ref.py [--out benchmarks/results/kvq_ref.json] [--vectors 65536]

Three implementations, timed in the same run on the same float32 input (best of 15 repeats after a
warm-up):

* ``fused``: ``kvq_ref.fast.encode_fast/decode_fast``, the Numba kernels (one pass per vector).
* ``spec``: ``TurboQuantMSE.encode/decode``, the readable reference path (Numba Hadamard rows).
* ``numpy_dense``: a plain-numpy baseline the way CPU implementations are usually written: a dense
  d x d rotation matrix (BLAS matmul), ``np.searchsorted``, bit packing with numpy shifts, and the
  transpose on decode. It produces the same codes as the reference when given the same matrix.

The target (README): >= 1M vectors/s encode+decode at 4 bits with the Hadamard rotation on 2 cores.
Nothing asserts on time; the JSON records the machine and the ratios to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numba
import numpy as np

from kvq_ref.fast import decode_fast, encode_fast
from kvq_ref.turboquant import TurboQuantMSE

TARGET_VPS = 1_000_000


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class NumpyDense:
    """Plain numpy TurboQuant_mse with a dense rotation (the baseline)."""

    def __init__(self, q: TurboQuantMSE):
        self.m = q.rot.matrix()
        self.t = q.table.thresholds
        self.levels = q.table.levels
        self.bits = q.bits
        self.shifts = np.arange(8, dtype=np.uint8)

    def encode(self, x):
        x = x.astype(np.float64)
        norms = np.sqrt(np.einsum("ij,ij->i", x, x))
        y = (x / np.where(norms > 0, norms, 1.0)[:, None]) @ self.m.T
        codes = np.searchsorted(self.t, y, side="left").astype(np.uint8)
        bits = ((codes[:, :, None] >> self.shifts[: self.bits]) & 1).reshape(len(x), -1)
        return np.packbits(bits, axis=1, bitorder="little"), norms.astype(np.float16)

    def decode(self, packed, norms):
        bits = np.unpackbits(packed, axis=1, bitorder="little")[:, : self.m.shape[0] * self.bits]
        codes = (bits.reshape(len(packed), -1, self.bits) << self.shifts[: self.bits]).sum(axis=2)
        return ((self.levels[codes] @ self.m) * norms.astype(np.float64)[:, None]).astype(np.float32)


def run(n: int, repeats: int) -> dict:
    x = np.random.default_rng(0).standard_normal((n, 128)).astype(np.float32)
    cases = []
    for bits in (2, 3, 4):
        q = TurboQuantMSE(128, bits)
        base = NumpyDense(q)
        # warm-up (JIT) and a correctness check of every path against the reference
        ref = q.encode(x[:2048])
        assert encode_fast(q, x[:2048]) == ref
        assert np.array_equal(decode_fast(q, ref), q.decode(ref))
        packed, _ = base.encode(x[:2048])
        assert np.array_equal(packed, ref.arrays["codes"])
        timings = {
            "fused": _best(lambda: decode_fast(q, encode_fast(q, x)), repeats),
            "spec": _best(lambda: q.decode(q.encode(x)), max(2, repeats // 3)),
            "numpy_dense": _best(lambda: base.decode(*base.encode(x)), max(2, repeats // 3)),
        }
        enc = encode_fast(q, x)
        case = {"bits": bits,
                "encode_seconds": _best(lambda: encode_fast(q, x), repeats),
                "decode_seconds": _best(lambda: decode_fast(q, enc), repeats)}
        for name, sec in timings.items():
            case[f"{name}_seconds"] = round(sec, 5)
            case[f"{name}_vectors_per_s"] = round(n / sec)
        case["fused_over_numpy_dense"] = round(timings["numpy_dense"] / timings["fused"], 2)
        case["fused_over_spec"] = round(timings["spec"] / timings["fused"], 2)
        cases.append(case)
        print(f"bits={bits}: fused {case['fused_vectors_per_s']:>10,} vec/s  spec {case['spec_vectors_per_s']:>10,}"
              f"  numpy-dense {case['numpy_dense_vectors_per_s']:>10,}  (x{case['fused_over_numpy_dense']} over the"
              f" baseline)")
    four = next(c for c in cases if c["bits"] == 4)
    return {"cases": cases, "target_vectors_per_s_at_4_bits": TARGET_VPS,
            "met": bool(four["fused_vectors_per_s"] >= TARGET_VPS)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kvq_ref.json"))
    p.add_argument("--vectors", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result = {
        "benchmark": "kvq_ref TurboQuantMSE encode+decode throughput (d=128, Hadamard rotation)",
        "command": shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "numba_threads": numba.get_num_threads(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "numba": numba.__version__},
        "vectors": args.vectors,
        **run(args.vectors, args.repeats),
    }
    result["runtime_seconds"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
