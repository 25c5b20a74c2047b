"""A roofline model of the CUDA fragment kernel on an H200 over its static instruction counts (no GPU).

What a decode call costs, per the model (every constant below is a stated assumption, not a
measurement of this kernel):

* the split kernel's loop, per token and KV head, needs ``max`` of four resources, spread over 132 SMs:
  bytes / streaming bandwidth (``STREAM_BPS``: 4.61 TB/s, the fastest fp16 FlashAttention read the
  project measured on its H200, results/gpu/bench_nvidia_h200.json); warp instructions / (4 schedulers
  x 1 per clock); ALU-pipe operations / (4 x 0.5 per clock: 16-lane pipe); tensor-core MMAs /
  (``MMA_PER_SM_CLOCK`` = 0.5 m16n8k16 per SM per clock, half the dense fp16 peak, as mma.sync reaches
  less than wgmma). The clock is 1.755 GHz (ncu on the H200 saw 1.74-1.80 GHz). The resources
  overlap perfectly (the roofline's optimism) and the grid's CTAs share the machine evenly (the split
  plan gives every CTA the same number of tokens but the last);
* fixed costs: the split kernel's launch from a CUDA graph (``LAUNCH_US``, 2.5 us; the merge kernel's own
  launch is hidden: it is a programmatic dependent launch that the split CTAs release as they start, so
  it overlaps the split kernel; with ``dependent_merge=False`` it is paid too), a CTA's prologue
  (``PROLOGUE_US``: the query's load and rotation, 1 us) and the pipeline's fill (the first tiles' round
  trip, ``MEMORY_LATENCY_US``, 0.7 us), which overlap: the split CTAs issue their first copies before
  they read the query (``overlap_fill``; without it they add up), and the merge kernel, latency-bound:
  ``1 + ceil(S / (B SG))`` dependent memory round trips of ``MEMORY_LATENCY_US`` each (the batches of
  ``B = MERGE_BATCH`` = 16 splits' loads each of its ``SG = 512 / d`` split groups has in flight, the
  band partial's loads going out with the first, and the output's store), plus 1 us.

The **ceiling** of a call is the same loop with one launch and nothing else (no prologue, no merge): what
any kernel with these instruction counts could reach if its only fixed cost were the launch. Where the
ceiling is under a target, no change to the merge or the prologue can meet it.

Fraction of the 4.8 TB/s spec = bytes read / (time x 4.8 TB/s). The model says where the time goes;
only a device run measures it (``gpu/check_device.sh``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule import plan_splits

__all__ = ["H200", "Device", "MERGE_BATCH", "bytes_per_token_head", "predict", "prediction_table"]


@dataclass(frozen=True)
class Device:
    sms: int = 132
    clock_hz: float = 1.755e9
    spec_bps: float = 4.8e12
    stream_bps: float = 4.61e12           # measured fp16 FlashAttention read on the project's H200
    issue_per_sm_clock: float = 4.0       # 4 schedulers, one warp instruction each
    alu_per_sm_clock: float = 2.0         # 4 x 16-lane ALU pipes: half rate
    mma_per_sm_clock: float = 0.5         # m16n8k16 (or two m16n8k32 int8 passes of d/32) per SM clock
    launch_us: float = 2.5                # one kernel launched from a CUDA graph
    dependent_merge: bool = True          # the merge's launch overlaps the split kernel (PDL)
    prologue_us: float = 1.0              # a split CTA's query load and rotation before its loop
    overlap_fill: bool = True             # the first tiles' copies go out before the query is read
    merge_fixed_us: float = 1.0
    memory_latency_us: float = 0.7        # a dependent global-memory round trip, lightly loaded


H200 = Device()
STREAM_BPS = H200.stream_bps
LAUNCH_US = H200.launch_us
PROLOGUE_US = H200.prologue_us
MMA_PER_SM_CLOCK = H200.mma_per_sm_clock
MEMORY_LATENCY_US = H200.memory_latency_us
#: Splits whose partials a merge thread loads before it uses the first (KVQ_MERGE_BATCH in
#: kvq_frag_parts.cuh; tests/gpu/test_cuda_static.py checks the two agree and the SASS issues them so).
MERGE_BATCH = 16


def bytes_per_token_head(d: int, kbits: int, vbits: int) -> float:
    """Bytes the kernel reads per token and KV head: the tile bytes / 16 (codes and two fp16 norms)."""
    return (2 * d * (kbits + vbits) + 64) / 16


def predict(row: dict, batch: int, tokens: int, kv_heads: int = 8, group: int = 4, device: Device = H200) -> dict:
    """Predicted time of one decode call for a static-report ``row`` (gpu.cuda.static.fragment_row)."""
    d, kb, vb = row["d"], row["kbits"], row["vbits"]
    u = 1 if 4 in (kb, vb) else 2
    plan = plan_splits(batch, kv_heads, tokens, 64 * u, num_sms=device.sms)
    token_heads = batch * kv_heads * tokens
    nbytes = token_heads * bytes_per_token_head(d, kb, vb)
    clock_total = device.sms * device.clock_hz
    t = {"memory": nbytes / device.stream_bps,
         "issue": token_heads * row["warp_instr_per_token_head"] / (clock_total * device.issue_per_sm_clock),
         "alu": token_heads * row["alu_per_token_head"] / (clock_total * device.alu_per_sm_clock),
         "tensor": token_heads * row["mma_per_token_head"] / (clock_total * device.mma_per_sm_clock)}
    bound = max(t, key=t.get)
    loop = t[bound]
    trips = 1 + math.ceil(plan.splits / (MERGE_BATCH * (512 // d)))  # kvq_frag_merge_kernel: 512 threads
    merge = (device.merge_fixed_us + trips * device.memory_latency_us) * 1e-6
    launch = device.launch_us * 1e-6
    launches = launch * (1 if device.dependent_merge else 2)
    start = (max if device.overlap_fill else sum)((device.prologue_us, device.memory_latency_us)) * 1e-6
    fixed = launches + start + merge
    total = loop + fixed
    fp16_bytes = token_heads * 2 * d * 2
    return {"config": row["config"], "batch": batch, "tokens": tokens, "kv_heads": kv_heads, "group": group,
            "splits": plan.splits, "ctas": batch * kv_heads * (plan.splits + 1), "bytes": nbytes,
            "loop_s": {k: v for k, v in t.items()}, "bound": bound, "fixed_s": fixed, "merge_s": merge,
            "seconds": total, "bandwidth_bps": nbytes / total, "fraction_of_spec": nbytes / total / device.spec_bps,
            "loop_fraction_of_spec": nbytes / loop / device.spec_bps,
            "ceiling_fraction_of_spec": nbytes / (loop + launch) / device.spec_bps,
            "speedup_vs_ideal_fp16": fp16_bytes / device.spec_bps / total}


def prediction_table(rows: list[dict], batches=(1, 16), contexts=(32768, 131072), device: Device = H200) -> list[dict]:
    """``predict`` for every row x batch x context."""
    return [predict(r, b, n, device=device) for r in rows for b in batches for n in contexts]


def device_meta(device: Device = H200) -> dict:
    """The model's assumptions, for the JSON report."""
    return {k: getattr(device, k) for k in device.__dataclass_fields__} | {"measured": False}


def _fmt(p: dict) -> str:
    return (f"{p['config']} batch {p['batch']:>2} {p['tokens'] // 1024:>4}K: {p['seconds'] * 1e6:8.1f} us "
            f"({p['bound']}-bound loop {max(p['loop_s'].values()) * 1e6:7.1f} us + fixed {p['fixed_s'] * 1e6:4.1f} us), "
            f"{100 * p['fraction_of_spec']:5.1f} % of 4.8 TB/s (ceiling {100 * p['ceiling_fraction_of_spec']:5.1f} %), "
            f"x{p['speedup_vs_ideal_fp16']:.2f} vs ideal fp16 read")


def describe(preds: list[dict]) -> str:
    return "\n".join(_fmt(p) for p in preds)


if __name__ == "__main__":  # pragma: no cover - a convenience printout
    from .static import fragment_build, fragment_row

    rows = [fragment_row(fragment_build(128, b, b)) for b in (2, 3, 4)]
    print(describe(prediction_table(rows)))
    print("math check:", math.isclose(bytes_per_token_head(128, 2, 2), 68.0))
