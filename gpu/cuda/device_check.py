"""Measured instruction counts of the CUDA fragment kernel (ncu) against its static ones (gpu/check_device.sh).

``python -m gpu.cuda.device_check profile --bits B`` runs one decode call of the fragment kernel (head_dim
128, G = 4, batch 16 x 8 KV heads x 32K tokens, random codes) inside a CUDA profiler range, for ``ncu
--profile-from-start off``; ``python -m gpu.cuda.device_check compare CSV... --out JSON`` reads ncu's CSV
(``--csv --metrics`` of ``METRICS``) and puts per token-head counts beside the static ones
(``gpu.cuda.static.fragment_row``, compiled on the same machine), with ``within_10_percent`` for the warp
instructions and the ALU-pipe operations. The kernel's prologue, epilogue and rare rescales are in the
measured counts and not in the static path: at 4.2M token-heads per call they are a few per cent.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

__all__ = ["METRICS", "SHAPE", "profile", "read_ncu_csv", "compare"]

METRICS = ("smsp__inst_executed.sum", "smsp__inst_executed_pipe_alu.sum", "smsp__inst_executed_pipe_fma.sum",
           "dram__bytes_read.sum", "gpu__time_duration.sum")
SHAPE = {"batch": 16, "kv_heads": 8, "tokens": 32768, "group": 4, "d": 128, "page_size": 256}


def profile(bits: int) -> None:
    """One warm call, then one call between cudaProfilerStart and cudaProfilerStop."""
    import torch

    from gpu.bench import _random_fragment
    from gpu.cuda.fragment_cache import fragment_decode_attention
    from gpu.tables import load_device_table
    from kvq_ref import TurboQuantMSE

    s = SHAPE
    q = TurboQuantMSE(s["d"], bits)
    table = load_device_table(s["d"], bits, device="cuda")
    cache = _random_fragment(q, s["batch"], s["kv_heads"], s["tokens"], s["page_size"], "cuda")
    qry = torch.randn(s["batch"], 1, s["kv_heads"], s["group"], s["d"], device="cuda", dtype=torch.float16)
    fragment_decode_attention(qry, cache, table, table, max_seq_len=s["tokens"])  # builds and warms up
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fragment_decode_attention(qry, cache, table, table, max_seq_len=s["tokens"])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def read_ncu_csv(path) -> dict:
    """{metric: value} of the split kernel's launch in an ncu ``--csv`` report (the last one, summed
    over nothing: one launch is profiled)."""
    text = Path(path).read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    out = {}
    for row in csv.DictReader(lines):
        if "kvq_frag_split_kernel" not in row.get("Kernel Name", ""):
            continue
        value = row["Metric Value"].replace(",", "")
        unit = row.get("Metric Unit", "")
        scale = {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "byte": 1, "usecond": 1e-6, "msecond": 1e-3,
                 "nsecond": 1e-9, "second": 1}.get(unit, 1)
        out[row["Metric Name"]] = float(value) * scale
    return out


def _static_row(static, d: int, bits: int) -> dict:
    """The static row compiled here, or (no nvcc/nvdisasm on this machine) the committed report's."""
    try:
        return static.fragment_row(static.fragment_build(d, bits, bits, arch="sm_90a"))
    except Exception as exc:  # the device image may lack nvdisasm
        report = Path(__file__).resolve().parents[2] / "results" / "gpu" / "static_report_sm90.json"
        rows = json.loads(report.read_text()).get("cuda", [])
        row = next(r for r in rows if r["d"] == d and r["kbits"] == bits and r["vbits"] == bits)
        print(f"static counts from {report.name} ({exc.__class__.__name__}: {exc})", file=sys.stderr)
        return row


def compare(csvs: list, out: Path) -> dict:
    """Measured (ncu) vs static counts per token-head for each bit width's CSV (file names hold 'Nbit')."""
    import re

    from gpu.cuda import static

    s = SHAPE
    token_heads = s["batch"] * s["kv_heads"] * s["tokens"]
    rows = []
    for path in csvs:
        bits = int(re.search(r"(\d)bit", Path(path).name).group(1))
        m = read_ncu_csv(path)
        row = _static_row(static, s["d"], bits)
        rec = {"bits": bits, "csv": str(path), "token_heads": token_heads, "metrics": m,
               "static_warp_instr_per_token_head": row["warp_instr_per_token_head"],
               "static_alu_per_token_head": row["alu_per_token_head"]}
        if "smsp__inst_executed.sum" in m:
            rec["measured_warp_instr_per_token_head"] = m["smsp__inst_executed.sum"] / token_heads
            rec["measured_alu_per_token_head"] = m.get("smsp__inst_executed_pipe_alu.sum", float("nan")) / token_heads
            rec["within_10_percent"] = {
                k: abs(rec[f"measured_{k}"] / rec[f"static_{k}"] - 1) <= 0.10
                for k in ("warp_instr_per_token_head", "alu_per_token_head")}
        if "gpu__time_duration.sum" in m and "dram__bytes_read.sum" in m:
            rec["dram_read_gbs"] = m["dram__bytes_read.sum"] / m["gpu__time_duration.sum"] / 1e9
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "metrics"}, default=float))
    result = {"shape": s, "metrics": list(METRICS), "rows": rows,
              "command": "bash gpu/check_device.sh (ncu step)"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("profile")
    pp.add_argument("--bits", type=int, choices=(2, 3, 4), required=True)
    pc = sub.add_parser("compare")
    pc.add_argument("csvs", nargs="+")
    pc.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "profile":
        profile(args.bits)
    else:
        compare(args.csvs, args.out)


if __name__ == "__main__":
    sys.exit(main())
