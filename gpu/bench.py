"""GPU benchmark: check against kvq_ref, then time the paged decode and append kernels (one command).

Run on a machine with a CUDA GPU, from the repository root (under 5 minutes on an H200)::

    python gpu/bench.py [--out results/gpu] [--contexts 4096,32768,131072] [--bits 2,3,4] [--batches 1,16]
    python gpu/bench.py --quick      (check_device.sh: 32K tokens, 2 and 4 bits, batch 1, bands 0 and 64)
    python gpu/bench.py --dry-run    (CI: the whole plan on the CPU interpreter, tiny shapes)

What it does, in order:

1. Device facts, the measured copy bandwidth (``dst.copy_(src)`` of 1 GiB; read + written bytes over
   the median of CUDA-event timings) and a read-only streaming probe (``torch.sum`` over 2 GiB: bytes
   read over the median), the roofline the decode kernels are judged against, with the spec
   (``SPEC_BPS``: 4.8 TB/s for an H200).
2. Correctness before any timing: ``quantize_mse`` and ``append_encoded`` bit-exact with
   ``TurboQuantMSE.encode``; ``decode_attention_mse`` (contiguous) and ``paged_decode_attention``
   within 2e-3 relative of ``kvq_ref.attention.attention_decode`` (the default fp16 tensor-core
   operands round to 2^-11; measured 3-4e-4 under the interpreter); for the CUDA backend,
   ``append_fragment`` read back bit-exact and ``fragment_decode_attention`` within 2e-3.
3. Decode attention, paged (pages of 256 tokens in a shuffled block table), head_dim 128, GQA group 4,
   8 KV heads, for each batch x context x bits (K and V at the same width) and backend
   (``paged_decode_attention(..., backend="triton" | "cuda" | "cuda-plain")``: gpu.triton.cache's
   kernels, or the CUDA fragment kernel of gpu.cuda.fragment_cache with its merge kernel launched as a
   programmatic dependent of the split kernel, or plainly after it), and fp16 SDPA pinned to the FlashAttention backend on
   the same shapes (the group folded into the query length, so the fp16 K/V is read once per KV head)
   with its own GB/s. ``--bands`` adds a float16 band of that many tokens per sequence beside the encoded
   ones (the recent window a deployed setting keeps, read by the kernels' band path; its bytes are
   counted), a row per band. Each row reports its fraction of the read probe and of the spec, and its
   speedup against FlashAttention and against the ideal fp16 read (fp16 K/V bytes at the spec).
4. Append throughput: ``append_encoded`` of 16 x 8 heads x 2048 new tokens (fp16 in, codes + norms
   out), GB/s of bytes read + written, against the copy bandwidth.

Timing: every call is captured once in a CUDA graph (no Python or allocation in the timed region);
each repetition first flushes L2 by reading a 256 MiB buffer (a write would leave dirty lines for the
timed call to write back), then CUDA events bracket one graph replay; the median over the repetitions
is reported (a call slower than 0.5 s stops its repetitions).
Cache contents for timing are random codes and norms (the kernels' time does not depend on values;
correctness is step 2's job).

Targets (``TARGETS``) are judged against the reference bandwidth: the larger of the copy bandwidth
and the fastest FlashAttention read of the run (``_add_reference_bandwidth``).

Results: ``results/gpu/bench_<device>.json`` (``bench_dryrun.json`` for --dry-run).
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

TARGETS = {"fraction_of_reference_bandwidth_at_32k_plus": 0.7, "speedup_vs_sdpa_4bit": 3.0,
           "speedup_vs_sdpa_2bit": 5.0, "append_fraction_of_reference_bandwidth": 0.5}
SPEC_BPS = {"H200": 4.8e12, "H100": 3.35e12}  # HBM bandwidth by device name (the first that matches)
BACKENDS = ("triton", "cuda", "cuda-plain")


def spec_bandwidth(name: str):
    """The HBM spec (bytes/s) of a device name, or None when unknown."""
    return next((v for k, v in SPEC_BPS.items() if k in name), None)


def paged_decode_attention(q, cache, ktable, vtable, *, backend: str = "triton", **kwargs):
    """Decode attention over a paged cache by backend: "triton" (``gpu.triton.cache.PagedKVCache``),
    "cuda" (``gpu.cuda.fragment_cache.FragmentKVCache``, the fragment layout, its merge kernel a
    programmatic dependent launch) or "cuda-plain" (the same kernels, the merge launched after the split
    kernel completes: what the dependent launch saves)."""
    if backend == "triton":
        from gpu.triton.cache import paged_decode_attention as run
    elif backend in ("cuda", "cuda-plain"):
        from gpu.cuda.fragment_cache import fragment_decode_attention as run
        kwargs["dependent_launch"] = backend == "cuda"
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return run(q, cache, ktable, vtable, **kwargs)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--backends", default=None,
                   help="triton,cuda,cuda-plain (default: the CUDA ones too when nvcc is found)")
    p.add_argument("--bands", default=None,
                   help="16-bit band tokens per sequence beside the encoded ones (comma list; default 0, --quick 0,64)")
    p.add_argument("--quick", action="store_true", help="32K tokens, 2 and 4 bits, batch 1, bands 0 and 64 "
                   "(check_device.sh)")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes (plumbing check)")
    return p.parse_args(argv)


class Timer:
    """Median GPU time of a callable: CUDA graph, L2 flush before each replay (by reading 256 MiB: a
    write would leave dirty lines the timed call writes back), events around it."""

    def __init__(self, cuda: bool, repeats: int):
        import torch
        self.torch, self.cuda, self.repeats = torch, cuda, repeats
        self.flush = torch.ones(64 << 20, dtype=torch.float32, device="cuda") if cuda else None
        self.sink = torch.zeros((), dtype=torch.float32, device="cuda") if cuda else None

    def __call__(self, fn) -> float:
        torch = self.torch
        if not self.cuda:  # dry run: the plumbing only
            fn()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        fn()  # compile + warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            torch.sum(self.flush, dim=0, out=self.sink)  # reads the buffer, writes 4 bytes
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
            if times[-1] > 0.5:
                break
        return statistics.median(times)


def _checks(dev, d, g, bits_list):
    """Correctness gate (step 2): a list of dicts with an ``ok`` field each."""
    import numpy as np
    import torch

    from gpu.tables import load_device_table
    from gpu.triton.attention import decode_attention_mse
    from gpu.triton.cache import PagedKVCache, append_encoded, paged_decode_attention
    from gpu.triton.quantize import quantize_mse
    from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode

    rng = np.random.default_rng(0)
    checks = []
    for bits in bits_list:
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
                                   *(torch.from_numpy(a).to(dev) for a in (ek.arrays["codes"], ek.arrays["norms"],
                                                                          ev.arrays["codes"], ev.arrays["norms"])),
                                   q, q, table, table).cpu().numpy()
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        # paged: two sequences of 300 tokens appended in chunks across pages of 16, shuffled pages
        pc = PagedKVCache.allocate(q, q, 2, 1, num_pages=40, page_size=16, pages_per_seq=19, device=dev)
        pc.block_table.copy_(torch.randperm(40)[:38].reshape(2, 19).to(torch.int32))
        kv = np.stack([K, 0.5 * K]).astype(np.float16)[:, :, None, :]  # (2, 300, 1, d)
        vv = np.stack([V, -V]).astype(np.float16)[:, :, None, :]
        for a, b in ((0, 37), (37, 300)):
            append_encoded(pc, torch.from_numpy(kv[:, a:b]).to(dev), torch.from_numpy(vv[:, a:b]).to(dev), table, table)
        t = np.arange(300)
        pages = pc.block_table[1].cpu().numpy()[t // 16]
        app_exact = bool(np.array_equal(pc.k_codes[pages, 0, t % 16, :ref.arrays["codes"].shape[1]].cpu().numpy(),
                                        q.encode(kv[1, :, 0]).arrays["codes"]))
        qp = rng.standard_normal((2, 1, 1, g, d)).astype(np.float32)
        outp = paged_decode_attention(torch.from_numpy(qp).to(dev), pc, table, table).float().cpu().numpy()
        rel_p = 0.0
        for s in range(2):
            cs = QuantizedKV.build(kv[s, :, 0].astype(np.float64), vv[s, :, 0].astype(np.float64), q, q)
            w = attention_decode(qp[s, 0, 0].astype(np.float64), cs)
            rel_p = max(rel_p, float(np.linalg.norm(outp[s, 0, 0] - w) / np.linalg.norm(w)))
        checks.append({"bits": bits, "codes_bit_exact": exact, "append_bit_exact": app_exact,
                       "attention_rel_err": rel, "paged_attention_rel_err": rel_p,
                       "ok": exact and app_exact and rel < 2e-3 and rel_p < 2e-3})
    return checks


def _checks_cuda(dev, d, g, bits_list, backend="cuda"):
    """A CUDA fragment backend's correctness gate ("cuda" or "cuda-plain", the merge's launch): append
    read back bit-exact, attention vs kvq_ref."""
    import numpy as np
    import torch

    from gpu.cuda.fragment_cache import FragmentKVCache, append_fragment, fragment_decode_attention, read_rows
    from kvq_ref import QuantizedKV, TurboQuantMSE, attention_decode

    rng = np.random.default_rng(1)
    checks = []
    for bits in bits_list:
        q = TurboQuantMSE(d, bits)
        cache = FragmentKVCache.allocate(q, q, 2, 1, num_pages=10, page_size=32, pages_per_seq=4, device=dev)
        cache.block_table.copy_(torch.randperm(10)[:8].reshape(2, 4).to(torch.int32))
        K, V = rng.standard_normal((2, 2, 70, 1, d)).astype(np.float16)
        for a, b in ((0, 37), (37, 70)):
            append_fragment(cache, torch.from_numpy(K[:, a:b]).to(dev), torch.from_numpy(V[:, a:b]).to(dev))
        rows = read_rows(cache, 1, 0)
        exact = bool(np.array_equal(rows[0], q.encode(K[1, :, 0]).arrays["codes"])
                     and np.array_equal(rows[2], q.encode(V[1, :, 0]).arrays["codes"]))
        qp = rng.standard_normal((2, 1, 1, g, d)).astype(np.float32)
        out = fragment_decode_attention(torch.from_numpy(qp).to(dev), cache,
                                        dependent_launch=backend == "cuda").float().cpu().numpy()
        rel = 0.0
        for s in range(2):
            ref = attention_decode(qp[s, 0, 0].astype(np.float64),
                                   QuantizedKV.build(K[s, :, 0].astype(np.float64), V[s, :, 0].astype(np.float64), q, q))
            rel = max(rel, float(np.linalg.norm(out[s, 0, 0] - ref) / np.linalg.norm(ref)))
        checks.append({"backend": backend, "bits": bits, "append_bit_exact": exact, "paged_attention_rel_err": rel,
                       "ok": exact and rel < 2e-3})
    return checks


def _random_band(c, band):
    """``band`` random float16 band tokens per sequence and KV head (the recent window of a cache)."""
    import torch

    if band:
        c.band_k[:, :, :band].copy_(torch.randn(c.band_k[:, :, :band].shape, device=c.band_k.device))
        c.band_v[:, :, :band].copy_(torch.randn(c.band_v[:, :, :band].shape, device=c.band_v.device))
    c.band_lens.fill_(band)


def _random_fragment(q, batch, heads, n, page, dev, band=0):
    """A fragment-layout cache of ``n`` tokens per sequence, random bytes (codes and norms), shuffled pages,
    and ``band`` float16 band tokens."""
    import torch

    from gpu.cuda.fragment_cache import FragmentKVCache

    page = max(32, page)
    per_seq = -(-n // page)
    c = FragmentKVCache.allocate(q, q, batch, heads, num_pages=batch * per_seq, page_size=page,
                                 pages_per_seq=per_seq, band_capacity=max(band, 1), device=dev)
    c.block_table.copy_(torch.randperm(batch * per_seq, device=dev).to(torch.int32).reshape(batch, per_seq))
    c.kv.copy_(torch.randint(0, 256, c.kv.shape, dtype=torch.uint8, device=dev))
    # norms: float16 in [0.5, 1.5) (random bytes could be inf or NaN), at the tile's last 64 bytes
    norms = c.kv[..., -64:].view(torch.float16)
    norms.copy_((torch.rand(norms.shape, device=dev) + 0.5).to(torch.float16))
    c.seq_lens.fill_(n)
    _random_band(c, band)
    return c


def _random_paged(q, batch, heads, n, page, dev, band=0):
    """A paged cache of ``n`` encoded tokens per sequence with random codes/norms and shuffled pages, and
    ``band`` float16 band tokens."""
    import torch

    from gpu.triton.cache import PagedKVCache

    per_seq = -(-n // page)
    c = PagedKVCache.allocate(q, q, batch, heads, num_pages=batch * per_seq, page_size=page, pages_per_seq=per_seq,
                              band_capacity=band, device=dev)
    c.block_table.copy_(torch.randperm(batch * per_seq, device=dev).to(torch.int32).reshape(batch, per_seq))
    for codes, norms in ((c.k_codes, c.k_norms), (c.v_codes, c.v_norms)):
        codes.copy_(torch.randint(0, 256, codes.shape, dtype=torch.uint8, device=dev))
        norms.copy_((torch.rand(norms.shape, device=dev) + 0.5).to(norms.dtype))
    c.seq_lens.fill_(n)
    _random_band(c, band)
    return c


def _backends(args, cuda: bool) -> tuple:
    """The decode backends to time: --backends, else triton and (with nvcc) cuda; the dry run checks the
    CUDA one on the host emulation (KVQ_CUDA_HOST_EMULATION=1) when g++ is there."""
    import shutil

    from gpu.cuda.binding import HOST_EMULATION_ENV, find_nvcc

    if args.backends:
        out = tuple(b.strip() for b in args.backends.split(","))
        bad = [b for b in out if b not in BACKENDS]
        if bad:
            raise SystemExit(f"unknown backends {bad}: choose from {BACKENDS}")
    elif cuda:
        out = BACKENDS if find_nvcc() else ("triton",)
    else:
        out = BACKENDS if shutil.which("g++") else ("triton",)
    if not cuda and any(b.startswith("cuda") for b in out):
        os.environ[HOST_EMULATION_ENV] = "1"
    return out


def _add_reference_bandwidth(result: dict) -> None:
    """The bandwidth the targets are judged against: the larger of the measured copy bandwidth and the
    fastest fp16 FlashAttention read of the run. (On the first H200 run a 1 GiB byte copy measured
    2.76 TB/s while FlashAttention read 4.3-4.6 TB/s, so the copy alone flattered the kernels.) Adds
    ``reference_bandwidth_gbs`` and each decode/append row's ``fraction_of_reference_bandwidth``."""
    import math

    fa = [r["sdpa_bandwidth_gbs"] for r in result["decode"] if math.isfinite(r["sdpa_bandwidth_gbs"])]
    ref = max([result["copy_bandwidth_gbs"], *fa])
    result["reference_bandwidth_gbs"] = ref
    for r in result["decode"] + result["append"]:
        r["fraction_of_reference_bandwidth"] = r["bandwidth_gbs"] / ref


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.contexts, args.batches, args.kv_heads, args.page_size, args.repeats = "64,97", "1,2", 2, 16, 1
    elif args.quick:
        args.contexts, args.bits, args.batches, args.repeats = "32768", "2,4", "1", 10
    import torch

    from gpu.tables import load_device_table
    from gpu.triton.cache import append_encoded
    from kvq_ref import TurboQuantMSE

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu/bench.py needs a CUDA GPU (or --dry-run for the CPU plumbing check)", file=sys.stderr)
        return {}
    dev = "cuda" if cuda else "cpu"
    d, g, hkv = args.head_dim, args.group, args.kv_heads
    contexts = [int(c) for c in args.contexts.split(",")]
    bit_list = [int(b) for b in args.bits.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    bands = [int(w) for w in (args.bands or ("0,64" if args.quick else "0")).split(",")]
    if any(w < 0 for w in bands):
        raise SystemExit(f"--bands must be non-negative, got {args.bands}")
    timed = Timer(cuda, args.repeats)
    backends = _backends(args, cuda)
    result = {"benchmark": "paged TurboQuantMSE decode attention vs fp16 FlashAttention SDPA", "dry_run": args.dry_run,
              "command": shlex.join(["python", "gpu/bench.py", *(sys.argv[1:] if argv is None else argv)]),
              "device": torch.cuda.get_device_name() if cuda else f"cpu-interpreter ({platform.machine()})",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "d": d, "group": g,
              "kv_heads": hkv, "page_size": args.page_size, "repeats": args.repeats, "bands": bands,
              "timing": "CUDA graph replay, L2 flushed (256 MiB read) before each, CUDA events, median",
              "targets": TARGETS, "backends": list(backends)}
    # 1. copy bandwidth
    nbytes = (1 << 30) if cuda else (1 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    result["copy_bandwidth_gbs"] = 2 * nbytes / t / 1e9
    del src, dst
    probe = torch.ones((2 << 30) // 4 if cuda else 1 << 18, dtype=torch.float32, device=dev)
    sink = torch.zeros((), dtype=torch.float32, device=dev)
    t = timed(lambda: torch.sum(probe, dim=0, out=sink))
    result["read_probe_gbs"] = probe.numel() * 4 / t / 1e9
    del probe
    spec = spec_bandwidth(result["device"]) if cuda else None
    result["spec_gbs"] = spec / 1e9 if spec else None
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["device"]).strip("_").lower()
    suffix = "dryrun" if args.dry_run else name + ("_quick" if args.quick else "")
    path = args.out / f"bench_{suffix}.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every step, so a run stopped at its time limit keeps what it measured
        result["complete"] = "met" in result
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float) + "\n")
        os.replace(tmp, path)
    save()
    # 2. correctness
    result["checks"] = _checks(dev, d, g, bit_list)
    for kind in backends:
        if kind.startswith("cuda"):
            result["checks"] += _checks_cuda(dev, d, g, bit_list, backend=kind)
    if not all(c["ok"] for c in result["checks"]):
        print("kernels disagree with kvq_ref; not timing", file=sys.stderr)
        (args.out / "bench_failed_checks.json").write_text(json.dumps(result, indent=1) + "\n")
        return result
    # 3. decode attention vs fp16 FlashAttention SDPA
    result["decode"] = []
    for b in batches:
        for n in contexts:
            qry = torch.randn(b, 1, hkv, g, d, device=dev, dtype=torch.float16)
            t_sdpa, sdpa_bytes, backend = float("nan"), 2 * b * hkv * n * d * 2, None
            if cuda:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                kk, vv = torch.randn(2, b, hkv, n, d, device=dev, dtype=torch.float16)
                qq = qry.reshape(b, hkv, g, d)  # GQA group folded into the query length: K/V read once

                def sdpa():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)
                t_sdpa, backend = timed(sdpa), "FLASH_ATTENTION"
                del kk, vv
            for bits in bit_list:
                q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
                for kind, band in ((k, w) for w in bands for k in backends):
                    if args.dry_run and kind.startswith("cuda") and b > 1:
                        continue  # the host emulation is slow: one batch is plumbing enough
                    make = _random_fragment if kind.startswith("cuda") else _random_paged
                    cache = make(q, b, hkv, n, args.page_size, dev, band)
                    t = timed(lambda: paged_decode_attention(qry, cache, table, table, backend=kind, max_seq_len=n))
                    # bytes the kernel reads per token and KV head: K and V codes (Triton: rows padded to
                    # 16 bytes; CUDA: the tile's share) and the two float16 norms
                    if kind.startswith("cuda"):
                        per = cache.kv.shape[3] / 16
                    else:
                        per = (cache.k_codes.shape[3] + cache.v_codes.shape[3] + cache.k_norms.element_size()
                               + cache.v_norms.element_size())
                    moved = int(b * hkv * n * per) + b * hkv * band * 2 * d * 2  # + the float16 band's K and V
                    bw = moved / t / 1e9
                    result["decode"].append({
                        "backend": kind, "batch": b, "context": n, "bits": bits, "band": band, "seconds": t,
                        "bytes": moved,
                        "bandwidth_gbs": bw, "fraction_of_copy_bandwidth": bw / result["copy_bandwidth_gbs"],
                        "fraction_of_read_probe": bw / result["read_probe_gbs"],
                        "fraction_of_spec": bw * 1e9 / spec if spec else None,
                        "sdpa_fp16_seconds": t_sdpa, "sdpa_backend": backend, "sdpa_bytes": sdpa_bytes,
                        "sdpa_bandwidth_gbs": sdpa_bytes / t_sdpa / 1e9, "speedup_vs_sdpa": t_sdpa / t,
                        "speedup_vs_ideal_fp16": sdpa_bytes / spec / t if spec else None})
                    save()
                    del cache
    # 4. append throughput
    rows_b, rows_t = (16, 2048) if cuda else (2, 8)
    result["append"] = []
    for bits in bit_list:
        q, table = TurboQuantMSE(d, bits), load_device_table(d, bits, device=dev)
        cache = _random_paged(q, rows_b, hkv, rows_t, args.page_size, dev)
        k, v = torch.randn(2, rows_b, rows_t, hkv, d, device=dev, dtype=torch.float16)

        def step():
            cache.seq_lens.zero_()
            append_encoded(cache, k, v, table, table)
        t = timed(step)
        moved = 2 * (k.numel() * 2 + rows_b * rows_t * hkv * (cache.k_codes.shape[3] + 2))
        result["append"].append({"bits": bits, "tokens": rows_b * rows_t, "kv_heads": hkv, "seconds": t,
                                 "bytes": moved, "bandwidth_gbs": moved / t / 1e9,
                                 "fraction_of_copy_bandwidth": moved / t / 1e9 / result["copy_bandwidth_gbs"]})
        save()
        del cache, k, v
    _add_reference_bandwidth(result)
    result["met"] = None
    if cuda:
        result["met"] = {}
        for kind in backends:
            long = [r for r in result["decode"] if r["context"] >= 32768 and r["backend"] == kind and r["band"] == 0]
            result["met"][kind] = {
                "bandwidth": all(r["fraction_of_reference_bandwidth"] >= 0.7 for r in long),
                "speedup_4bit": all(r["speedup_vs_sdpa"] >= 3.0 for r in long if r["bits"] == 4),
                "speedup_2bit": all(r["speedup_vs_sdpa"] >= 5.0 for r in long if r["bits"] == 2)}
        result["met"]["append"] = all(r["fraction_of_reference_bandwidth"] >= 0.5 for r in result["append"])
    save()
    print(f"device {result['device']}: copy {result['copy_bandwidth_gbs']:.1f} GB/s, read probe "
          f"{result['read_probe_gbs']:.1f} GB/s, reference {result['reference_bandwidth_gbs']:.1f} GB/s; checks "
          f"passed; wrote {path}")
    for r in result["decode"]:
        spec = f", {r['fraction_of_spec'] * 100:5.1f} % of spec" if r["fraction_of_spec"] else ""
        print(f"  {r['backend']:>10} batch {r['batch']:>2} ctx {r['context']:>6} band {r['band']:>3} {r['bits']} bits: "
              f"{r['seconds'] * 1e6:9.1f} us, {r['fraction_of_read_probe'] * 100:5.1f} % of read probe{spec}, "
              f"x{r['speedup_vs_sdpa']:.2f} vs fp16 FA ({r['sdpa_bandwidth_gbs']:.0f} GB/s)")
    for r in result["append"]:
        print(f"  append {r['bits']} bits: {r['bandwidth_gbs']:.1f} GB/s "
              f"({r['fraction_of_reference_bandwidth'] * 100:.1f} % of ref bw)")
    return result


if __name__ == "__main__":
    # run as a script, this file's folder (gpu/) comes first on sys.path and its triton/ subpackage
    # would shadow the real triton: drop it (``python -m gpu.bench`` needs no fix)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
