"""Calibration statistics for attention-aware transforms (NOVA-KV, OSCAR), mergeable across shards.

Per (layer, KV head) this accumulates, in float64:

* the pooled-GQA query second moment ``Sigma_q = E[q q^T]`` (uncentered, over every query head of
  the group and every position),
* the key mean and covariance (``mu_k``, ``C_k``),
* the value mean and covariance under two token weights: ``omega_t = E[s_t^2]`` (NOVA-KV's value
  objective ``sum_t omega_t ||eps_t||^2``) and OSCAR's proxy ``E[s_t]``, where ``s_t`` is the
  softmax attention probability a query gives token t and the expectation runs over the query
  heads of the group and the positions that can see t (causal).

Notes
-----
Means and covariances use Chan's pairwise update: a chunk contributes ``(W, mean, M2)`` and two
summaries merge as ``W = W_a + W_b``, ``mean = mean_a + delta W_b / W``, ``M2 = M2_a + M2_b +
delta delta^T W_a W_b / W`` (``delta = mean_b - mean_a``). This avoids the cancellation of
``E[x x^T] - mu mu^T`` when keys carry large channel offsets, and ``merge`` of shards equals one
pass over all data to rounding (how calibration scales out with any engine's all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .artifacts import MANIFEST, TENSORS, check_keys, fail, field_float, field_int, load_artifacts, save_artifacts

__all__ = ["Moments", "HeadStats", "CalibrationStats", "attention_weights"]

KIND = "calibration"


@dataclass
class Moments:
    """Weighted mean and scatter ``(W, mean, M2)`` of d-dimensional samples (Chan's form)."""

    d: int
    weight: float = 0.0
    mean: np.ndarray = None
    m2: np.ndarray = None

    def __post_init__(self):
        if self.mean is None:
            self.mean = np.zeros(self.d)
        if self.m2 is None:
            self.m2 = np.zeros((self.d, self.d))

    def add(self, x: np.ndarray, w: np.ndarray | None = None) -> None:
        """Add samples ``x`` (N, d) with weights ``w`` (N,) (default 1)."""
        w = np.ones(x.shape[0]) if w is None else w
        wt = float(w.sum())
        if wt <= 0:
            return
        mean = (w @ x) / wt
        xc = x - mean
        self.merge_in(Moments(self.d, wt, mean, (xc * w[:, None]).T @ xc))

    def merge_in(self, other: "Moments") -> None:
        """Combine another summary into this one (pairwise update)."""
        if other.weight <= 0:
            return
        if self.weight <= 0:
            self.weight, self.mean, self.m2 = other.weight, other.mean.copy(), other.m2.copy()
            return
        total = self.weight + other.weight
        delta = other.mean - self.mean
        self.mean = self.mean + delta * (other.weight / total)
        self.m2 = self.m2 + other.m2 + np.outer(delta, delta) * (self.weight * other.weight / total)
        self.weight = total

    @property
    def cov(self) -> np.ndarray:
        """``M2 / W`` (the weighted population covariance)."""
        return self.m2 / self.weight


@dataclass
class HeadStats:
    """Statistics of one (layer, KV head).

    Attributes
    ----------
    d : int
    n_queries : int
        Query vectors pooled (positions x query heads of the group).
    qq : ndarray, shape (d, d)
        ``sum q q^T`` over them.
    keys, values_s2, values_s1 : Moments
        Keys (unit weights) and values weighted by ``E[s_t^2]`` and by ``E[s_t]``.
    """

    d: int
    n_queries: int = 0
    qq: np.ndarray = None
    keys: Moments = None
    values_s2: Moments = None
    values_s1: Moments = None

    def __post_init__(self):
        if self.qq is None:
            self.qq = np.zeros((self.d, self.d))
        for name in ("keys", "values_s2", "values_s1"):
            if getattr(self, name) is None:
                setattr(self, name, Moments(self.d))

    @property
    def sigma_q(self) -> np.ndarray:
        """``E[q q^T]`` of the pooled queries."""
        if self.n_queries == 0:
            raise ValueError("no queries were accumulated for this head")
        return self.qq / self.n_queries

    def merge_in(self, other: "HeadStats") -> None:
        if other.d != self.d:
            raise ValueError(f"cannot merge statistics of dimension {other.d} into {self.d}")
        self.n_queries += other.n_queries
        self.qq = self.qq + other.qq
        self.keys.merge_in(other.keys)
        self.values_s2.merge_in(other.values_s2)
        self.values_s1.merge_in(other.values_s1)

    def check(self, min_tokens: int | None = None, why: str | None = None) -> None:
        """Refuse NaN statistics and too few key tokens (default d + 1, for the transforms)."""
        arrays = (self.qq, self.keys.mean, self.keys.m2, self.values_s2.mean, self.values_s2.m2,
                  self.values_s1.mean, self.values_s1.m2)
        if not all(np.all(np.isfinite(a)) for a in arrays):
            raise ValueError("calibration statistics contain NaN/Inf (non-finite Q/K/V in the calibration data)")
        need = self.d + 1 if min_tokens is None else min_tokens
        why = why or f"the transforms of dimension {self.d}"
        if self.keys.weight < need:
            raise ValueError(f"calibration saw {int(self.keys.weight)} key tokens for this head; {why} need at "
                             f"least {need}")


def attention_weights(q: np.ndarray, k: np.ndarray, scale: float, causal: bool = True,
                      chunk: int = 512) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-token sums of ``s`` and ``s^2`` over queries, and the count of queries seeing each token.

    Parameters
    ----------
    q : ndarray, shape (g, T, d)
        The query heads of one GQA group.
    k : ndarray, shape (T, d)
    scale : float
        Logit scale (1/sqrt(d) unless the model says otherwise).

    Returns
    -------
    sum_s, sum_s2 : ndarray, shape (T,)
    count : ndarray, shape (T,)
        Number of (head, position) queries whose softmax includes token t.
    """
    g, T, _ = q.shape
    sum_s = np.zeros(T)
    sum_s2 = np.zeros(T)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        # a causal chunk of queries sees keys [0, stop) only: the later columns would be exp(-inf) = 0
        width = stop if causal else T
        z = np.matmul(q[:, start:stop], k[:width].T) * scale  # (g, chunk, width), BLAS
        if causal:
            z = np.where(np.arange(width)[None, None, :] <= np.arange(start, stop)[None, :, None], z, -np.inf)
        z -= z.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        sum_s[:width] += p.sum(axis=(0, 1))
        sum_s2[:width] += (p * p).sum(axis=(0, 1))
    count = g * (T - np.arange(T)) if causal else np.full(T, g * T)
    return sum_s, sum_s2, count


@dataclass
class CalibrationStats:
    """Statistics of every (layer, KV head) seen so far.

    Parameters
    ----------
    d : int
        Head dimension.
    """

    d: int
    heads: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.d, bool) or not isinstance(self.d, int) or self.d < 2:
            raise ValueError(f"d must be an integer >= 2, got {self.d!r}")

    def head(self, layer: int, head: int) -> HeadStats:
        """The statistics of one KV head (KeyError naming what exists otherwise)."""
        try:
            return self.heads[(layer, head)]
        except KeyError:
            raise KeyError(f"no statistics for layer {layer}, KV head {head}; have {sorted(self.heads)}") from None

    def update(self, layer: int, q, k, v, scale: float | None = None, causal: bool = True) -> None:
        """Add one sequence of one layer.

        Parameters
        ----------
        layer : int
        q : array_like, shape (Hq, T, d)
            Post-RoPE queries of every query head.
        k, v : array_like, shape (Hkv, T, d)
            Post-RoPE keys and values of every KV head; Hq must be a multiple of Hkv (GQA groups
            of consecutive query heads).
        scale : float, optional
            Logit scale, default ``1/sqrt(d)``.
        causal : bool
        """
        q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
        if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
            raise ValueError(f"q must be (Hq, T, d) and k, v (Hkv, T, d); got {q.shape}, {k.shape}, {v.shape}")
        if q.shape[1:] != k.shape[1:] or q.shape[2] != self.d:
            raise ValueError(f"q {q.shape} and k {k.shape} must share T and d={self.d}")
        hq, hkv = q.shape[0], k.shape[0]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
        for name, a in (("q", q), ("k", k), ("v", v)):
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{name} contains NaN or Inf")
        scale = 1.0 / math.sqrt(self.d) if scale is None else float(scale)
        g = hq // hkv
        for h in range(hkv):
            qg = q[h * g:(h + 1) * g]
            st = HeadStats(self.d)
            flat = qg.reshape(-1, self.d)
            st.n_queries = flat.shape[0]
            st.qq = flat.T @ flat
            st.keys.add(k[h])
            sum_s, sum_s2, count = attention_weights(qg, k[h], scale, causal)
            st.values_s2.add(v[h], sum_s2 / count)
            st.values_s1.add(v[h], sum_s / count)
            self.heads.setdefault((layer, h), HeadStats(self.d)).merge_in(st)

    def merge(self, other: "CalibrationStats") -> "CalibrationStats":
        """A new object holding both (shards of one calibration run combine exactly)."""
        if other.d != self.d:
            raise ValueError(f"cannot merge statistics of dimension {other.d} with {self.d}")
        out = CalibrationStats(self.d)
        for src in (self, other):
            for key, st in src.heads.items():
                out.heads.setdefault(key, HeadStats(self.d)).merge_in(st)
        return out

    # --- storage ---------------------------------------------------------------------------------
    _FIELDS = ("qq", "keys.mean", "keys.m2", "values_s2.mean", "values_s2.m2", "values_s1.mean",
               "values_s1.m2")

    def save(self, folder):
        """Write an artifact folder of kind ``"calibration"``."""
        entries, arrays = [], {}
        for (layer, h), st in sorted(self.heads.items()):
            name = f"layer{layer}.head{h}"
            own = []
            for f in self._FIELDS:
                obj, _, attr = f.partition(".")
                arrays[f"{name}.{f}"] = getattr(getattr(st, obj), attr) if attr else getattr(st, obj)
                own.append(f"{name}.{f}")
            entries.append({"name": name, "layer": layer, "head": h, "d": self.d, "n_queries": st.n_queries,
                            "weights": {"keys": st.keys.weight, "values_s2": st.values_s2.weight,
                                        "values_s1": st.values_s1.weight}, "arrays": own})
        return save_artifacts(folder, KIND, entries, arrays)

    @classmethod
    def load(cls, folder) -> "CalibrationStats":
        """Read what ``save`` wrote (``TableFileError`` naming the file and field on any problem).

        Checks every entry field (types, ranges, one ``d`` for all heads, names ``layer<L>.head<H>``),
        every array's shape, and that ``qq`` and the scatter matrices are symmetric with a
        non-negative diagonal (the artifact layer has already refused NaN/Inf and edited bytes).
        """
        art = load_artifacts(folder, KIND)
        mpath, tpath = art.folder / MANIFEST, art.folder / TENSORS
        if not art.entries:
            fail(mpath, "holds no heads")
        d = field_int(mpath, art.entries[0], "d", 2, 2**16)
        out = cls(d)
        for e in art.entries:
            check_keys(mpath, e, ("layer", "head", "d", "n_queries", "weights"))
            layer, h = field_int(mpath, e, "layer", 0, 2**20), field_int(mpath, e, "head", 0, 2**20)
            if e["name"] != f"layer{layer}.head{h}":
                fail(mpath, f"entry {e['name']!r}: name must be 'layer{layer}.head{h}' (its layer and head fields)")
            if field_int(mpath, e, "d", 2, 2**16) != d:
                fail(mpath, f"entry {e['name']!r}: field 'd' is {e['d']}, the first head has {d}")
            w = e["weights"]
            if not isinstance(w, dict) or set(w) != {"keys", "values_s2", "values_s1"}:
                fail(mpath, f"entry {e['name']!r}: field 'weights' must hold keys, values_s2, values_s1")
            weights = {k: field_float(mpath, {"name": e["name"], f"weights.{k}": w[k]}, f"weights.{k}", 0.0) for k in w}
            if set(e["arrays"]) != {f"{e['name']}.{f}" for f in cls._FIELDS}:
                fail(mpath, f"entry {e['name']!r}: arrays are not {list(cls._FIELDS)}")
            a = {}
            for f in cls._FIELDS:
                arr = art.arrays[f"{e['name']}.{f}"]
                shape = (d,) if f.endswith("mean") else (d, d)
                if arr.shape != shape or arr.dtype != np.float64:
                    fail(tpath, f"array {e['name']}.{f} is {arr.dtype} {arr.shape}, expected float64 {shape}")
                if len(shape) == 2 and (not np.allclose(arr, arr.T, rtol=1e-9, atol=1e-12 * np.abs(arr).max())
                                        or np.any(np.diag(arr) < 0)):
                    fail(tpath, f"array {e['name']}.{f} is not symmetric with a non-negative diagonal")
                a[f] = np.array(arr)
            st = HeadStats(d)
            st.n_queries = field_int(mpath, e, "n_queries", 0)
            st.qq = a["qq"]
            for obj in ("keys", "values_s2", "values_s1"):
                setattr(st, obj, Moments(d, weights[obj], a[f"{obj}.mean"], a[f"{obj}.m2"]))
            out.heads[(layer, h)] = st
        return out
