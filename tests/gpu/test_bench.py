"""``gpu/bench.py --dry-run``: the GPU benchmark's whole plan on the CPU interpreter.

The timings of a dry run mean nothing; what is checked is that the script runs end to end as one
command, that its correctness gate passes (quantize and append bit-exact, contiguous and paged
attention within 2e-3 relative, for the Triton kernels and, on the host emulation, the CUDA fragment
kernel), and that it writes a JSON with every field docs/gpu.md and notebook 06 read.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run_writes_complete_json(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "gpu/bench.py", "--dry-run", "--bits", "2,4", "--bands", "0,8",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_dryrun.json").read_text())
    assert result["dry_run"] is True and result["met"] is None and result["complete"] is True
    assert not list(tmp_path.glob("*.tmp"))  # written through a temp file and a rename
    backends = result["backends"]
    assert backends[0] == "triton" and set(backends) <= {"triton", "cuda", "cuda-plain"}
    assert [c["bits"] for c in result["checks"]] == [2, 4] * len(backends)
    for c in result["checks"]:
        assert c["append_bit_exact"] and c["ok"] and c["paged_attention_rel_err"] < 2e-3
        if not c.get("backend", "").startswith("cuda"):
            assert c["codes_bit_exact"] and c["attention_rel_err"] < 2e-3
    rows = [(r["backend"], r["batch"], r["context"], r["bits"], r["band"]) for r in result["decode"]]
    assert len(rows) == len(set(rows)) and set(rows) == {
        (k, b, n, bits, w) for k in backends for b in (1, 2) for n in (64, 97) for bits in (2, 4) for w in (0, 8)
        if k == "triton" or b == 1}  # the dry run times the emulated CUDA kernels at batch 1 only
    assert result["read_probe_gbs"] > 0 and result["spec_gbs"] is None  # no spec for a CPU
    for r in result["decode"]:
        # bytes read = K and V rows (d=128: 32 or 64 bytes, no padding) + two float16 norms,
        # batch x 2 KV heads x context, + the float16 band's K and V; the fp16 baseline reads K and V
        # at 2 bytes a value
        assert r["bytes"] == r["batch"] * 2 * (r["context"] * (2 * 128 * r["bits"] // 8 + 4) + r["band"] * 2 * 128 * 2)
        assert r["sdpa_bytes"] == r["batch"] * 2 * r["context"] * 2 * 128 * 2
        for key in ("seconds", "fraction_of_copy_bandwidth", "speedup_vs_sdpa", "sdpa_bandwidth_gbs"):
            assert key in r
        assert r["fraction_of_read_probe"] == r["bandwidth_gbs"] / result["read_probe_gbs"]
        assert r["fraction_of_spec"] is None and r["speedup_vs_ideal_fp16"] is None
    assert [a["bits"] for a in result["append"]] == [2, 4]
    assert all(a["tokens"] == 16 and a["fraction_of_copy_bandwidth"] > 0 for a in result["append"])
    assert result["copy_bandwidth_gbs"] > 0 and result["targets"]["speedup_vs_sdpa_2bit"] == 5.0
    # dry run: no FlashAttention baseline (NaN), so the reference is the copy bandwidth
    assert result["reference_bandwidth_gbs"] == result["copy_bandwidth_gbs"]
    for r in result["decode"] + result["append"]:
        assert r["fraction_of_reference_bandwidth"] == r["bandwidth_gbs"] / result["reference_bandwidth_gbs"]


def test_backends_dispatch_and_specs():
    from gpu.bench import paged_decode_attention, spec_bandwidth

    assert spec_bandwidth("NVIDIA H200") == 4.8e12 and spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert spec_bandwidth("NVIDIA A100") is None
    with pytest.raises(ValueError, match="backend"):
        paged_decode_attention(None, None, None, None, backend="tpu")


def test_reference_bandwidth_is_the_faster_of_copy_and_flashattention():
    from gpu.bench import _add_reference_bandwidth

    res = {"copy_bandwidth_gbs": 2760.0, "append": [{"bandwidth_gbs": 100.0}],
           "decode": [{"bandwidth_gbs": 400.0, "sdpa_bandwidth_gbs": 4300.0},
                      {"bandwidth_gbs": 200.0, "sdpa_bandwidth_gbs": float("nan")}]}
    _add_reference_bandwidth(res)
    assert res["reference_bandwidth_gbs"] == 4300.0
    assert [r["fraction_of_reference_bandwidth"] for r in res["decode"]] == [400 / 4300, 200 / 4300]
    assert res["append"][0]["fraction_of_reference_bandwidth"] == 100 / 4300


def test_sweep_dry_run_reports_every_variant(tmp_path):
    """gpu/sweep.py's plan on the CPU interpreter: every variant checked against the default and timed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "gpu/sweep.py", "--dry-run", "--bits", "2", "--batches", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "sweep_dryrun.json").read_text())
    from gpu.sweep import VARIANTS
    assert result["complete"] is True and [r["variant"] for r in result["rows"]] == [v[0] for v in VARIANTS]
    for r in result["rows"]:
        assert "error" not in r, r
        assert r["rel_diff_vs_default"] < 1e-3 and r["seconds"] > 0 and r["relative_time"] > 0
    assert result["rows"][0]["relative_time"] == 1.0


def test_device_scripts_parse_and_select_tests():
    """gpu/check_device.sh and gpu/diagnose_device.sh are valid bash, and every pytest selection in
    them still selects tests (a renamed test would silently drop out of the device check)."""
    import re

    for script in ("gpu/check_device.sh", "gpu/diagnose_device.sh"):
        text = (ROOT / script).read_text()
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
        selections = re.findall(r"(tests/gpu/\S+\.py)[^\n]*\n?\s*-k \"([^\"]+)\"", text)
        assert selections, script
        for path, expr in selections:
            proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                   path, "-k", expr], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert re.search(r"\d+/\d+ tests collected|\d+ tests? collected", proc.stdout), (script, expr, proc.stdout)
            assert " 0 selected" not in proc.stdout and "no tests ran" not in proc.stdout, (script, expr)


def test_ncu_comparison_reads_the_csv_and_flags_10_percent(tmp_path, monkeypatch):
    """gpu.cuda.device_check's comparator on an ncu --csv report in ncu's format (no GPU): counts per
    token-head against the static row, within 10 % or not."""
    from gpu.cuda import device_check, static

    th = 16 * 8 * 32768
    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",' \
           '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'

    def line(kernel, name, unit, value):
        return (f'"0","1","python","h","{kernel}","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0",'
                f'"Command line profiler metrics","{name}","{unit}","{value}"\n')
    rows = {2: {"warp_instr_per_token_head": 12.0, "alu_per_token_head": 5.0},
            3: {"warp_instr_per_token_head": 16.0, "alu_per_token_head": 10.0}}
    monkeypatch.setattr(device_check, "_static_row", lambda _s, d, bits: {**rows[bits], "d": d})
    paths = []
    for bits, factor in ((2, 1.05), (3, 1.2)):
        text = "==PROF== Connected to process\n" + head
        text += line("void kvq_frag_split_kernel<128, 2, 2>(FragArgs)", "smsp__inst_executed.sum", "inst",
                     f"{rows[bits]['warp_instr_per_token_head'] * th * factor:,.0f}")
        text += line("void kvq_frag_split_kernel<128, 2, 2>(FragArgs)", "smsp__inst_executed_pipe_alu.sum", "inst",
                     f"{rows[bits]['alu_per_token_head'] * th:.0f}")
        text += line("void kvq_frag_merge_kernel<128>(FragArgs)", "smsp__inst_executed.sum", "inst", "1")
        text += line("void kvq_frag_split_kernel<128, 2, 2>(FragArgs)", "gpu__time_duration.sum", "usecond", "70")
        text += line("void kvq_frag_split_kernel<128, 2, 2>(FragArgs)", "dram__bytes_read.sum", "Mbyte", "285.2")
        p = tmp_path / f"ncu_fragment_{bits}bit.csv"
        p.write_text(text)
        paths.append(p)
    out = device_check.compare(paths, tmp_path / "out.json")
    r2, r3 = out["rows"]
    assert r2["measured_warp_instr_per_token_head"] == pytest.approx(12.0 * 1.05, rel=1e-6)
    assert r2["within_10_percent"] == {"warp_instr_per_token_head": True, "alu_per_token_head": True}
    assert r3["within_10_percent"]["warp_instr_per_token_head"] is False
    assert r2["dram_read_gbs"] == pytest.approx(285.2e6 / 70e-6 / 1e9)
    assert static.GATE[2] == (15.0, 9.0)
