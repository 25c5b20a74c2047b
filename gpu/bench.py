"""GPU benchmark: build, check against kvq_ref, and time the Triton kernels (one command).

Run on a machine with a CUDA GPU, from the repository root::

    python gpu/bench.py [--out results/gpu] [--contexts 4096,32768,131072] [--bits 2,3,4]
    python -m gpu.bench ...          (the same)

What it does, in order:

1. Device facts and the measured device-copy bandwidth (``dst.copy_(src)`` of 1 GiB; bytes read plus
   written over time, best of 10 CUDA-event timings).
2. Correctness on a small slice before any timing: ``gpu.triton.quantize_mse`` codes and norms equal
   ``TurboQuantMSE.encode`` byte for byte (float16 input), and ``decode_attention_mse`` agrees with
   ``kvq_ref.attention.attention_decode`` to 1e-3 relative.
3. Quantize throughput (float16 vectors in, packed codes and norms out) at head_dim 128, 2/3/4 bits.
4. Decode attention for batch x KV heads x context in {4K, 32K, 128K}, head_dim 128, 2/3/4-bit K/V, GQA
   group 4, against ``torch.nn.functional.scaled_dot_product_attention`` in float16 on the same shapes.
   Achieved bandwidth = bytes of the packed cache (codes and norms of K and V) / time, reported as a
   fraction of the copy bandwidth. Targets: >= 70 % of copy bandwidth at >= 32K, and >= 3x faster than
   fp16 SDPA at 4 bits.

Results: ``results/gpu/bench_<device>.json``. ``--dry-run`` runs the same code path on the CPU under
``TRITON_INTERPRET=1`` with tiny shapes (no meaningful timings), so the script is tested in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--quantize-vectors", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes (plumbing check)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.contexts, args.kv_heads, args.quantize_vectors, args.repeats = "64,97", 2, 256, 1
    import numpy as np
    import torch

    from gpu.tables import load_device_table
    from gpu.triton.attention import decode_attention_mse
    from gpu.triton.quantize import quantize_mse
    from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu/bench.py needs a CUDA GPU (or --dry-run for the CPU plumbing check)", file=sys.stderr)
        return {}
    dev = "cuda" if cuda else "cpu"
    d, g = 128, args.group
    contexts = [int(c) for c in args.contexts.split(",")]
    bit_list = [int(b) for b in args.bits.split(",")]

    def timed(fn, repeats):
        """Best wall time of ``fn`` (CUDA events on a GPU)."""
        fn()
        if not cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3)
        return best

    result = {"benchmark": "gpu kernels vs kvq_ref and fp16 SDPA", "dry_run": args.dry_run,
              "command": shlex.join(["python", "gpu/bench.py", *(sys.argv[1:] if argv is None else argv)]),
              "device": torch.cuda.get_device_name() if cuda else f"cpu-interpreter ({platform.machine()})",
              "torch": torch.__version__, "d": d, "group": g, "batch": args.batch, "kv_heads": args.kv_heads}
    # 1. copy bandwidth
    nbytes = (1 << 30) if cuda else (1 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), args.repeats)
    result["copy_bandwidth_gbs"] = 2 * nbytes / t / 1e9
    del src, dst
    # 2. correctness on a small slice
    rng = np.random.default_rng(0)
    checks = []
    for bits in bit_list:
        q = TurboQuantMSE(d, bits)
        table = load_device_table(d, bits, device=dev)
        x = rng.standard_normal((97, d)).astype(np.float16)
        packed, norms = quantize_mse(torch.from_numpy(x).to(dev), q, table)
        ref = q.encode(x)
        exact = bool(np.array_equal(packed.cpu().numpy(), ref.arrays["codes"])
                     and np.array_equal(norms.cpu().numpy(), ref.arrays["norms"]))
        K, V = rng.standard_normal((2, 300, d))
        cache = QuantizedKV.build(K, V, q, q)
        qry = rng.standard_normal((g, d))
        want = attention_decode(qry, cache)
        ek, ev = cache.keys, cache.values
        got = decode_attention_mse(torch.tensor(qry, dtype=torch.float32, device=dev),
                                   torch.from_numpy(ek.arrays["codes"]).to(dev), torch.from_numpy(ek.arrays["norms"]).to(dev),
                                   torch.from_numpy(ev.arrays["codes"]).to(dev), torch.from_numpy(ev.arrays["norms"]).to(dev),
                                   q, q, table, table).cpu().numpy()
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        checks.append({"bits": bits, "codes_bit_exact": exact, "attention_rel_err": rel, "ok": exact and rel < 1e-3})
    result["checks"] = checks
    if not all(c["ok"] for c in checks):
        print("kernels disagree with kvq_ref; not timing", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_failed_checks.json").write_text(json.dumps(result, indent=1) + "\n")
        return result
    # 3. quantize throughput
    result["quantize"] = []
    for bits in bit_list:
        q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
        x = torch.randn(args.quantize_vectors, d, device=dev, dtype=torch.float16)
        t = timed(lambda: quantize_mse(x, q, table), args.repeats)
        result["quantize"].append({"bits": bits, "vectors": args.quantize_vectors, "seconds": t,
                                   "vectors_per_s": args.quantize_vectors / t})
    # 4. decode attention vs fp16 SDPA
    result["decode"] = []
    b, hkv = args.batch, args.kv_heads
    for n in contexts:
        qry = torch.randn(b, hkv, g, d, device=dev)
        if cuda:
            # the fair baseline reads the same GQA cache in fp16: hkv K/V heads shared by g query heads
            kk, vv = torch.randn(2, b, hkv, n, d, device=dev, dtype=torch.float16)
            qq = qry.reshape(b, hkv * g, 1, d).half()
            t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, enable_gqa=True), args.repeats)
            del kk, vv
        else:
            t_sdpa = float("nan")
        for bits in bit_list:
            q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
            kv = torch.randn(2, b * hkv * n, d, device=dev, dtype=torch.float16)
            kp, kn = quantize_mse(kv[0], q, table)
            vp, vn = quantize_mse(kv[1], q, table)
            del kv
            shape = (b, hkv, n)
            kp, vp = kp.reshape(*shape, -1), vp.reshape(*shape, -1)
            kn, vn = kn.reshape(shape), vn.reshape(shape)
            t = timed(lambda: decode_attention_mse(qry, kp, kn, vp, vn, q, q, table, table), args.repeats)
            moved = sum(x.numel() * x.element_size() for x in (kp, kn, vp, vn))
            bw = moved / t / 1e9
            result["decode"].append({
                "context": n, "bits": bits, "seconds": t, "sdpa_fp16_seconds": t_sdpa,
                "speedup_vs_sdpa": t_sdpa / t, "bytes": moved, "bandwidth_gbs": bw,
                "fraction_of_copy_bandwidth": bw / result["copy_bandwidth_gbs"]})
            del kp, vp, kn, vn
    long4 = [r for r in result["decode"] if r["bits"] == 4]
    result["targets"] = {"fraction_of_copy_bandwidth_at_32k_plus": 0.7, "speedup_vs_sdpa_at_4_bits": 3.0}
    result["met"] = None if not cuda else {
        "bandwidth": all(r["fraction_of_copy_bandwidth"] >= 0.7 for r in result["decode"] if r["context"] >= 32768),
        "speedup_4bit": all(r["speedup_vs_sdpa"] >= 3.0 for r in long4)}
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["device"]).strip("_").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_{'dryrun' if args.dry_run else name}.json"
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"device {result['device']}: copy {result['copy_bandwidth_gbs']:.1f} GB/s; checks "
          f"{'passed' if all(c['ok'] for c in checks) else 'FAILED'}; wrote {path}")
    for r in result["decode"]:
        print(f"  ctx {r['context']:>6} {r['bits']} bits: {r['seconds'] * 1e6:9.1f} us, "
              f"{r['fraction_of_copy_bandwidth'] * 100:5.1f} % of copy bw, x{r['speedup_vs_sdpa']:.2f} vs SDPA")
    return result


if __name__ == "__main__":
    # run as a script, this file's folder (gpu/) comes first on sys.path and its triton/ subpackage
    # would shadow the real triton: drop it (``python -m gpu.bench`` needs no fix)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
