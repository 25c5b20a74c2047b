"""Attention over a quantized KV cache (one KV head), and the metrics used to judge it.

Notes
-----
A ``QuantizedKV`` keeps the first ``sink`` and the last ``window`` tokens in float16 (the "16-bit
band" of OSCAR and NOVA-KV) and encodes the tokens in between with the key and value methods.
Scores against encoded keys go through the method's ``prepare_query``/``scores`` hooks, so a
rotation-based method rotates the query once and never un-rotates keys, and an estimator-based
method (QJL, TurboQuant_prod) contributes its unbiased estimate. Value sums go through
``accumulate`` (rotated-domain sums with one inverse rotation where the method has one).
Logits are scaled by ``1/sqrt(d)`` unless ``scale`` is given (a finite number > 0); softmax is
computed in float64. Tokens stored in float16 (the band, and the middle of a tensor without a
method) must fit its range: a value past 65504 is refused, never stored as Inf (which turned the
attention into NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .common import Encoded, Quantizer, as_array

F16_MAX = float(np.finfo(np.float16).max)

__all__ = ["QuantizedKV", "attention_decode", "attention_prefill", "exact_attention", "relative_error",
           "logit_mse", "topk_agreement"]


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """One KV head's cache.

    Attributes
    ----------
    n, d : int
        Tokens and head dimension.
    sink, window : int
        Tokens kept in float16 at the start and the end (clipped to n).
    band_keys, band_values : ndarray, shape (n_band, d), float16
        The band tokens: the first ``sink``, then the last ``window``.
    key_method, value_method : Quantizer or None
        None keeps that tensor's middle tokens in float16 too.
    keys, values : Encoded, or float16 ndarray (method None), or None (no middle tokens)
        The middle tokens ``[sink, n - window)``.
    """

    n: int
    d: int
    sink: int
    window: int
    band_keys: np.ndarray
    band_values: np.ndarray
    key_method: Quantizer | None
    value_method: Quantizer | None
    keys: Encoded | np.ndarray | None
    values: Encoded | np.ndarray | None

    def __post_init__(self):
        for name in ("band_keys", "band_values", "keys", "values"):
            arr = getattr(self, name)
            if isinstance(arr, np.ndarray) and not np.all(np.isfinite(arr)):
                raise ValueError(f"{name} holds NaN/Inf (a float16 overflow?): the attention would be NaN")

    @classmethod
    def build(cls, K, V, key_method: Quantizer | None, value_method: Quantizer | None,
              sink: int = 0, window: int = 0) -> "QuantizedKV":
        """Encode a head's keys and values.

        Parameters
        ----------
        K, V : array_like, shape (n, d)
        key_method, value_method : Quantizer or None
        sink, window : int
            Band sizes (>= 0).
        """
        K = as_array("K", K, min_ndim=2)
        V = as_array("V", V, dim=K.shape[-1], min_ndim=2)
        if K.ndim != 2 or V.shape != K.shape:
            raise ValueError(f"K and V must both be (n, d), got {K.shape} and {V.shape}")
        for nm, v in (("sink", sink), ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{nm} must be a non-negative integer, got {v!r}")
        n, d = K.shape
        lo = min(sink, n)
        hi = max(lo, n - window)
        band = np.concatenate([np.arange(lo), np.arange(hi, n)])

        def f16(name, x, what):
            with np.errstate(over="ignore"):
                x16 = x.astype(np.float16)
            big = np.isinf(x16)
            if big.any():
                t = int(np.argwhere(big)[0][0])
                raise ValueError(f"{name}: {what} are kept in float16, but {int(big.sum())} value(s) exceed its range "
                                 f"(max {F16_MAX:g}; first in row {t}): scale the input or encode those tokens")
            return x16

        def middle(name, x, method):
            if hi == lo:
                return None
            if method is not None:
                return method.encode(x[lo:hi])
            return f16(name, x[lo:hi], "the middle tokens (no method)")

        what = f"the band tokens (first {lo}, last {n - hi})"
        return cls(n, d, lo, n - hi, f16("K", K[band], what), f16("V", V[band], what),
                   key_method, value_method, middle("K", K, key_method), middle("V", V, value_method))

    @property
    def middle(self) -> slice:
        """Positions of the middle (encoded) tokens."""
        return slice(self.sink, self.n - self.window)

    @property
    def band_positions(self) -> np.ndarray:
        return np.concatenate([np.arange(self.sink), np.arange(self.n - self.window, self.n)])

    def bits_per_element(self) -> dict[str, float]:
        """Stored bits per element of keys, values and both (band tokens count 16 bits)."""
        out = {}
        for name, band, mid in (("keys", self.band_keys, self.keys), ("values", self.band_values, self.values)):
            out[name] = 8.0 * (band.nbytes + (mid.nbytes if mid is not None else 0)) / (self.n * self.d)
        out["total"] = (out["keys"] + out["values"]) / 2
        return out

    @staticmethod
    def _decode(method, mid):
        return mid.astype(np.float64) if method is None else method.decode(mid).astype(np.float64)

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """(K_hat, V_hat), float64, shape (n, d): what the cache reconstructs, in token order."""
        out = []
        for band, method, mid in ((self.band_keys, self.key_method, self.keys),
                                  (self.band_values, self.value_method, self.values)):
            x = np.empty((self.n, self.d))
            x[self.band_positions] = band
            if mid is not None:
                x[self.middle] = self._decode(method, mid)
            out.append(x)
        return out[0], out[1]

    def logits(self, q: np.ndarray) -> np.ndarray:
        """``q . k_t`` for queries (m, d) against every token: (m, n), through the key method's scores."""
        out = np.empty((q.shape[0], self.n))
        out[:, self.band_positions] = q @ self.band_keys.astype(np.float64).T
        if self.keys is not None:
            if self.key_method is None:
                out[:, self.middle] = q @ self.keys.astype(np.float64).T
            else:
                out[:, self.middle] = self.key_method.scores(self.key_method.prepare_query(q), self.keys)
        return out

    def weighted_values(self, p: np.ndarray) -> np.ndarray:
        """``sum_t p[:, t] v_t`` for weights (m, n): (m, d), through the value method's accumulate."""
        out = p[:, self.band_positions] @ self.band_values.astype(np.float64)
        if self.values is not None:
            if self.value_method is None:
                out = out + p[:, self.middle] @ self.values.astype(np.float64)
            else:
                out = out + self.value_method.accumulate(p[:, self.middle], self.values)
        return out


def _scale(scale, d: int) -> float:
    """The logit scale: ``1/sqrt(d)`` for None, else a finite real number > 0 (not a bool)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool | np.bool_) or not isinstance(scale, int | float | np.integer | np.floating) \
            or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (or None for 1/sqrt(d)), got {scale!r}")
    return float(scale)


def _softmax_rows(z: np.ndarray) -> np.ndarray:
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=-1, keepdims=True)


def attention_decode(q, cache: QuantizedKV, scale: float | None = None) -> np.ndarray:
    """One decode step: queries ``q`` (h, d) (a GQA group) attend to all n cached tokens.

    Returns
    -------
    ndarray, float64, shape (h, d)
    """
    q = as_array("q", q, dim=cache.d)
    q2 = q.reshape(-1, cache.d)
    s = _scale(scale, cache.d)
    p = _softmax_rows(cache.logits(q2) * s)
    return cache.weighted_values(p).reshape(q.shape)


def attention_prefill(Q, cache: QuantizedKV, scale: float | None = None, causal: bool = True) -> np.ndarray:
    """Queries at the last ``n_q`` positions attend causally over the cache.

    Parameters
    ----------
    Q : array_like, shape (h, n_q, d) or (n_q, d)
        Query ``i`` sits at position ``n - n_q + i`` and sees tokens ``<=`` its position.

    Returns
    -------
    ndarray, float64, same shape as Q
    """
    Q = as_array("Q", Q, dim=cache.d, min_ndim=2)
    nq = Q.shape[-2]
    if nq > cache.n:
        raise ValueError(f"Q has {nq} positions but the cache holds {cache.n} tokens")
    flat = Q.reshape(-1, cache.d)
    s = _scale(scale, cache.d)
    z = cache.logits(flat) * s
    if causal:
        pos = np.tile(np.arange(cache.n - nq, cache.n), flat.shape[0] // nq)
        z = np.where(np.arange(cache.n)[None, :] <= pos[:, None], z, -np.inf)
    return cache.weighted_values(_softmax_rows(z)).reshape(Q.shape)


def exact_attention(Q, K, V, scale: float | None = None, causal: bool = True) -> np.ndarray:
    """Full-precision reference with the conventions of ``attention_prefill`` (float64 K, V).

    Q : (h, n_q, d) or (n_q, d); K, V : (n, d).
    """
    K = as_array("K", K, min_ndim=2)
    V = as_array("V", V, dim=K.shape[-1], min_ndim=2)
    Q = as_array("Q", Q, dim=K.shape[-1], min_ndim=2)
    n, d = K.shape
    nq = Q.shape[-2]
    s = _scale(scale, d)
    z = (Q @ K.T) * s
    if causal:
        z = np.where(np.arange(n)[None, :] <= np.arange(n - nq, n)[:, None], z, -np.inf)
    return _softmax_rows(z) @ V


def relative_error(out, ref) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius; 0 when both are 0)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)


def logit_mse(q, K, cache: QuantizedKV) -> float:
    """Mean over queries and tokens of ``(q.k - score)^2`` against the exact keys ``K``."""
    q = as_array("q", q, dim=cache.d).reshape(-1, cache.d)
    K = as_array("K", K, dim=cache.d)
    return float(np.mean((q @ K.T - cache.logits(q)) ** 2))


def topk_agreement(ref_scores, scores, k: int) -> float:
    """Mean fraction of each row's top-k tokens (by ``ref_scores``) also in the top-k of ``scores``."""
    a = np.atleast_2d(np.asarray(ref_scores, dtype=np.float64))
    b = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    if a.shape != b.shape:
        raise ValueError(f"score shapes differ: {a.shape} vs {b.shape}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= a.shape[-1]:
        raise ValueError(f"k must be an integer in 1..{a.shape[-1]}, got {k!r}")
    ta = np.argsort(-a, axis=-1, kind="stable")[:, :k]
    tb = np.argsort(-b, axis=-1, kind="stable")[:, :k]
    return float(np.mean([np.intersect1d(x, y).size / k for x, y in zip(ta, tb)]))
