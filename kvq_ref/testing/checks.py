"""Assertions that an implementation meets kvq_ref: exact bytes, or float32 bounds (``tolerances``)."""

from __future__ import annotations

import math

import numpy as np

from ..attention import attention_decode
from ..common import Encoded, Quantizer
from .tolerances import decode_tolerance, mse_attention_tolerance, nova_score_tolerance, row_errors

__all__ = ["check_encode", "check_decode", "check_attention", "check_nova_scores"]


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def check_encode(encode, q: Quantizer, x) -> Encoded:
    """Assert ``encode(x)`` stores exactly kvq_ref's arrays: same names, dtypes, shapes and bytes.

    encode : callable x -> dict of arrays (numpy or torch) or an Encoded. Returns kvq_ref's Encoded.
    """
    ref = q.encode(_np(x))
    got = encode(x)
    got = got.arrays if isinstance(got, Encoded) else got
    missing = set(ref.arrays) - set(got)
    assert not missing, f"implementation does not store {sorted(missing)}"
    for name, want in ref.arrays.items():
        arr = np.ascontiguousarray(_np(got[name]))
        assert arr.dtype == want.dtype and arr.shape == want.shape, \
            f"{name}: {arr.dtype}{arr.shape}, kvq_ref stores {want.dtype}{want.shape}"
        bad = np.flatnonzero(arr.view(np.uint8) != np.ascontiguousarray(want).view(np.uint8))
        assert bad.size == 0, f"{name}: {bad.size} byte(s) differ from kvq_ref, first at byte {bad[0]}"
    return ref


def check_decode(decode, q: Quantizer, x, block: int | None = None) -> np.ndarray:
    """Assert ``decode(enc)`` of kvq_ref's encoding of ``x`` is within ``decode_tolerance`` per row.

    block : Hadamard block of the method (default ``q.rot.block`` when it has one, else 1).
    Returns the errors in units of the bound (all <= 1).
    """
    enc = q.encode(_np(x))
    ref = q.decode(enc)
    out = _np(decode(enc))
    assert out.shape == ref.shape, f"decode shape {out.shape}, kvq_ref {ref.shape}"
    assert np.all(np.isfinite(out)), "decode produced NaN/Inf"
    b = block if block is not None else getattr(getattr(q, "rot", None), "block", 1)
    err, _ = row_errors(out, ref)
    tol = decode_tolerance(ref, b)
    assert np.all(err <= tol), f"decode error up to {np.max(err / np.maximum(tol, 1e-300)):.3g} x the float32 bound"
    return err / np.maximum(tol, 1e-300)


def check_attention(attention, q, cache, scale: float | None = None) -> np.ndarray:
    """Assert ``attention(q, cache)`` (decode, queries (m, d)) meets ``attention_decode`` per query within
    ``mse_attention_tolerance`` (TurboQuantMSE key and value methods). Returns errors / bound."""
    q = np.asarray(q, dtype=np.float32).astype(np.float64)
    ref = attention_decode(q, cache, scale=scale)
    out = _np(attention(q, cache)).astype(np.float64)
    assert out.shape == ref.shape, f"attention shape {out.shape}, kvq_ref {ref.shape}"
    s = 1.0 / math.sqrt(cache.d) if scale is None else scale
    tol = mse_attention_tolerance(q, cache, cache.key_method, cache.value_method, s)
    err = np.abs(out - ref).max(axis=1)
    assert np.all(err <= tol), f"errors {err} exceed the float32 bounds {tol}"
    return err / tol


def check_nova_scores(scores, nk, q, keys) -> np.ndarray:
    """Assert ``scores(q, enc)`` of a NOVA-KV key encoding meets ``inner_product`` within
    ``nova_score_tolerance``; q (m, d). Returns errors / bound."""
    enc = nk.encode(keys)
    q = np.asarray(q, dtype=np.float32).astype(np.float64)
    ref = nk.inner_product(q, enc)
    out = _np(scores(q, enc)).astype(np.float64)
    assert out.shape == ref.shape, f"scores shape {out.shape}, kvq_ref {ref.shape}"
    tol = nova_score_tolerance(q, nk.head, enc, ref)
    assert np.all(np.abs(out - ref) <= tol), f"max error / bound {np.max(np.abs(out - ref) / tol):.3g}"
    return np.abs(out - ref) / tol
