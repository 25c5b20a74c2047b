"""Split planning for the flash-decoding kernels (Triton and CUDA): how many splits of the sequence.

No GPU library is imported here (the CUDA binding and the Triton kernels share it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["H200_SMS", "TARGET_WAVES", "MIN_CHUNK", "MAX_SPLITS", "SplitPlan", "plan_splits", "interpreting"]

H200_SMS = 132          # streaming multiprocessors of an H200 (SXM), planned for when no GPU is present
TARGET_WAVES = 3        # programs per SM the split heuristic aims for at low batch (2-4 waves)
MIN_CHUNK = 256         # fewest encoded tokens a split gets (its fixed cost: query rotation, workspace)
MAX_SPLITS = 256        # workspace bound (a CUDA graph keeps one plan)


def interpreting() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET`` set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _gpu_sms():
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available() and not interpreting():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return None


@dataclass(frozen=True)
class SplitPlan:
    """How the encoded tokens are cut: ``splits`` chunks of ``chunk`` tokens (multiples of block_n)."""

    splits: int
    chunk: int
    block_n: int
    programs: int
    waves: float


def plan_splits(batch: int, kv_heads: int, max_len: int, block_n: int, num_sms: int | None = None,
                splits: int | None = None) -> SplitPlan:
    """Split count for ``batch x kv_heads`` sequences of at most ``max_len`` encoded tokens.

    Heuristic: aim for ``TARGET_WAVES`` (3) programs per SM, ``S = round(3 SMs / (batch kv_heads))``
    (so the grid holds 2 to 4 waves),
    but give every split at least ``MIN_CHUNK`` (256) tokens, at most ``MAX_SPLITS`` splits, and cut
    no more splits than needed once the chunk is rounded up to whole tiles. At batch 1 x 8 heads
    on 132 SMs that is 50 splits (400 programs, 3.0 waves) from 12.8K tokens up; at batch 16, 4
    splits (3.9 waves); one split once ``batch kv_heads > 2 SMs`` (264 on an H200, e.g. batch 64 x 8
    heads: no over-splitting). Any batch gets at most 4 waves unless a single split is already more.
    ``num_sms`` defaults to the current GPU's count, or 132 (an H200) without one.

    Parameters
    ----------
    splits : int, optional
        Force a split count (>= 1); the chunk is then ``block_n ceil(max_len / (splits block_n))``, so
        splits past the last tile stay empty (tested: they merge as nothing).
    """
    for name, v in (("batch", batch), ("kv_heads", kv_heads), ("block_n", block_n)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
    if num_sms is None:
        num_sms = _gpu_sms() or H200_SMS
    base = batch * kv_heads
    tiles = max(1, -(-max_len // block_n))
    if splits is None:
        want = (2 * TARGET_WAVES * num_sms + base) // (2 * base)  # round(3 SMs / base), half up
        cap = max(1, max_len // MIN_CHUNK)
        s = max(1, min(want, cap, MAX_SPLITS))
        chunk = block_n * -(-tiles // s)
        s = max(1, -(-max_len // chunk))
    else:
        if not isinstance(splits, int) or splits < 1 or splits > 4096:
            raise ValueError(f"splits must be an int in 1..4096, got {splits!r}")
        s = splits
        chunk = block_n * -(-tiles // s)
    return SplitPlan(s, chunk, block_n, base * (s + 1), base * s / num_sms)
