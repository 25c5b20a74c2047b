"""NOVA-KV (gain-shape VQ in attention-preserving coefficients) and OSCAR (calibrated rotation + INT2).

Notes
-----
:ref:`ref-nova-kv`, :ref:`ref-oscar`. Both read a calibrated ``codebooks.nova.NovaHead``.

NOVA-KV, role "key": ``c = (k - mu_k) S V`` (generalized Parseval: squared error in c is logit
error), gain ``gamma = rms(c)`` and shape ``c / gamma_stored``; each equal-volume group of ``g``
coefficients is replaced by the index of its nearest centroid (squared Euclidean distance, ties to
the lower index; kernels must match) in that group's codebook of ``2^(bits g)`` entries. Stored per
token: the indices (``bits g`` bits each, packed) and the gain, float32 as NOVA-KV's release stores
it: ``bits + 32/d`` bits per element (2.25 at d=128); ``gain_dtype="float16"`` (our earlier default)
stores ``bits + 16/d`` (2.125). The release's equal-volume grouping is the stratified round-robin by
rank, ``codebooks.nova.calibrate``'s default (``grouping="swap"``, our refinement, is an option);
with both, the key indices are the release's. Attention never inverse-transforms the cache: a query
is mapped once to ``q_m = q S^-1 V`` and ``q . k_hat = q_m . c_hat + q . mu_k`` in coefficient space
(kernels form it as ``gamma * sum_j T_j[code_j]`` with per-group tables ``T_j[i] = q_m[G_j] .
centroid_j[i]``). A zero coefficient vector has gain 0 and reconstructs to the mean.

NOVA-KV, role "value", by default as NOVA-KV's release: OSCAR's clip, INT2 and byte layout
(``Oscar(head, "value", rotation="nova")``, below) after the rotation ``R = U H P_br`` of the
uncentred value statistic weighted by ``k^T Sigma_q k``, one per layer (``codebooks.nova``), ``2 +
64/128 = 2.5`` bits per element. ``values="vq"`` (our extension): the key method's VQ on the
score-weighted KLT coefficients with a float32 gain (``bits + 32/d``, 2.25), value sums formed in
coefficient space (kernels: per-group histograms of ``p_t gamma_t`` over codes times the centroids)
and rotated back once.

Measured effects of the named options (``benchmarks/fidelity.py``, ``benchmarks/results/fidelity.json``;
d = 128, two synthetic heads whose query and key statistics do not commute): ``gain_dtype="float16"``
keeps 99.92 % of the key indices and the same logit error (relative 0.0095 / 0.0133 on the two
heads) at 2.125 instead of 2.25 bits; ``grouping="swap"`` lowers the grouping gap from 0.18 to 1e-5
and the relative logit error to 0.0084 / 0.0117 (-12 %); ``values="vq"`` stores 2.25 instead of 2.5
bits and lowers the value error from 0.119 / 0.126 to 0.044 / 0.044 (relative MSE) and the
attention-output error with exact keys from 0.119 / 0.125 to 0.069 / 0.073.

OSCAR (official behaviour: :ref:`ref-oscar`, ``tests/interop/data/oscar/``, OSCAR commit 473ff3f; the
defaults reproduce it bit for bit, the rotated rows included, ``tests/interop/test_oscar.py``): ``y = x R`` with
the calibrated ``R = U H P_br``, computed as the release does in bfloat16 (``rows="bfloat16"``: ``y =
bf16(bf16(x) bf16(R))``, a bfloat16 GEMM accumulating in float32 in index order,
``kvq_ref.official.bf16_matmul``); each row is clipped symmetrically at the order statistic of ``|y|`` with
0-based index ``c = int(clip * d)`` (``clip`` 0.96 keys, 0.92 values: c = 122, 117 at d = 128; the
decode-flush kernel's float32 bisection with ``threshold="bisect"``), then quantized per group of
128 channels by ``kvq_ref.official.oscar_quantize`` (float32 scale and float zero point, round half
up) and packed in OSCAR's strided byte order: ``2 + 64/128 = 2.5`` bits per element before the
16-bit band. Decode ``y_hat R^T`` (float64 R).

Named deviations (effects measured by ``benchmarks/fidelity.py``, ``benchmarks/results/fidelity.json``):

* ``clip_mode="quantile"``: our earlier clip, the range ``[quantile(1 - clip), quantile(clip)]`` of
  each group (numpy's linear interpolation), asymmetric and interpolated.
* ``rule="uniform"``: the float16 scale and minimum of ``kvq_ref.uniform`` (round half up with its
  margin steps) and ``kvq_ref.packing``'s byte order: ``2 + 32/128 = 2.25`` bits per element, the
  rate the OSCAR paper's 2.28 counts.
* ``rows="float64"``: the rotation in float64, no bfloat16 rounding of x, R or y.

Measured on the same data (two heads; relative MSE, codes agreeing with the default):
``clip_mode="quantile"`` agrees on 87.6-88.1 % of key codes and 82.2-82.3 % of value codes (the
issue's comparison with OSCAR's code found 87.7 % / 82.4 %) and lowers the key error from 0.154 to
0.121 (logit error 0.157 to 0.119) and the value error from 0.126 to 0.114; ``threshold="bisect"``
agrees on 98.6 % / 99.1 %; ``rule="uniform"`` on 99.98 % with the same error at 2.25 instead of 2.5
bits; ``rows="float64"`` on 99.8 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
from numba import njit, prange

from codebooks.nova import NovaHead

from .common import Encoded, Quantizer, RotatedQuantizer, as_array, fp_dtype, row_norms, to_fp
from .official import bf16_matmul, clip_index, oscar_dequantize, oscar_quantize, oscar_threshold, pack_strided, \
    unpack_strided
from .packing import pack_codes, packed_size, unpack_codes
from .rotations import MatrixRotation
from .threads import rows_parallel
from .uniform import dequantize, group_quantile_range, quantize, quantize_range

__all__ = ["NovaKV", "Oscar"]


def nearest_centroids(shapes, groups, centroids, out):
    """Per token and group, the index of the nearest centroid (ties: lower index).

    shapes (N, d) float64, groups (G, g) int64, centroids (G, K, g) float64, out (N, G) uint8.

    Notes
    -----
    The squared distance to centroid ``i`` of group ``j`` is summed over the group's coordinates in
    order, ``((0 + e_0^2) + e_1^2) + ...`` with ``e_t = shapes[r, groups[j, t]] - centroids[j, i, t]``
    (no fused multiply-add), and the first ``i`` with the smallest distance wins: what a decode
    kernel's encoder must match. The kernels keep the centroids coordinate-major. For g = 4 (NOVA-KV's
    groups) one runs 16 tokens side by side, each SIMD lane one token's running distance and best
    index (a select, never a branch), so nothing but the lanes changes the order of operations;
    for other g the K distances of a token's group are formed in one pass before the scan. Both
    are tested against a numpy argmin in ``tests/kvq_ref/test_nova.py``.
    """
    nearest_by_coordinate(shapes, groups, by_coordinate(centroids), out)


def by_coordinate(centroids: np.ndarray) -> np.ndarray:
    """Centroids (G, K, g) as the coordinate-major (G, g, K) float64 array the kernels read."""
    return np.ascontiguousarray(np.transpose(centroids, (0, 2, 1)), dtype=np.float64)


def nearest_by_coordinate(shapes, groups, coordinate_major, out):
    """``nearest_centroids`` with centroids already ``by_coordinate`` (a quantizer converts its
    codebooks once, not at every encode of a decode step's token)."""
    (_nearest_g4 if coordinate_major.shape[1] == 4 else _nearest_centroids)(shapes, groups, coordinate_major, out)


_LANES = 16  # tokens per block of _nearest_g4


@rows_parallel
@njit(parallel=True, cache=True)
def _nearest_g4(shapes, groups, by_coordinate, out):
    """``nearest_centroids`` for groups of 4 coordinates, ``_LANES`` tokens at a time."""
    n = shapes.shape[0]
    n_groups, _, k = by_coordinate.shape
    for b in prange((n + _LANES - 1) // _LANES):
        lo = b * _LANES
        m = min(n, lo + _LANES) - lo
        x = np.zeros((4, _LANES))  # lanes past the last token hold stale values, never written out
        best_d = np.empty(_LANES)
        best = np.empty(_LANES, np.int64)
        for j in range(n_groups):
            for t in range(4):
                col = groups[j, t]
                for r in range(m):
                    x[t, r] = shapes[lo + r, col]
            x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
            for r in range(_LANES):
                best_d[r] = np.inf
                best[r] = 0
            for i in range(k):
                c0, c1, c2 = by_coordinate[j, 0, i], by_coordinate[j, 1, i], by_coordinate[j, 2, i]
                c3 = by_coordinate[j, 3, i]
                for r in range(_LANES):
                    e0, e1, e2, e3 = x0[r] - c0, x1[r] - c1, x2[r] - c2, x3[r] - c3
                    dist = ((e0 * e0 + e1 * e1) + e2 * e2) + e3 * e3  # = ((0 + e0^2) + e1^2) + ...
                    less = dist < best_d[r]
                    best[r] = i if less else best[r]
                    best_d[r] = dist if less else best_d[r]
            for r in range(m):
                out[lo + r, j] = best[r]


@rows_parallel
@njit(parallel=True, cache=True)
def _nearest_centroids(shapes, groups, by_coordinate, out):
    """``nearest_centroids`` with the centroids as (G, g, K) float64."""
    n = shapes.shape[0]
    n_groups, g, k = by_coordinate.shape
    for r in prange(n):
        dist = np.empty(k)
        for j in range(n_groups):
            dist[:] = 0.0
            for t in range(g):
                x = shapes[r, groups[j, t]]
                for i in range(k):
                    diff = x - by_coordinate[j, t, i]
                    dist[i] += diff * diff
            best = 0
            best_d = np.inf
            for i in range(k):
                if dist[i] < best_d:
                    best_d = dist[i]
                    best = i
            out[r, j] = best


def _check_role(role):
    if role not in ("key", "value"):
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")


@dataclass(frozen=True)
class NovaKV(Quantizer):
    """NOVA-KV gain-shape VQ of one head's keys or values.

    Parameters
    ----------
    head : codebooks.nova.NovaHead
        Calibrated transforms, groups and codebooks.
    role : {"key", "value"}
    gain_dtype : {"float32", "float16"}
        Storage of the per-token gain (float32 as the release; VQ values always use float32).
    values : {"int2", "vq"}
        Role "value" only. ``"int2"`` (default, NOVA-KV's release): ``Oscar(head, "value",
        rotation="nova")``, OSCAR's clip (0.92), INT2 and byte layout on the head's ``nova_value``
        rotation, 2.5 bits per element at d = 128; every call is delegated to that Oscar and the
        Encoded carries its arrays. ``"vq"``: our extension, the gain-shape VQ of the key method on
        the score-weighted KLT coefficients (module Notes), 2.25 bits at d = 128.

    Notes
    -----
    Not idempotent: a decoded token's coefficients are ``gamma16 * centroid`` per group, whose RMS
    is generally not ``gamma16``, so re-encoding rescales the shape and can move an index.
    """

    head: NovaHead
    role: str = "key"
    gain_dtype: str = "float32"
    values: str = "int2"
    name: ClassVar[str] = "nova_kv"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.head, NovaHead):
            raise TypeError(f"head must be a codebooks.nova.NovaHead, got {type(self.head).__name__}")
        _check_role(self.role)
        fp_dtype(self.gain_dtype)
        if self.values not in ("int2", "vq"):
            raise ValueError(f"values must be 'int2' or 'vq', got {self.values!r}")
        if self.role == "value" and self.gain_dtype != "float32":
            raise ValueError(f"value gains are stored as float32, got gain_dtype={self.gain_dtype!r}")

    @cached_property
    def int2(self):
        """The OSCAR-style INT2 quantizer of the release's value path (None for keys and VQ values)."""
        if self.role == "value" and self.values == "int2":
            return Oscar(self.head, "value", rotation="nova")
        return None

    def _inner(self, enc: Encoded) -> Encoded:
        self._check(enc)
        return Encoded(self.int2.name, self.int2.config, enc.shape, enc.arrays)

    @property
    def dim(self) -> int:
        return self.head.d

    @cached_property
    def _tables(self):
        h = self.head
        if self.role == "key":
            return h.key, h.key_groups, h.key_centroids.astype(np.float64), fp_dtype(self.gain_dtype)
        return h.value, h.value_groups, h.value_centroids.astype(np.float64), np.dtype(np.float32)

    @cached_property
    def _by_coordinate(self) -> np.ndarray:
        return by_coordinate(self._tables[2])

    @property
    def _code_bits(self) -> int:
        return self.head.bits * self.head.g

    def layout(self, shape):
        if self.int2 is not None:
            return self.int2.layout(shape)
        lead = tuple(shape[:-1])
        n_groups = self.dim // self.head.g
        return {"codes": (lead + (packed_size(n_groups, self._code_bits),), np.dtype(np.uint8)),
                "gains": (lead, self._tables[3])}

    def encode(self, x) -> Encoded:
        if self.int2 is not None:
            inner = self.int2.encode(x)
            return self._make(inner.shape, inner.arrays)
        x = as_array("x", x, dim=self.dim)
        transform, groups, _, gain_dtype = self._tables
        c = np.ascontiguousarray(transform.coefficients(x.reshape(-1, self.dim)))
        gains = to_fp("gains", row_norms(c) / np.sqrt(self.dim), gain_dtype)
        g64 = gains.astype(np.float64)
        shapes = np.divide(c, g64[:, None], out=np.zeros_like(c), where=g64[:, None] > 0)
        codes = np.empty((c.shape[0], groups.shape[0]), dtype=np.uint8)
        nearest_by_coordinate(shapes, groups, self._by_coordinate, codes)
        lead = x.shape[:-1]
        return self._make(x.shape, {"codes": pack_codes(codes, self._code_bits).reshape(lead + (-1,)),
                                    "gains": gains.reshape(lead)})

    def _parts(self, enc: Encoded):
        """(codes (N, G) uint8, gains (N,) float64) after validation."""
        self._check(enc)
        packed = enc.arrays["codes"].reshape(-1, enc.arrays["codes"].shape[-1])
        return (unpack_codes(packed, self._code_bits, self.dim // self.head.g),
                enc.arrays["gains"].reshape(-1).astype(np.float64))

    def _coefficients(self, codes, gains):
        _, groups, centroids, _ = self._tables
        c = np.zeros((codes.shape[0], self.dim))
        for j in range(groups.shape[0]):
            c[:, groups[j]] = centroids[j][codes[:, j]]
        return c * gains[:, None]

    def decode(self, enc: Encoded) -> np.ndarray:
        if self.int2 is not None:
            return self.int2.decode(self._inner(enc))
        codes, gains = self._parts(enc)
        transform = self._tables[0]
        return transform.reconstruct(self._coefficients(codes, gains)).astype(np.float32).reshape(enc.shape)

    def prepare_query(self, q):
        """``[q_m, q . mu]``: the query in coefficient space and its constant offset, shape (m, d+1)."""
        if self.int2 is not None:
            return self.int2.prepare_query(q)
        transform = self._tables[0]
        qm = transform.query(q) if self.role == "key" else q @ transform.basis
        return np.concatenate([qm, (q @ transform.mu)[:, None]], axis=1)

    def scores(self, q_prepared, enc):
        """``q_m . c_hat + q . mu`` in coefficient space (the cache is never inverse-transformed).

        Equal to the per-group lookup form ``gamma * sum_j T_j[code_j] + q . mu`` with
        ``T_j[i] = q_m[G_j] . centroid_j[i]``, which decode kernels use; this reference forms
        ``c_hat`` directly, which is faster on a CPU when many queries meet many tokens.
        """
        if self.int2 is not None:
            return self.int2.scores(q_prepared, self._inner(enc))
        codes, gains = self._parts(enc)
        qm, offset = q_prepared[:, :-1], q_prepared[:, -1]
        return qm @ self._coefficients(codes, gains).T + offset[:, None]

    def accumulate(self, p, enc):
        """``sum_t p_t v_hat_t``: summed in coefficient space, then one inverse transform.

        Kernels sum per-group histograms of ``p_t gamma_t`` over codes and multiply them by the
        centroids; forming ``p @ c_hat`` is the same sum.
        """
        if self.int2 is not None:
            return self.int2.accumulate(p, self._inner(enc))
        codes, gains = self._parts(enc)
        transform = self._tables[0]
        c = p @ self._coefficients(codes, gains)
        mu_term = p.sum(axis=1, keepdims=True) * transform.mu
        if self.role == "key":
            return c @ transform.inverse + mu_term
        return c @ transform.basis.T + mu_term


@dataclass(frozen=True)
class Oscar(RotatedQuantizer):
    """OSCAR: calibrated rotation ``R = U H P_br`` then clipped asymmetric integer groups per token.

    Parameters
    ----------
    head : codebooks.nova.NovaHead
        Holds the calibrated rotations.
    role : {"key", "value"}
    bits : int
        1..8 (2 in OSCAR; ``rule="official"`` needs 1, 2, 4 or 8 for its byte order).
    group : int
        Channels per group (128; capped at d).
    clip : float, optional
        Clip ratio in (0, 1] (default 0.96 for keys, 0.92 for values; 1 keeps the largest ``|y|``).
    clip_mode : {"order", "quantile"}
    threshold : {"sort", "bisect"}
        How ``clip_mode="order"`` finds the order statistic (module Notes).
    rule : {"official", "uniform"}
    rows : {"bfloat16", "float64"}
    rotation : {"oscar", "nova"}
        ``"nova"`` (values only): the head's ``nova_value`` rotation, NOVA-KV's release for values.

    Notes
    -----
    Not idempotent: clipping shrinks the range again on every re-encode.
    """

    head: NovaHead
    role: str = "key"
    bits: int = 2
    group: int = 128
    clip: float | None = None
    clip_mode: str = "order"
    threshold: str = "sort"
    rule: str = "official"
    rows: str = "bfloat16"
    rotation: str = "oscar"
    name: ClassVar[str] = "oscar"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.head, NovaHead):
            raise TypeError(f"head must be a codebooks.nova.NovaHead, got {type(self.head).__name__}")
        _check_role(self.role)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive integer, got {self.group!r}")
        if self.dim % self.g:
            raise ValueError(f"group {self.g} must divide the head dimension {self.dim}")
        if self.clip is None:
            object.__setattr__(self, "clip", 0.96 if self.role == "key" else 0.92)
        for name, value, allowed in (("clip_mode", self.clip_mode, ("order", "quantile")),
                                     ("threshold", self.threshold, ("sort", "bisect")),
                                     ("rule", self.rule, ("official", "uniform")),
                                     ("rows", self.rows, ("bfloat16", "float64")),
                                     ("rotation", self.rotation, ("oscar", "nova"))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.rotation == "nova" and self.role != "value":
            raise ValueError("rotation='nova' is NOVA-KV's value rotation: role must be 'value'")
        if self.clip_mode == "quantile":
            group_quantile_range(np.zeros((1, 2)), 2, self.clip)  # validates clip
        else:
            clip_index(self.clip, self.dim)
        if self.rule == "official" and (8 % self.bits or self.dim % (8 // self.bits)):
            raise ValueError(f"rule='official' packs whole codes per byte: bits in 1, 2, 4, 8, got {self.bits}")

    @property
    def dim(self) -> int:
        return self.head.d

    @property
    def g(self) -> int:
        return min(self.group, self.dim)

    @cached_property
    def matrix(self) -> np.ndarray:
        """R (d, d), float64: rotated rows are ``y = x R``."""
        if self.rotation == "nova":
            return self.head.nova_value
        return self.head.oscar_key if self.role == "key" else self.head.oscar_value

    @cached_property
    def rot(self) -> MatrixRotation:
        # y = x R  <=>  apply(x) = x M^T with M = R^T
        return MatrixRotation(self.matrix.T)

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """The rows the quantizer sees, (N, d) float64 (bfloat16 values with ``rows="bfloat16"``)."""
        if self.rows == "float64":
            return self.rot.apply(x)
        return bf16_matmul(x, self.matrix).astype(np.float64)  # OSCAR's bf16 GEMM, float32 accumulation

    def clipped(self, y: np.ndarray) -> np.ndarray:
        """Rows (N, d) clipped as ``clip_mode`` says (float64; ``"order"`` in float32 as OSCAR)."""
        if self.clip_mode == "quantile":
            lo, hi = group_quantile_range(y, self.g, self.clip)
            n = y.shape[-1]
            return np.clip(y, np.repeat(lo, self.g, axis=-1)[..., :n], np.repeat(hi, self.g, axis=-1)[..., :n])
        t = oscar_threshold(y, clip_index(self.clip, self.dim), self.threshold).astype(np.float64)[:, None]
        return np.minimum(np.maximum(y.astype(np.float32).astype(np.float64), -t), t)

    def layout(self, shape):
        lead = tuple(shape[:-1])
        n_groups = self.dim // self.g
        side = "float32" if self.rule == "official" else "float16"
        names = ("scales", "zeros") if self.rule == "official" else ("scales", "minima")
        return {"codes": (lead + (packed_size(self.dim, self.bits),), np.dtype(np.uint8)),
                **{nm: (lead + (n_groups,), fp_dtype(side)) for nm in names}}

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        y = self.rotate(x.reshape(-1, self.dim))
        lead = x.shape[:-1]
        if self.rule == "official":
            codes, scales, zeros = oscar_quantize(self.clipped(y), self.bits, self.g)
            arrays = {"codes": pack_strided(codes, self.bits), "scales": scales, "zeros": zeros}
        elif self.clip_mode == "quantile":
            codes, scales, minima = quantize_range(y, *group_quantile_range(y, self.g, self.clip), self.bits, self.g)
            arrays = {"codes": pack_codes(codes, self.bits), "scales": scales, "minima": minima}
        else:
            codes, scales, minima = quantize(self.clipped(y), self.bits, self.g)
            arrays = {"codes": pack_codes(codes, self.bits), "scales": scales, "minima": minima}
        return self._make(x.shape, {k: v.reshape(lead + (-1,)) for k, v in arrays.items()})

    def _rotated(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        a = enc.arrays
        n_groups = self.dim // self.g
        packed = a["codes"].reshape(-1, a["codes"].shape[-1])
        if self.rule == "official":
            codes = unpack_strided(packed, self.bits)
            return oscar_dequantize(codes, a["scales"].reshape(-1, n_groups), a["zeros"].reshape(-1, n_groups),
                                    self.g).astype(np.float64)
        codes = unpack_codes(packed, self.bits, self.dim)
        return dequantize(codes, a["scales"].reshape(-1, n_groups), a["minima"].reshape(-1, n_groups), self.g)
