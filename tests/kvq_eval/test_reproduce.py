"""Cells reproduce (issue 56): a committed NOVA-KV needle cell is recomputed from scratch, its own
calibration included, on the portable numeric path, and must come out bit for bit on any x86-64
processor; calibration does not depend on thread counts.

Why the portable path: on the native one the float32 forward's last bits depend on the kernels MKL,
ATen, oneDNN, OpenBLAS and Numba pick for the processor (an AMD and an Intel AVX-512 machine gave
this cell's fp32 log-probabilities 1e-6 apart), and a quantizer turns a last-bit change of a key
near a threshold into another code: TurboQuantMSE-3's answer log-probability moved by 0.15 nats and
NOVA-KV's by 0.4, and NOVA-KV's k-means turned the calibration into other tables. The portable
path (``kvq_eval.provenance.PORTABLE``, ``make repro``) gives every processor the same instructions,
so the tolerance is 0 wherever the library versions are the committed ones. What the native path
moves is measured on 30 samples by ``make numerics`` (results/numerics, docs/evaluation.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.make_recipe import ROOT, recipe, tool_args

REPRO = ROOT / "results" / "repro"
CELL = "smollm2/niah/single_ctx1024_d0.5_s0.json"


def _make_repro_argv() -> list[str]:
    """``make repro``'s ``kvq-eval run`` arguments (printed by ``make -n``, not run), without --out."""
    (argv,) = tool_args(recipe("repro"), "kvq-eval", "run")
    i = argv.index("--out")
    assert argv[i + 1] == "results/repro"
    return argv[:i] + argv[i + 2:]


def test_the_repro_cell_is_committed_with_its_provenance():
    cell = json.loads((REPRO / CELL).read_text())
    assert set(cell["results"]) == {"fp32", "tq_mse3@none", "tq_mse3@1,0", "nova@none", "nova@1,0"}
    assert "--portable" in _make_repro_argv()
    for name, entry in cell["results"].items():
        prov = entry["provenance"]
        assert prov["protocol"] == 3 and prov["cpu"] and prov["versions"]["torch"], name
        assert prov["numerics"] == "portable", name  # make repro runs on the portable path
        assert ("artifacts" in prov) == name.startswith("nova"), name
        assert not str(prov["code"]).endswith("+dirty"), "make repro from a clean checkout"


@pytest.mark.model
def test_a_committed_nova_cell_reproduces_bit_for_bit(tmp_path):
    from kvq_eval.models import cache_dir
    from kvq_eval.provenance import environment

    stored = json.loads((REPRO / CELL).read_text())
    versions = stored["results"]["nova@none"]["provenance"]["versions"]
    if versions != environment()["versions"]:
        pytest.skip(f"the committed cell was made with other library versions ({versions}): the kernels, "
                    f"not only their dispatch, differ")
    # a cache that shares this machine's model copies but holds no calibration: the run calibrates
    # from scratch, as a fresh clone does
    cache = tmp_path / "cache"
    cache.mkdir()
    if cache_dir().is_dir():
        for item in cache_dir().iterdir():
            if item.name != "calibration":
                (cache / item.name).symlink_to(item)
    env = dict(os.environ, KVQ_CACHE_DIR=str(cache))
    run = subprocess.run([sys.executable, "-m", "kvq_eval.cli", "run", *_make_repro_argv(), "--out",
                          str(tmp_path / "out")], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    new = json.loads((tmp_path / "out" / CELL).read_text())
    for field in ("keys", "values", "offset", "prompt_tokens"):
        assert new[field] == stored[field], field
    for name, old in stored["results"].items():
        got = new["results"][name]
        assert got["provenance"]["numerics"] == "portable", name
        for field in ("exact", "logprob", "answer", "bits_per_element"):
            assert got[field] == old[field], (name, field, got["provenance"].get("cpu_model"),
                                              old["provenance"].get("cpu_model"))  # tolerance 0
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
