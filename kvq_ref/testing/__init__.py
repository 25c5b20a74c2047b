"""Conformance kit: check any encode, decode or attention implementation against kvq_ref.

``kvq_ref.testing`` gives another implementation (a GPU kernel, a C or Rust port, a serving engine's
cache) what this project's own kernel tests use:

* tolerances derived from float32 rounding (``tolerances``): exact bytes for encoders, a per-row
  bound for float32 decoders, per-query bounds for float32 decode attention and NOVA-KV scores;
* checks (``checks``) that run a function and assert it meets kvq_ref within those bounds;
* hypothesis strategies (``strategies``, needs ``hypothesis``) for realistic K/V: channel offsets,
  outlier channels, heavy-tailed tokens, zero rows and values exactly on quantizer thresholds;
* ``tie_rows`` (``ties``): rows whose rotated coordinates sit exactly on a rotated quantizer's
  thresholds, in the arithmetic the quantizer compares them (a wrong tie rule fails on them).

For implementations that cannot run Python, ``kvq-codebooks golden --method M --out DIR`` writes
golden files (``kvq_ref.golden``).

Examples
--------
>>> from kvq_ref import TurboQuantMSE
>>> from kvq_ref.testing import check_encode, check_decode
>>> q = TurboQuantMSE(128, 3)
>>> check_encode(lambda x: my_kernel_encode(x), q, x)          # doctest: +SKIP
>>> check_decode(lambda enc: my_kernel_decode(enc), q, x)      # doctest: +SKIP
"""

from .checks import check_attention, check_decode, check_encode, check_nova_scores
from .ties import tie_rows
from .tolerances import (ATTENTION_RTOL, LAM, U32, decode_tolerance, mse_attention_tolerance, nova_score_tolerance,
                         row_errors)

__all__ = ["U32", "LAM", "ATTENTION_RTOL", "decode_tolerance", "mse_attention_tolerance", "nova_score_tolerance",
           "row_errors", "check_encode", "check_decode", "check_attention", "check_nova_scores",
           "kv_arrays", "kv_pairs", "threshold_ties", "tie_rows"]

_STRATEGIES = ("kv_arrays", "kv_pairs", "threshold_ties")


def __getattr__(name):
    if name in _STRATEGIES:  # hypothesis is a test dependency: imported when a strategy is asked for
        try:
            from . import strategies
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"kvq_ref.testing.{name} needs hypothesis (pip install 'kvq-toolkit[test]')") from exc
        return getattr(strategies, name)
    raise AttributeError(f"module 'kvq_ref.testing' has no attribute {name!r}")
