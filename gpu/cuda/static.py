"""Static report of the CUDA fragment kernel compiled for sm_90a (no GPU): the instruction budget gate.

``fragment_build(d, kb, vb)`` compiles ``kvq_frag_attention.cu`` for one configuration with nvcc
(``-arch=sm_90a -cubin -Xptxas -v``, the flags of the GPU build but a cubin) and ``fragment_row`` reads
from it what the budget is about, per token and KV head (the split kernel's encoded-token loop,
``gpu.cuda.sass``): warp instructions on the common path, ALU-pipe operations, FSEL (select trees),
shared-memory and local-memory instructions, global loads by width, registers and spills; and how many
of the merge kernel's partial loads go out before the first is used (``sass.loads_in_flight``).

A warp's loop iteration covers ``tokens = 128 mma / d`` tokens of one KV head: every 16-token tile
needs ``d / 16`` value MMAs and ``d / 16`` key MMAs (fp16 ``m16n8k16``, or two int8 ``m16n8k32`` passes
of ``d / 32``), so the count of tensor-core instructions on the path says how many tiles it covers
(1 or 2 groups of U tiles, whatever the unrolling).

``GATE`` is issue 52's budget at d = 128, G = 4 (the GQA group is a runtime row count; the code is the
same for G <= 8): at 70 % of 4.8 TB/s an H200 can issue 18.7 / 27.5 / 36.3 warp instructions per
token-head at 2 / 3 / 4 bits, half of them on the ALU pipe (gpu/cuda/roofline.py).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import binding, sass

__all__ = ["GATE", "FragmentBuild", "fragment_build", "fragment_row", "gate_failures"]

# bits -> (warp instructions per token-head, ALU-pipe operations per token-head), d = 128, G = 4
GATE = {4: (24.0, 14.5), 3: (16.0, 11.5), 2: (15.0, 9.0)}
MAX_REGISTERS = 128


@dataclass(frozen=True)
class FragmentBuild:
    d: int
    kb: int
    vb: int
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    cubin: bytes


def fragment_build(d: int, kb: int, vb: int, arch: str = "sm_90a") -> FragmentBuild:
    """nvcc the fragment kernels of (d, kb, vb) to a cubin; registers and spills of the split kernel."""
    nvcc = binding.find_nvcc()
    if nvcc is None:
        raise binding.CudaUnavailableError("nvcc not found: cannot compile the fragment kernel")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        proc = subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                               f"-DKVQ_FRAG_D={d}", f"-DKVQ_FRAG_KB={kb}", f"-DKVQ_FRAG_VB={vb}", "-o", str(out),
                               "kvq_frag_attention.cu"], cwd=binding.CUDA_DIR, capture_output=True, text=True)
        if proc.returncode:
            raise binding.CudaUnavailableError(f"nvcc failed:\n{proc.stderr[-3000:]}")
        cubin = out.read_bytes()
    parts = re.split(r"Compiling entry function '([^']+)'", proc.stderr)
    body = next(b for name, b in zip(parts[1::2], parts[2::2]) if "split_kernel" in name)

    def grab(pattern):
        m = re.search(pattern, body)
        return int(m.group(1)) if m else 0
    return FragmentBuild(d, kb, vb, arch, grab(r"Used (\d+) registers"), grab(r"(\d+) bytes spill stores"),
                         grab(r"(\d+) bytes spill loads"), grab(r"(\d+) bytes stack frame"), cubin)


def fragment_row(build: FragmentBuild) -> dict:
    """The split kernel's loop per token-head (module docstring), as a JSON-able dict."""
    lines, labels = sass.kernel_sass(build.cubin, "kvq_frag_split_kernel")
    head, back = sass.main_loop(lines, labels)
    path = sass.fast_path(lines, labels, head, back)
    c = sass.count(path)
    if c["mma"] == 0:
        raise ValueError("the fragment kernel's loop holds no MMA")
    tokens = 128 * c["mma"] / build.d
    per = {k: c[k] / tokens for k in ("total", "alu", "fma", "mma", "mufu", "shfl", "vote", "movm", "lds", "sts",
                                      "ldl", "stl", "fsel", "other")}
    return {"kernel": "cuda kvq_frag_split_kernel", "config": f"d{build.d}_k{build.kb}v{build.vb}",
            "d": build.d, "kbits": build.kb, "vbits": build.vb, "arch": build.arch,
            "key_mma": "int8 m16n8k32 (query in two int8 bytes)" if build.kb == 2 else "fp16 m16n8k16",
            "registers": build.registers, "spill_bytes": build.spill_stores + build.spill_loads,
            "stack_bytes": build.stack, "loop_body_sass": back - head + 1, "loop_path_sass": len(path),
            "tokens_per_iteration": tokens,
            "warp_instr_per_token_head": per["total"], "alu_per_token_head": per["alu"],
            "fma_per_token_head": per["fma"], "mma_per_token_head": per["mma"], "mufu_per_token_head": per["mufu"],
            "shared_loads_per_token_head": per["lds"], "shared_stores_per_token_head": per["sts"],
            "local_per_token_head": per["ldl"] + per["stl"], "fsel_per_token_head": per["fsel"],
            "global_loads_by_bytes": {str(k): v for k, v in sorted(c["ldg"].items())},
            # the merge kernel's partial loads issued before the first is used (3 per split of a batch)
            "merge_loads_in_flight": sass.loads_in_flight(sass.kernel_sass(build.cubin, "kvq_frag_merge_kernel")[0])}


def gate_failures(row: dict) -> list[str]:
    """Issue 52's static gate for a row at d = 128 (empty when every check passes)."""
    out = []
    instr, alu = GATE[max(row["kbits"], row["vbits"])] if row["kbits"] == row["vbits"] else (None, None)
    if instr is not None and row["warp_instr_per_token_head"] > instr:
        out.append(f"{row['warp_instr_per_token_head']:.2f} warp instructions per token-head > {instr}")
    if alu is not None and row["alu_per_token_head"] > alu:
        out.append(f"{row['alu_per_token_head']:.2f} ALU-pipe operations per token-head > {alu}")
    if row["fsel_per_token_head"]:
        out.append("FSEL (a select tree) in the loop")
    if row["shared_stores_per_token_head"]:
        out.append("shared-memory stores in the loop (per-code staging)")
    # the cp.async ring: one 16/8-byte shared load per 16 or 8 bytes of codes, 4-8 per 16-token tile;
    # per-code staging would be 256 per tile (16 per token-head)
    if row["shared_loads_per_token_head"] > 0.75:
        out.append(f"{row['shared_loads_per_token_head']:.2f} shared loads per token-head (> 0.75)")
    if row["local_per_token_head"] or row["stack_bytes"] or row["spill_bytes"]:
        out.append("local memory (spills or stack)")
    if row["registers"] > MAX_REGISTERS:
        out.append(f"{row['registers']} registers > {MAX_REGISTERS}")
    if not row["global_loads_by_bytes"].get("16"):
        out.append("no 16-byte global loads")
    return out
