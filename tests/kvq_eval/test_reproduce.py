"""Cells reproduce (issue 56): a committed NOVA-KV needle cell is recomputed from scratch, its own
calibration included, and must come out bit for bit where the environment its provenance records
is this one; calibration does not depend on thread counts.

Why "the same environment": the float32 forward's last bits depend on the CPU kernels torch
dispatches to (AVX2 vs AVX-512), on torch/transformers versions and on thread counts, and a
quantizer turns a last-bit change of a key near a threshold into another code. On one needle
sample that moved TurboQuantMSE-3's answer log-probability by 0.08 nats and NOVA-KV's by 3.4
between protocol v2's and v3's runs (docs/evaluation.md: reproducibility), while 8K perplexity
windows, averages over 8K tokens, moved by 6e-11 nats. So an entry records its environment, and
in the same environment the result is exact (tolerance 0); elsewhere only its distribution is
the same, which a single cell cannot test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "results" / "repro"
CELL = "smollm2/niah/single_ctx1024_d0.5_s0.json"
# `make repro`: the committed cell's grid
GRID = dict(methods=["tq_mse3", "nova"], contexts=(1024,), tasks=("niah",), variants=("single",), depths=(0.5,),
            samples=1, bands=("none", "1,0"), calib_tokens=1024, progress=False)
# the processor model too: an AMD and an Intel AVX-512 machine (both "AVX512") gave fp32 log-probabilities
# 1e-6 apart on this cell
ENV_FIELDS = ("cpu", "cpu_model", "versions")


def _environment_differs(stored: dict, now: dict) -> list[str]:
    diff = [f for f in ENV_FIELDS if stored.get(f) != now.get(f)]
    if stored.get("threads", {}).get("torch") != now.get("threads", {}).get("torch"):
        diff.append("threads.torch")
    return diff


def test_the_repro_cell_is_committed_with_its_provenance():
    cell = json.loads((REPRO / CELL).read_text())
    assert set(cell["results"]) == {"fp32", "tq_mse3@none", "tq_mse3@1,0", "nova@none", "nova@1,0"}
    for name, entry in cell["results"].items():
        prov = entry["provenance"]
        assert prov["protocol"] == 3 and prov["cpu"] and prov["versions"]["torch"], name
        assert ("artifacts" in prov) == name.startswith("nova"), name
        assert not str(prov["code"]).endswith("+dirty"), "make repro from a clean checkout"


@pytest.mark.model
def test_a_committed_nova_cell_reproduces_bit_for_bit(tmp_path, monkeypatch):
    import kvq_eval.calib as calib
    from kvq_eval.provenance import environment
    from kvq_eval.runner import run_grid

    stored = json.loads((REPRO / CELL).read_text())
    env = environment()
    differs = _environment_differs(stored["results"]["nova@none"]["provenance"], env)
    if differs:
        pytest.skip(f"the committed cell was made in another environment ({', '.join(differs)} differ): "
                    f"results agree in distribution there, not bit for bit (module docstring)")
    # a fresh calibration, never one this machine has cached
    monkeypatch.setattr(calib, "calibration_folder", lambda name, *a, **k: tmp_path / "calibration" / name)
    run_grid("smollm2", out=tmp_path, **GRID)
    new = json.loads((tmp_path / CELL).read_text())
    for field in ("keys", "values", "offset", "prompt_tokens"):
        assert new[field] == stored[field], field
    for name, old in stored["results"].items():
        got = new["results"][name]
        for field in ("exact", "logprob", "answer", "bits_per_element"):
            assert got[field] == old[field], (name, field)  # tolerance 0: same environment
        # the calibration was rebuilt from scratch and must be the same
        assert got["provenance"].get("artifacts") == old["provenance"].get("artifacts"), name


def test_calibration_does_not_depend_on_thread_counts():
    """The NOVA-KV calibration (statistics, transforms, equal-volume groups, k-means) gives the same
    bytes with 1 and 2 BLAS and Numba threads (synthetic captures of 2 layers)."""
    import numba
    from threadpoolctl import threadpool_limits

    from codebooks.nova import calibrate

    rng = np.random.default_rng(5)
    scales = np.exp(rng.normal(0, 0.7, 64))
    seqs = [{layer: (rng.standard_normal((4, 256, 64)) * scales, rng.standard_normal((2, 256, 64)) * scales,
                     rng.standard_normal((2, 256, 64))) for layer in range(2)} for _ in range(2)]
    digests = []
    n0 = numba.get_num_threads()
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        try:
            with threadpool_limits(threads):
                stats, model = calibrate(seqs, 64, iterations=3)
        finally:
            numba.set_num_threads(n0)
        digests.append([model.heads[k].digest for k in sorted(model.heads)])
    assert digests[0] == digests[1]
