"""Issue 52's static gate on the CUDA fragment kernel (sm_90a SASS, no GPU), and its roofline model.

``gpu.cuda.static`` compiles ``kvq_frag_attention.cu`` with nvcc for d = 128 at 2, 3 and 4 bits (G is a
runtime row count: the code is the one of G = 4) and reads the split kernel's loop on its common path
(``gpu.cuda.sass.fast_path``). The gate, per token and KV head: warp instructions <= 15 / 16 / 24 and
ALU-pipe operations <= 9 / 11.5 / 14.5 at 2 / 3 / 4 bits; no FSEL (select trees); no shared-memory stores
and at most 0.75 shared loads (the cp.async ring's, 4-8 per 16-token tile; per-code staging would be 16);
no local memory; <= 128 registers; 16-byte global loads. Skips without nvcc or nvdisasm. About 10 s.

The SASS walker itself is checked on a hand-written listing (a loop with a rarely taken branch): its
path is the shortest one from the loop head to the backward branch.
"""

from __future__ import annotations

import math

import pytest

from gpu.cuda import roofline, sass, static
from gpu.cuda.binding import find_nvcc
from gpu.triton.report import nvdisasm_path

needs_tools = pytest.mark.skipif(find_nvcc() is None or nvdisasm_path() is None,
                                 reason="needs nvcc (CUDA toolkit) and nvdisasm (the gpu extra)")


@pytest.fixture(scope="module")
def rows():
    return {b: static.fragment_row(static.fragment_build(128, b, b)) for b in (2, 3, 4)}


@needs_tools
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fragment_kernel_fits_the_budget(rows, bits, capsys):
    r = rows[bits]
    with capsys.disabled():
        print(f"\n{r['config']}: {r['warp_instr_per_token_head']:.2f} warp instr / token-head "
              f"(ALU {r['alu_per_token_head']:.2f}, FMA {r['fma_per_token_head']:.2f}), {r['registers']} regs, "
              f"loads by bytes {r['global_loads_by_bytes']}, gate {static.GATE[bits]}")
    assert static.gate_failures(r) == [], r
    assert r["mma_per_token_head"] == 1.0  # d / 8 MMAs per 16-token tile: K (fp16, or 2 int8 passes) and V


@needs_tools
def test_roofline_loop_is_memory_or_alu_bound_above_70_percent(rows):
    """With the fixed costs left out, every width's loop reaches >= 70 % of 4.8 TB/s on the model's H200
    (the instruction budget's claim); whole calls: >= 70 % at batch 16 (32K, 128K), launches and merge
    included; batch 1 is dominated by them at 32K (the model's numbers go to the README)."""
    for bits, r in rows.items():
        for batch in (1, 16):
            for n in (32768, 131072):
                p = roofline.predict(r, batch, n)
                assert p["loop_fraction_of_spec"] >= 0.7, p
                if batch == 16:
                    assert p["fraction_of_spec"] >= 0.7, p
    # the arithmetic, by hand, for one cell: 2 bits, batch 16, 128K tokens, 8 heads
    p = roofline.predict(rows[2], 16, 131072)
    th = 16 * 8 * 131072
    t_mem = th * 68 / 4.61e12
    t_issue = th * rows[2]["warp_instr_per_token_head"] / (132 * 1.755e9 * 4)
    assert p["bytes"] == th * 68 and math.isclose(p["loop_s"]["memory"], t_mem)
    assert math.isclose(p["loop_s"]["issue"], t_issue) and p["bound"] == "memory"
    assert math.isclose(p["seconds"], t_mem + p["fixed_s"])


def test_fast_path_takes_the_shortest_way_round_the_loop():
    lines = ["MOV R1, R2", "LOP3.LUT R3, R1, 0x3, RZ, 0xc0, !PT", "HMMA.16816.F32 R4, R8, R12, R4",
             "@P0 BRA `(.L_x_2)", "FMUL R5, R5, R6", "SHFL.BFLY PT, R5, R5, 0x4, 0x1f", "FMNMX R5, R5, R6, !PT",
             "PRMT R7, R8, R9, R10", "ISETP.GE.AND P1, PT, R1, R2, PT", "@!P1 BRA `(.L_x_1)", "EXIT"]
    labels = {".L_x_1": 1, ".L_x_2": 7}
    head, back = sass.main_loop(lines, labels)
    assert (head, back) == (1, 9)
    path = sass.fast_path(lines, labels, head, back)
    assert path == lines[1:4] + lines[7:10]  # the branch skips the rescale block
    c = sass.count(path)
    assert c["total"] == 6 and c["alu"] == 3 and c["mma"] == 1 and c["shfl"] == 0
    assert sass.opcode("@!P0 LOP3.LUT R1, R2, 0x1, RZ, 0xc0, !PT") == "LOP3"
