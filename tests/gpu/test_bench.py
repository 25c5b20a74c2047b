"""``gpu/bench.py --dry-run``: the GPU benchmark's whole code path on the CPU interpreter.

The timings of a dry run mean nothing; what is checked is that the script runs end to end as one
command, that its correctness gate passes (codes bit-exact, attention within 1e-3 relative), and that
it writes a JSON with every field the README and notebook 06 read.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run_writes_complete_json(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "gpu/bench.py", "--dry-run", "--bits", "2,4", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_dryrun.json").read_text())
    assert result["dry_run"] is True and result["met"] is None
    assert [c["bits"] for c in result["checks"]] == [2, 4]
    for c in result["checks"]:
        assert c["codes_bit_exact"] and c["attention_rel_err"] < 1e-3 and c["ok"]
    assert {(r["context"], r["bits"]) for r in result["decode"]} == {(64, 2), (64, 4), (97, 2), (97, 4)}
    for r in result["decode"]:
        # bytes moved = packed codes + float16 norms (TurboQuantMSE's default norm_dtype) of K and V,
        # batch 1 x 2 KV heads x context
        assert r["bytes"] == 2 * 2 * r["context"] * (128 * r["bits"] // 8 + 2)
    assert all(q["vectors"] == 256 for q in result["quantize"])
