"""Tuning sweep of the paged decode kernel: tile, warps, prefetch, pipelining and split count.

Run on a machine with a CUDA GPU, from the repository root (about a minute on an H200 for 3 bit widths)::

    python gpu/sweep.py [--out results/gpu] [--bits 2,4] [--batches 1,16] [--context 32768]
    python gpu/sweep.py --dry-run      (CI: the whole plan on the CPU interpreter, tiny shapes)

For each (batch, bits) it times ``paged_decode_attention`` (K and V at the same width, head_dim
128, GQA group 4, 8 KV heads, pages of 256 tokens in a shuffled block table) under every variant of
``VARIANTS`` with ``gpu/bench.py``'s timer (CUDA graph, L2 flushed before each replay, median), and
reports each variant's time relative to the shipped defaults in the same run. Every variant is first
checked to give the defaults' output (the variants change the schedule, never the math: agreement
within 1e-3 relative, the fp16 operand rounding of two summation orders).

Results: ``results/gpu/sweep_<device>.json`` (``sweep_dryrun.json`` for --dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path

# (name, block_n, num_warps, prefetch, num_stages, split factor); None = the shipped default
VARIANTS = [
    ("default", None, None, None, None, 1.0),
    ("prefetch", None, None, True, None, 1.0),
    ("no_prefetch", None, None, False, None, 1.0),
    ("stages1", None, None, None, 1, 1.0),
    ("splits_x2", None, None, None, None, 2.0),
    ("splits_half", None, None, None, None, 0.5),
    ("bn32_w4", 32, 4, False, None, 1.0),
    ("bn64_w4", 64, 4, False, None, 1.0),
    ("bn128_w4", 128, 4, False, None, 1.0),
    ("bn64_w8", 64, 8, False, None, 1.0),
    ("bn128_w8", 128, 8, False, None, 1.0),
    ("bn64_w2", 64, 2, False, None, 1.0),
    ("bn128_w4_prefetch", 128, 4, True, None, 1.0),
    ("bn64_w4_prefetch", 64, 4, True, None, 1.0),
    ("bn32_w4_prefetch", 32, 4, True, None, 1.0),
]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--bits", default="2,4")
    p.add_argument("--batches", default=None, help="default 1,16 (1,2 with --dry-run)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes (plumbing check)")
    p.add_argument("--variants", default=None, metavar="NAMES",
                   help="comma-separated subset of VARIANTS to time (the default always runs first)")
    p.add_argument("--profile", default=None, metavar="NAMES",
                   help="comma-separated variants (or 'append'): compile them, then run each once between "
                        "cudaProfilerStart/Stop (for ncu --profile-from-start off) at the first batch and bits; "
                        "no timing, no JSON")
    return p.parse_args(argv)


def run_variant(qry, cache, table, variant, max_len):
    """One call of the split + merge kernels under ``variant`` (see ``VARIANTS``)."""
    import torch

    from gpu.schedule import plan_splits
    from gpu.triton import paged
    from gpu.triton.attention import kernel_params, resolve_precision

    _, bn, nw, prefetch, stages, factor = variant
    b, _, h, g, d = qry.shape
    m_pad = paged.rows_pad(g)
    bn_auto, bb_auto, nw_auto = paged.default_blocks(d, m_pad, table.bits)
    bn = min(bn or bn_auto, cache.page_size)
    auto = plan_splits(b, h, max_len, bn).splits
    splits = max(1, round(auto * factor))
    plan = plan_splits(b, h, max_len, bn, splits=splits)
    kp = kernel_params(cache.key_method, table, qry.device)
    vp = kernel_params(cache.value_method, table, qry.device)
    prec = resolve_precision(cache.key_method, cache.value_method, None)
    return paged.launch_paged(qry, cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms, cache.block_table,
                              cache.seq_lens, cache.band_k, cache.band_v, cache.band_lens, kp, vp,
                              out=torch.empty_like(qry), scale=d ** -0.5, plan=plan, block_band=bb_auto,
                              num_warps=nw or nw_auto, prec=prec, prefetch=prefetch, num_stages=stages)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.context, args.repeats = 97, 1
        args.batches = args.batches or "1,2"
    args.batches = args.batches or "1,16"
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu.bench import Timer, _random_paged
    from gpu.tables import load_device_table
    from gpu.triton.cache import append_encoded
    from kvq_ref import TurboQuantMSE

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu/sweep.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return {}
    dev = "cuda" if cuda else "cpu"
    d, g, hkv, page = 128, 4, (8 if cuda else 2), (256 if cuda else 16)
    timed = Timer(cuda, args.repeats)
    result = {"benchmark": "paged decode kernel tuning sweep (time relative to the defaults, same run)",
              "dry_run": args.dry_run, "device": torch.cuda.get_device_name() if cuda else
              f"cpu-interpreter ({platform.machine()})", "torch": torch.__version__,
              "triton": __import__("triton").__version__,
              "command": shlex.join(["python", "gpu/sweep.py", *(sys.argv[1:] if argv is None else argv)]),
              "d": d, "group": g, "kv_heads": hkv, "page_size": page, "context": args.context,
              "variants": [dict(zip(("name", "block_n", "num_warps", "prefetch", "num_stages", "split_factor"), v))
                           for v in VARIANTS], "rows": []}
    if args.profile:
        by_name = {v[0]: v for v in VARIANTS}
        names = args.profile.split(",")
        unknown = [n for n in names if n != "append" and n not in by_name]
        if unknown:
            raise SystemExit(f"--profile: unknown variant(s) {unknown}; known: append, {', '.join(by_name)}")
        batch, bits = int(args.batches.split(",")[0]), int(args.bits.split(",")[0])
        q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
        cache = _random_paged(q, batch, hkv, args.context, page, dev)
        qry = torch.randn(batch, 1, hkv, g, d, device=dev, dtype=torch.float16)
        new_k, new_v = torch.randn(2, batch, 64, hkv, d, device=dev, dtype=torch.float16)

        def once(name):  # "append": 64 new tokens per sequence through the fused quantize-and-append
            if name == "append":
                cache.seq_lens.fill_(args.context - 64)
                append_encoded(cache, new_k, new_v, table, table)
            else:
                run_variant(qry, cache, table, by_name[name], args.context)
        for n in names:  # compile outside the profiled range
            once(n)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        for n in names:
            once(n)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        return result
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["device"]).strip("_").lower()
    path = args.out / f"sweep_{'dryrun' if args.dry_run else name}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    for batch in (int(x) for x in args.batches.split(",")):
        for bits in (int(x) for x in args.bits.split(",")):
            q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
            cache = _random_paged(q, batch, hkv, args.context, page, dev)
            qry = torch.randn(batch, 1, hkv, g, d, device=dev, dtype=torch.float16)
            ref = run_variant(qry, cache, table, VARIANTS[0], args.context).float()
            base = None
            chosen = VARIANTS if not args.variants else [VARIANTS[0]] + [
                v for v in VARIANTS[1:] if v[0] in args.variants.split(",")]
            for v in chosen:
                row = {"batch": batch, "bits": bits, "variant": v[0]}
                try:
                    got = run_variant(qry, cache, table, v, args.context).float()
                    row["rel_diff_vs_default"] = float((got - ref).norm() / ref.norm())
                    row["seconds"] = timed(lambda: run_variant(qry, cache, table, v, args.context))
                except Exception as exc:  # a variant that fails to compile or launch is reported, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if v[0] == "default":
                    base = row.get("seconds")
                if base and "seconds" in row:
                    row["relative_time"] = row["seconds"] / base
                result["rows"].append(row)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(result, indent=1) + "\n")
                os.replace(tmp, path)
                print(f"batch {batch:>2} {bits} bits {v[0]:>22}: " + (
                    f"{row['seconds'] * 1e6:9.1f} us  x{row.get('relative_time', float('nan')):.3f}  "
                    f"diff {row['rel_diff_vs_default']:.1e}" if "seconds" in row else row["error"]), flush=True)
            del cache
    result["complete"] = True
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    here = Path(__file__).resolve().parent  # gpu/triton must not shadow the real triton
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
