"""What a result cell was computed with: protocol, code, thread settings, library versions and the
digests of the calibration artifacts it read (issue 56: cells that reproduce).

Every entry the runner writes carries ``provenance(...)``; ``kvq-eval run --reuse`` and the
reproduction test compare these records before trusting a stored number.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

__all__ = ["PROTOCOL", "PORTABLE", "NUMERIC_KNOBS", "numerics", "portable_environ", "environment",
           "artifact_digest", "provenance", "finished"]

#: The evaluation protocol the runner implements (3: window-level statistics, short perplexity
#: windows on their own text, the long needle haystack beyond 4K tokens, provenance records).
PROTOCOL = 3


#: The portable numeric path (``kvq-eval run --portable``): environment settings that give the
#: float32 forward and the calibration the same instructions on every x86-64 processor with AVX2 and
#: FMA, so that a cell reproduces bit for bit across processor models and vendors, at about 1.5x the
#: time of the native path: MKL's conditional numerical reproducibility mode ``COMPATIBLE`` (the code
#: path MKL documents as giving the same results on Intel and compatible processors), ATen's
#: non-vectorized kernels, oneDNN held to SSE4.1, Numba compiling for a generic x86-64, and the
#: OpenBLAS that numpy ships held to its Haswell kernels (its kernel choice alone changed a NOVA-KV
#: calibration's digest). Made and checked on an AMD EPYC (two runs, two cache folders, 1 and 2
#: threads: the same bits); ``tests/kvq_eval/test_reproduce.py`` checks it on whatever processor CI
#: runs. Read when each library loads: only a fresh process takes them.
PORTABLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "NUMBA_CPU_NAME": "generic", "OPENBLAS_CORETYPE": "Haswell"}
#: Every environment variable that selects a numeric path (recorded in ``environment()``).
NUMERIC_KNOBS = tuple(PORTABLE) + ("MKL_ENABLE_INSTRUCTIONS", "NPY_DISABLE_CPU_FEATURES", "NUMBA_CPU_FEATURES")


def numerics(environ=None) -> str:
    """``"portable"`` where ``environ`` (default ``os.environ``) holds every ``PORTABLE`` setting,
    else ``"native"`` (each library picks the fastest kernels of this processor)."""
    environ = os.environ if environ is None else environ
    return "portable" if all(environ.get(k) == v for k, v in PORTABLE.items()) else "native"


def portable_environ(environ=None) -> dict:
    """A copy of ``environ`` (default ``os.environ``) with the ``PORTABLE`` settings, for a child
    process; a knob that would move the path elsewhere (``NUMERIC_KNOBS`` outside ``PORTABLE``) is
    dropped."""
    out = dict(os.environ if environ is None else environ)
    for k in NUMERIC_KNOBS:
        out.pop(k, None)
    out.update(PORTABLE)
    return out


def finished() -> str:
    """Now, in UTC to the second (``"2026-12-06T19:40:12Z"``): when a timed record (a perplexity
    window, a needle entry, a cell) was finished. Dry-run estimates price from the latest records
    (``grid.recent_median``): older ones were made by slower code or on a busier machine."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@lru_cache(maxsize=1)
def _code() -> str | None:
    """``<commit>`` of the checkout the package runs from, ``+dirty`` when it has changes to tracked
    files outside ``results/``; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        # results are not code: a run writing into results/ (or a checkout without them) is clean
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)results"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): two AVX-512
    machines of different vendors dispatch torch to different kernels, and the last bits differ."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Protocol, code commit, the CPU kernels torch dispatches to (``cpu``: e.g. ``AVX512``), the
    processor model (``cpu_model``), the numeric path (``numerics``: ``"native"`` or ``"portable"``,
    and ``numeric_env``, the ``NUMERIC_KNOBS`` that are set), thread counts (torch, Numba,
    ``OMP_NUM_THREADS``) and versions: what the float32 forward's last bits depend on (and quantized
    results amplify)."""
    import numba
    import numpy
    import torch
    import transformers

    return {"protocol": PROTOCOL, "code": _code(), "cpu": torch.backends.cpu.get_cpu_capability(),
            "cpu_model": _cpu_model(), "numerics": numerics(),
            "numeric_env": {k: os.environ[k] for k in NUMERIC_KNOBS if k in os.environ},
            "threads": {"torch": torch.get_num_threads(), "numba": numba.get_num_threads(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "versions": {"numpy": numpy.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__}}


def artifact_digest(folder) -> str:
    """The ``manifest_sha256`` of an artifact folder (``codebooks.artifacts``): a digest of every
    array it holds (their sha256 are in the manifest)."""
    path = Path(folder) / "manifest.json"
    try:
        digest = json.loads(path.read_text())["manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a readable artifact manifest") from None
    if not isinstance(digest, str):
        raise ValueError(f"{path}: manifest_sha256 must be a string")
    return digest


def provenance(env: dict, artifacts: dict | None = None) -> dict:
    """An entry's record: ``env`` (``environment()``, computed once per run) and, for calibrated
    methods, ``artifacts`` (name -> ``artifact_digest``)."""
    out = dict(env)
    if artifacts:
        out["artifacts"] = dict(sorted(artifacts.items()))
    return out
