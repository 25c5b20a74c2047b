"""Static report of the paged decode kernels compiled for sm_90, and an analytic time model.

No GPU is needed: ``build_split(config)`` compiles ``gpu.triton.paged._split_kernel`` for Hopper
with the specialization a real launch gets (Triton marks every pointer, and every integer argument
divisible by 16, as 16-divisible; integers equal to 1 become constants), so the PTX shows the loads
the runtime JIT would emit. From the artifacts it reads:

* registers and spill bytes (``ptxas -v``);
* the global loads by width in the PTX (``ld.global.v4.b32`` = 16-byte vector loads, ``b32`` words,
  ``b8`` bytes);
* the SASS of the encoded-token loop (``nvdisasm`` from the PyPI wheel ``nvidia-cuda-nvdisasm``,
  the ``gpu`` extra): instructions per warp per tile.

``estimate(config, ...)`` turns that into an expected time per benchmark case: the larger of
(bytes read / copy bandwidth) and (SASS instructions issued / issue rate), plus the launch cost of
the two kernels. It is a model, not a measurement. ``budget_columns`` adds issue 52's static columns
(warp instructions, ALU-pipe operations, FSEL, shared and local memory per token and KV head, by
``gpu.cuda.sass``'s classification), and ``main`` reports the CUDA fragment kernel beside the Triton one
(``gpu.cuda.static``, its gate and roofline).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Config", "BENCH_CONFIGS", "KernelBuild", "build_split", "loop_sass", "loop_loads", "static_report",
           "estimate", "main"]

H200_CLOCK_GHZ = 1.98        # boost clock of the H200 SXM
ISSUE_PER_SM_CYCLE = 4       # four warp schedulers per SM, one instruction each per cycle
ASSUMED_COPY_GBS = 4000.0    # a device-to-device copy on an H200 (HBM3e, 4.8 TB/s peak); unmeasured
LAUNCH_US = 4.0              # two kernel launches back to back (split + merge), host-free (graph) ~ 2 x 2 us


@dataclass(frozen=True)
class Config:
    """One benchmark configuration of the split kernel (decode: one query token)."""

    d: int
    g: int
    kbits: int
    vbits: int
    norm_dtype: str = "fp16"
    t: int = 1
    prec: str = "fp16"

    @property
    def label(self) -> str:
        return f"d{self.d}_g{self.g}_k{self.kbits}v{self.vbits}"


BENCH_CONFIGS = tuple(Config(d, g, b, b) for b in (2, 3, 4) for d in (64, 128, 256) for g in (1, 4, 8))


@dataclass(frozen=True)
class KernelBuild:
    """What the sm_90 artifacts of one configuration say."""

    config: Config
    block_n: int
    num_warps: int
    n_regs: int
    spill_stores: int
    spill_loads: int
    loads: dict          # PTX global loads by kind: "v4.b32", "v2.b32", "b32", "b16", "b8", ...
    cubin: bytes

    def summary(self) -> str:
        loads = ", ".join(f"{k} x{v}" for k, v in sorted(self.loads.items()))
        return (f"{self.config.label}: block_n {self.block_n}, {self.num_warps} warps, {self.n_regs} regs, "
                f"spills {self.spill_stores}/{self.spill_loads} B; global loads {loads}")


def _global_loads(ptx: str) -> dict:
    out: dict = {}
    for m in re.finditer(r"ld\.global(?:\.[a-z]+)*?((?:\.v[248])?\.[bsuf]\d+)\s", ptx):
        kind = m.group(1).lstrip(".")
        out[kind] = out.get(kind, 0) + 1
    return out


def build_split(cfg: Config, block_n: int | None = None, num_warps: int | None = None) -> KernelBuild:
    """Compile the split kernel of ``cfg`` for sm_90 as a real launch at batch 1, 8 KV heads would."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import paged
    from .hopper import _ptxas_usage

    if not isinstance(paged._split_kernel, triton.runtime.jit.JITFunction):
        raise TypeError("build_split needs compiled kernels: run it with TRITON_INTERPRET=0 (report.main does)")
    m_pad = paged.rows_pad(cfg.t * cfg.g)
    d_pad = max(32 if 3 in (cfg.kbits, cfg.vbits) else 16, triton.next_power_of_2(cfg.d))
    with _no_interpret():
        bn_default, block_b, warps = paged.default_blocks(cfg.d, m_pad, max(cfg.kbits, cfg.vbits))
    block_n = block_n or bn_default
    warps = num_warps or warps
    krow, vrow = paged.row_bytes_for(cfg.d, cfg.kbits), paged.row_bytes_for(cfg.d, cfg.vbits)
    ints = {"q_sb": cfg.t * 8 * cfg.g * cfg.d, "q_st": 8 * cfg.g * cfg.d, "q_sh": cfg.g * cfg.d, "bt_stride": 512,
            "H": 8, "P": 64, "BC": 256, "S": 50, "CHUNK": 2624}
    const = {"T": cfg.t, "G": cfg.g, "D": cfg.d, "M_PAD": m_pad, "D_PAD": d_pad, "KBITS": cfg.kbits,
             "VBITS": cfg.vbits, "KROW_WORDS": krow // 4, "VROW_WORDS": vrow // 4,
             "K_NWORDS": paged.row_words(cfg.d, cfg.kbits), "V_NWORDS": paged.row_words(cfg.d, cfg.vbits),
             "K_LOG_B": (cfg.d & -cfg.d).bit_length() - 1, "BLOCK_N": block_n, "BLOCK_B": block_b,
             "CAUSAL": False, "PREC": cfg.prec, "ALIGNED": True,
             "KSYM": cfg.kbits == 4, "VSYM": cfg.vbits == 4,  # kernel_params: symmetric 4-bit tables
             "PREFETCH": max(cfg.kbits, cfg.vbits) <= 2}  # launch_paged's default
    ptr = {"q_ptr": "*fp16", "qpos_ptr": "*i32", "kc_ptr": "*i32", "vc_ptr": "*i32", "kn_ptr": f"*{cfg.norm_dtype}",
           "vn_ptr": f"*{cfg.norm_dtype}", "bt_ptr": "*i32", "lens_ptr": "*i32", "encpos_ptr": "*i32",
           "bk_ptr": "*fp16", "bv_ptr": "*fp16", "blens_ptr": "*i32", "bpos_ptr": "*i32", "kperm_ptr": "*i32",
           "ksign_ptr": "*fp32", "ws_ptr": "*fp32"}
    names = paged._split_kernel.arg_names
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            if ints[name] == 1:
                sig[name], const[name] = "constexpr", 1
            else:
                sig[name] = "i32"
                if ints[name] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # scale, 1/sqrt(b) and the 32 levels
            sig[name] = "fp32"
    src = triton.compiler.ASTSource(fn=paged._split_kernel, signature=sig, constexprs=const, attrs=attrs)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "enable_fp_fusion": True})
    ptx = compiled.asm["ptx"]
    usage = _ptxas_usage(ptx, 90)
    return KernelBuild(cfg, block_n, warps, usage["n_regs"], usage["spill_stores"], usage["spill_loads"],
                       _global_loads(ptx), bytes(compiled.asm["cubin"]))


class _no_interpret:
    def __enter__(self):
        self.old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self.old


def nvdisasm_path() -> str | None:
    """The nvdisasm binary of the ``nvidia-cuda-nvdisasm`` wheel (or on PATH), None if absent."""
    try:
        import nvidia
        for root in nvidia.__path__:
            for p in Path(root).glob("*/bin/nvdisasm"):
                return str(p)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def loop_sass(cubin: bytes) -> list[str]:
    """SASS instructions of the encoded-token loop of a split-kernel cubin: the backward-branch range
    holding the most FSEL (the level select tree; the band loop has none of it)."""
    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the gpu extra)")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        text = subprocess.run([tool, "-c", str(f)], capture_output=True, text=True, check=True).stdout
    lines, labels = [], {}
    for raw in text.splitlines():
        lab = re.match(r"^\s*(\.L_x_\d+):", raw)
        if lab:
            labels[lab.group(1)] = len(lines)
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", raw)
        if m:
            lines.append(m.group(2).strip())
    best: list[str] = []
    for i, ins in enumerate(lines):
        m = re.search(r"\bBRA\b.*?`?\(?(\.L_x_\d+)\)?", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = lines[labels[m.group(1)]:i + 1]
            if sum("FSEL" in x for x in body) > sum("FSEL" in x for x in best):
                best = body
    return best


def loop_loads(loop: list[str]) -> dict:
    """Global loads of a SASS loop by width in bytes: ``LDG.E.128`` / ``LDGSTS.E.BYPASS.128`` -> 16,
    ``.64`` -> 8, plain ``LDG.E``/``LDGSTS.E`` -> 4, ``.U16``/``.S16`` -> 2, ``.U8``/``.S8`` -> 1."""
    out: dict = {}
    for ins in loop:
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        if not op.startswith(("LDG.", "LDGSTS.")):
            continue
        m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
        width = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}[m.group(1)] if m else 4
        out[width] = out.get(width, 0) + 1
    return out


def budget_columns(loop: list[str], num_warps: int, block_n: int) -> dict:
    """Issue 52's static columns for a Triton loop (``gpu.cuda.sass.count``, the CUDA kernel's
    classification): per token and KV head, a tile of block_n tokens being one loop iteration of each
    of num_warps warps (Triton's loop has no rarely taken branch: its whole body is the path)."""
    from gpu.cuda.sass import count

    c = count(loop)
    per = num_warps / block_n
    return {"warp_instr_per_token_head": c["total"] * per, "alu_per_token_head": c["alu"] * per,
            "fma_per_token_head": c["fma"] * per, "mma_per_token_head": c["mma"] * per,
            "fsel_per_token_head": c["fsel"] * per, "shared_loads_per_token_head": (c["lds"] + c["ldsm"]) * per,
            "shared_stores_per_token_head": (c["sts"] + c["stsm"]) * per,
            "local_per_token_head": (c["ldl"] + c["stl"]) * per}


def _report_row(cfg: Config) -> dict:
    b = build_split(cfg)
    loop = loop_sass(b.cubin)
    return {"config": cfg, "block_n": b.block_n, "num_warps": b.num_warps, "n_regs": b.n_regs,
            "spill_stores": b.spill_stores, "spill_loads": b.spill_loads, "ptx_loads": b.loads,
            "loop_sass": len(loop), "loop_loads": loop_loads(loop), "loop_fsel": sum("FSEL" in x for x in loop),
            **budget_columns(loop, b.num_warps, b.block_n)}


def static_report(configs=BENCH_CONFIGS, workers: int | None = None) -> list[dict]:
    """Registers, spills, PTX global loads, and the encoded loop's SASS size and loads by width, for
    every configuration (picklable rows; ``hopper.in_compile_process`` runs this under the
    interpreter). Compiles run in ``workers`` processes (default: the CPU count, at most 4)."""
    from concurrent.futures import ProcessPoolExecutor

    workers = workers or min(4, os.cpu_count() or 1)
    if workers == 1:
        return [_report_row(c) for c in configs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_report_row, configs))


def bytes_per_token_head(d: int, kbits: int, vbits: int, norm_bytes: int = 2) -> int:
    """Bytes the kernel reads per encoded token and KV head: K and V rows (padded layout) + 2 norms."""
    from .paged import row_bytes_for
    return row_bytes_for(d, kbits) + row_bytes_for(d, vbits) + 2 * norm_bytes


def estimate(build: KernelBuild, batch: int, kv_heads: int, tokens: int, loop_instructions: int,
             copy_gbs: float = ASSUMED_COPY_GBS, num_sms: int = 132) -> dict:
    """Expected time of one decode call (model): max(bandwidth, issue) + launches.

    bandwidth: ``batch kv_heads tokens bytes_per_token_head / copy_gbs``; issue: tiles x warps x loop
    instructions / (SMs x 4 schedulers x clock), spread over the SMs the plan keeps busy
    (``min(1, programs / SMs)``)."""
    from .paged import plan_splits
    cfg = build.config
    plan = plan_splits(batch, kv_heads, tokens, build.block_n, num_sms=num_sms)
    nbytes = batch * kv_heads * tokens * bytes_per_token_head(cfg.d, cfg.kbits, cfg.vbits)
    t_bw = nbytes / (copy_gbs * 1e9)
    tiles = batch * kv_heads * -(-tokens // build.block_n)
    busy = min(1.0, batch * kv_heads * plan.splits / num_sms)
    t_issue = tiles * build.num_warps * loop_instructions / (num_sms * busy * ISSUE_PER_SM_CYCLE * H200_CLOCK_GHZ * 1e9)
    fp16_bytes = batch * kv_heads * tokens * 2 * cfg.d * 2
    t = max(t_bw, t_issue) + LAUNCH_US * 1e-6
    return {"config": cfg.label, "batch": batch, "kv_heads": kv_heads, "tokens": tokens, "splits": plan.splits,
            "waves": plan.waves, "bytes": nbytes, "bandwidth_s": t_bw, "issue_s": t_issue,
            "bound": "bandwidth" if t_bw >= t_issue else "issue", "expected_s": t,
            "fp16_sdpa_at_copy_bw_s": fp16_bytes / (copy_gbs * 1e9),
            "expected_speedup_vs_fp16_at_copy_bw": fp16_bytes / (copy_gbs * 1e9) / t}


def main(argv=None) -> list:
    """Print (and return) the static report and the model for every benchmark configuration."""
    import argparse
    import json

    from .paged import rows_pad

    p = argparse.ArgumentParser(description="static sm_90 report + analytic model of the decode kernels")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    print(f"model: copy bandwidth {ASSUMED_COPY_GBS:.0f} GB/s (assumed, unmeasured), {H200_CLOCK_GHZ} GHz x "
          f"{ISSUE_PER_SM_CYCLE} issue/SM/cycle x 132 SMs, {LAUNCH_US} us for the two launches")
    for cfg in BENCH_CONFIGS:
        b = build_split(cfg)
        loop = loop_sass(b.cubin) if nvdisasm_path() else []
        print(b.summary() + (f"; loop {len(loop)} SASS instructions per warp per {b.block_n} tokens" if loop else ""))
        row = {"config": cfg.label, "kernel": "triton _split_kernel", "n_regs": b.n_regs,
               "spill_bytes": b.spill_stores + b.spill_loads, "m_pad": rows_pad(cfg.t * cfg.g),
               "ptx_loads": b.loads, "loop_loads_by_bytes": loop_loads(loop), "block_n": b.block_n,
               "num_warps": b.num_warps, "loop_sass": len(loop),
               "sass_per_token_head": len(loop) * 32 * b.num_warps / b.block_n,
               **(budget_columns(loop, b.num_warps, b.block_n) if loop else {}),
               "bytes_per_token_head": bytes_per_token_head(cfg.d, cfg.kbits, cfg.vbits), "model": []}
        if loop and cfg.g == 4 and cfg.d == 128:
            for batch in (1, 16):
                for n in (4096, 32768, 131072):
                    e = estimate(b, batch, 8, n, len(loop))
                    row["model"].append(e)
                    print(f"   batch {batch:>2} {n:>6} tokens: {e['expected_s'] * 1e6:8.1f} us ({e['bound']}-bound, "
                          f"{e['splits']} splits), x{e['expected_speedup_vs_fp16_at_copy_bw']:.2f} vs fp16 at copy bw")
        rows.append(row)
    cuda = cuda_report()
    if args.json:
        from gpu.cuda import roofline, static

        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"assumed_copy_gbs": ASSUMED_COPY_GBS, "clock_ghz": H200_CLOCK_GHZ, "sms": 132,
                "issue_per_sm_cycle": ISSUE_PER_SM_CYCLE, "launch_us": LAUNCH_US, "measured": False,
                "gate_d128": {str(k): {"warp_instr_per_token_head": v[0], "alu_per_token_head": v[1]}
                              for k, v in static.GATE.items()},
                "cuda_roofline_model": roofline.device_meta(),
                "command": "TRITON_INTERPRET=0 python -m gpu.triton.report --json " + str(args.json)}
        args.json.write_text(json.dumps({"meta": meta, "configs": rows, "cuda": cuda}, indent=1, default=str) + "\n")
    return rows


def cuda_report() -> list[dict]:
    """The CUDA fragment kernel's static rows (gpu.cuda.static) at head_dim 64/128/256 and 2/3/4 bits
    (K = V bits; the GQA group is a runtime row count, G <= 8 share one code), with issue 52's gate and
    the roofline predictions (gpu.cuda.roofline) at head_dim 128; [] without nvcc."""
    from gpu.cuda import binding, roofline, static

    if binding.find_nvcc() is None or nvdisasm_path() is None:
        print("no nvcc/nvdisasm: the CUDA fragment kernel is not reported")
        return []
    out = []
    for d in (64, 128, 256):
        for bits in (2, 3, 4):
            row = static.fragment_row(static.fragment_build(d, bits, bits))
            if d == 128:
                row["gate_failures"] = static.gate_failures(row)
                row["roofline"] = roofline.prediction_table([row])
            print(f"cuda {row['config']}: {row['warp_instr_per_token_head']:.2f} warp instr / token-head, ALU "
                  f"{row['alu_per_token_head']:.2f}, {row['registers']} regs" +
                  (f", gate {'passed' if not row['gate_failures'] else row['gate_failures']}" if d == 128 else ""))
            if d == 128:
                print(roofline.describe(row["roofline"]))
            out.append(row)
    return out


if __name__ == "__main__":
    main()
