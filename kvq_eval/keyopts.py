"""Key options of the key-error study: mean-centred keys and key/value bit splits.

Mean-centred keys
-----------------
Post-RoPE keys carry a large token-constant channel mean ``mu`` (per layer and KV head). Since
``softmax_t(q . k_t) = softmax_t(q . (k_t - mu))`` for any ``mu`` shared by the row's keys, a
kernel may quantize ``k - mu`` and score ``q . (k_hat - mu)``, i.e. ``q . c_hat`` with ``c_hat``
the quantized centred key, without ever adding ``q . mu`` back, provided every key of the row
(band tokens included) is scored centred. ``CenteredKeys`` wraps TurboQuantMSE, TurboQuantSplit
or QuaRot so: ``encode(k) = inner.encode(k - mu)``, ``decode = inner.decode + mu`` and ``scores``
returns ``q . mu + inner.scores`` so that it mixes with exactly scored band keys in the evaluation
(``tests/kvq_eval/test_protocol.py`` proves both forms give the same attention). ``mu`` is the
calibration mean of the (layer, head) keys (``CalibrationStats``), so these methods are calibrated
and their mean (``d`` float32) is counted in their stored bits (``kvq_eval.accounting``). Centring
lowers the keys' average energy but moves a key far from ``mu`` further out: where such a key
takes the attention (SmolLM2's first token, the attention sink), it raises the error that counts
(``kvq_eval.sink``; ``kvq-eval sink``).

Registered names (``study_methods``): ``<base>-mc`` for base in tq_mse2/3/4, tq_split2.5/3.5,
quarot2/4; ``tq_k4v2``, ``tq_k5v3``, ``tq_k8v4`` (TurboQuantMSE with more bits on keys than values)
and their ``-mc`` forms (both options at once).

Where a rotation hurts
----------------------
``key_structure`` measures, on exact keys and queries, the two numbers that say how much of a
rotation quantizer's key error reaches the attention: the share of key energy in the
token-constant mean, and the logit spread relative to an isotropic error (``logit_snr``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvq_ref.common import Encoded, Quantizer, as_array
from kvq_ref.turboquant import TurboQuantMSE

__all__ = ["CenteredKeys", "centered", "kv_split", "study_methods", "key_structure", "CENTERED_BASES",
           "KV_SPLITS"]

CENTERED_BASES = ("tq_mse2", "tq_mse3", "tq_mse4", "tq_split2.5", "tq_split3.5", "quarot2", "quarot4")
KV_SPLITS = {"tq_k4v2": (4, 2), "tq_k5v3": (5, 3), "tq_k8v4": (8, 4)}


@dataclass(frozen=True)
class CenteredKeys(Quantizer):
    """``inner`` applied to ``k - mu`` (module docstring).

    Parameters
    ----------
    inner : Quantizer
        A non-estimator method of dimension ``d`` (scores are ``<q, decode>``).
    mu : tuple of float, length d
        The channel mean subtracted before ``inner`` (its rotation included).
    """

    inner: Quantizer
    mu: tuple
    name: ClassVar[str] = "centered"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.inner, Quantizer) or self.inner.estimator:
            raise TypeError("inner must be a non-estimator kvq_ref Quantizer")
        mu = np.asarray(self.mu, dtype=np.float64)
        if mu.shape != (self.inner.dim,) or not np.all(np.isfinite(mu)):
            raise ValueError(f"mu must be {self.inner.dim} finite numbers, got shape {mu.shape}")
        object.__setattr__(self, "mu", tuple(float(m) for m in mu))

    @property
    def dim(self) -> int:
        return self.inner.dim

    @property
    def _mu(self) -> np.ndarray:
        return np.asarray(self.mu)

    @property
    def config(self):
        return {"inner": self.inner.name, **self.inner.config, "mu": self.mu}

    def layout(self, shape):
        return self.inner.layout(shape)

    def _inner(self, enc: Encoded) -> Encoded:
        self._check(enc)
        return Encoded(self.inner.name, self.inner.config, enc.shape, enc.arrays)

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        return self._make(x.shape, dict(self.inner.encode(x - self._mu).arrays))

    def decode(self, enc: Encoded) -> np.ndarray:
        return (self.inner.decode(self._inner(enc)) + self._mu).astype(np.float32)

    def prepare_query(self, q):
        q = np.asarray(q, dtype=np.float64)
        return self.inner.prepare_query(q), q @ self._mu

    def centred_scores(self, q_prepared, enc) -> np.ndarray:
        """``q . c_hat``: what a kernel computes when every key of the row is centred."""
        return self.inner.scores(q_prepared[0], self._inner(enc))

    def scores(self, q_prepared, enc):
        return self.centred_scores(q_prepared, enc) + q_prepared[1][:, None]


def centered(make):
    """The factory of ``make`` with mean-centred keys (values unchanged)."""
    def make_centered(layer, head, role, d, tables):
        inner = make(layer, head, role, d, tables)
        if role != "key":
            return inner
        return CenteredKeys(inner, tuple(tables.stats.head(layer, head).keys.mean))
    return make_centered


def kv_split(key_bits: int, value_bits: int, seed):
    """TurboQuantMSE with ``key_bits`` on keys and ``value_bits`` on values (``seed(l, h, role)``)."""
    def make(layer, head, role, d, tables):
        return TurboQuantMSE(d, key_bits if role == "key" else value_bits, seed=seed(layer, head, role))
    return make


def study_methods(methods: dict, seed) -> dict:
    """Registry entries of the study's methods, built from the base entries in ``methods``."""
    out = {}
    for base in CENTERED_BASES:
        if base in methods:
            entry = dict(methods[base])
            entry.update(make=centered(entry["make"]), calibrated=True)
            out[f"{base}-mc"] = entry
    for name, (kb, vb) in KV_SPLITS.items():
        out[name] = dict(make=kv_split(kb, vb, seed), nominal_bits=(kb + vb) / 2)
        out[f"{name}-mc"] = dict(make=centered(out[name]["make"]), nominal_bits=(kb + vb) / 2, calibrated=True)
    return out


def key_structure(q, k) -> tuple[float, float]:
    """Key mean share and logit SNR of one head's exact queries and keys.

    Parameters
    ----------
    q : array_like, shape (m, d)
        Queries (m >= 1), finite.
    k : array_like, shape (T, d)
        The keys they attend to (T >= 2), finite.

    Returns
    -------
    mean_share : float
        ``||mu||^2 / mean_t ||k_t||^2`` with ``mu`` the keys' mean, in [0, 1].
    logit_snr : float
        ``mean_i Var_t(q_i . k_t) / (mean_i ||q_i||^2 * mean_t ||k_t||^2 / d)``, >= 0. Both are 0
        when every key (or, for ``logit_snr``, every query) is zero.

    Notes
    -----
    A rotation quantizer with relative MSE ``D`` (``E||k_hat - k||^2 = D ||k||^2``, the error
    isotropic after the random rotation) adds logit noise of variance ``D ||q||^2 ||k||^2 / d``,
    while a query's useful signal is its logits' spread over the keys (``q . mu`` cancels in
    softmax). ``logit_snr / D`` is that signal-to-noise ratio: 1 for zero-mean isotropic keys, and
    small where the keys' energy sits in their mean (``mean_share``; mean-centred keys divide the
    average noise by ``1 - mean_share``, but raise it on keys far from the mean, such as SmolLM2's
    attention sink: ``kvq_eval.sink``) or where queries point along directions in which keys barely
    vary. Per-channel quantizers such as KIVI scale their error with each channel's own range
    instead, so neither number limits them the same way. Variances are population (``ddof=0``).
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] < 1:
        raise ValueError(f"q must have shape (m, d) with m >= 1, got {q.shape}")
    if k.ndim != 2 or k.shape[0] < 2 or k.shape[1] != q.shape[1]:
        raise ValueError(f"k must have shape (T, {q.shape[1]}) with T >= 2, got {k.shape}")
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(k))):
        raise ValueError("q and k must be finite")
    d = k.shape[1]
    energy = float(np.mean(np.sum(k * k, axis=1)))
    qn = float(np.mean(np.sum(q * q, axis=1)))
    if energy == 0.0:
        return 0.0, 0.0
    mu = k.mean(axis=0)
    share = min(1.0, float(mu @ mu) / energy)
    if qn == 0.0:
        return share, 0.0
    spread = float(np.mean(np.var(q @ k.T, axis=1)))
    return share, spread / (qn * energy / d)
