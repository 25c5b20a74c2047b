"""TurboQuant (arXiv 2504.19874): MSE quantizer, inner-product quantizer, outlier split.

Notes
-----
:ref:`ref-turboquant`. ``TurboQuantMSE`` stores ``||x||`` (or the norm-correction scale
``||x|| / ||c_hat||``) and the ``bits``-bit index of every coordinate of ``y = R x / ||x||`` in the
exact Lloyd-Max table of SphereMarginal(d) (``codebooks``); it decodes ``R^T c[idx] * scale``.
Queries are rotated once (``<q, x_hat> = <R q, c[idx]> * scale``) and weighted sums of values are
formed in the rotated domain with one inverse rotation at the end.

Quantization rule (kernels must match): ``||x||`` is ``common.row_norm`` (sequential float64 sum of
squares), ``y = R (x * (1/||x||))``, ``idx = #{thresholds < y_j}`` (a coordinate exactly on a
threshold takes the lower cell); codes are packed with ``kvq_ref.packing`` (little-endian bit
stream); the scale is rounded to ``norm_dtype`` (float16 by default) and decoding uses the rounded
value; decoding is ``R^T (c[idx] * scale)``. A zero vector is stored with scale 0 and decodes to
zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from codebooks import SphereMarginal

from .common import Encoded, Quantizer, RotatedQuantizer, as_array, codebook, fp_dtype, row_norms, to_fp
from .packing import pack_codes, packed_size, unpack_codes
from .rotations import make_rotation
from .sketch import QJLSketch

__all__ = ["TurboQuantMSE", "TurboQuantProd", "TurboQuantSplit", "quantize_rotated", "rotated_unit"]


def rotated_unit(flat: np.ndarray, rot) -> tuple[np.ndarray, np.ndarray]:
    """``(||x||, y = R (x * (1/||x||)))`` of rows (N, d), float64; y = 0 for a zero row.

    ``y`` is what the quantization rule compares with the thresholds (``kvq_ref.testing.tie_rows``
    puts coordinates exactly on them).
    """
    norms = row_norms(flat)
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return norms, rot.apply(flat * inv[:, None])


def quantize_rotated(flat: np.ndarray, rot, table, norm_correction: bool) -> tuple[np.ndarray, np.ndarray]:
    """The TurboQuant quantization rule for rows of ``flat`` (N, d), float64.

    ``||x||`` is ``row_norm`` (sequential float64 sum of squares), ``y = R (x * (1/||x||))`` (0 for a
    zero row), ``idx = #{thresholds < y_j}``, and the scale is ``||x||`` or, with norm correction,
    ``||x|| / ||c[idx]||`` (again ``row_norm``). Shared by TurboQuantMSE and the turbo block formats.

    Returns
    -------
    codes : ndarray, uint8, shape (N, d)
    scale : ndarray, float64, shape (N,)
    """
    norms, y = rotated_unit(flat, rot)
    codes = np.searchsorted(table.thresholds, y, side="left").astype(np.uint8)
    scale = norms / row_norms(table.levels[codes]) if norm_correction else norms
    return codes, scale


def _check_common(dim, bits, lo_bits, hi_bits, rotation, seed, norm_dtype):
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not lo_bits <= bits <= hi_bits:
        raise ValueError(f"bits must be an integer in {lo_bits}..{hi_bits}, got {bits!r}")
    if rotation not in ("hadamard", "haar"):
        raise ValueError(f"rotation must be 'hadamard' or 'haar', got {rotation!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    fp_dtype(norm_dtype)


@dataclass(frozen=True)
class TurboQuantMSE(RotatedQuantizer):
    """TurboQuant_mse: random rotation + exact Lloyd-Max scalar codebook + stored norm.

    Parameters
    ----------
    dim : int
        Vector dimension d (>= 2; non-powers of two use the block-Hadamard rotation).
    bits : int
        1..8 bits per coordinate.
    rotation : {"hadamard", "haar"}
    seed : int
    norm_correction : bool
        Store ``||x|| / ||c_hat||`` instead of ``||x||`` (decoded norm equals ``||x||``).
    norm_dtype : {"float16", "float32"}

    Notes
    -----
    Not idempotent for every input. Re-encoding ``x_hat`` quantizes ``c_hat / ||c_hat||``: the codes
    stay put iff ``1/||c_hat||`` lies in ``table.invariant_scales()`` (about (0.89, 1.14) at 4 bits;
    ``||c_hat||^2`` concentrates at ``1 - d mse``, so a vector leaves the band only when its rotated
    coordinates are very uneven, e.g. at small d). Inside the band the codes are a fixed point and,
    with ``norm_correction=True``, so is the stored scale; with plain norms the decoded norm is
    ``||x|| ||c_hat||``, so the re-encoded norm shrinks by ``||c_hat||``.
    """

    dim: int
    bits: int
    rotation: str = "hadamard"
    seed: int = 0
    norm_correction: bool = False
    norm_dtype: str = "float16"
    name: ClassVar[str] = "turboquant_mse"
    idempotent: ClassVar[bool] = False

    def __post_init__(self):
        _check_common(self.dim, self.bits, 1, 8, self.rotation, self.seed, self.norm_dtype)

    @cached_property
    def rot(self):
        """The seeded rotation R."""
        return make_rotation(self.rotation, self.dim, self.seed)

    @cached_property
    def table(self):
        """The Lloyd-Max ``Codebook`` of SphereMarginal(dim) at ``bits``."""
        return codebook(SphereMarginal(self.dim), self.bits)

    def layout(self, shape):
        lead = tuple(shape[:-1])
        return {"codes": (lead + (packed_size(self.dim, self.bits),), np.dtype(np.uint8)),
                "norms": (lead, fp_dtype(self.norm_dtype))}

    def compared(self, x) -> tuple[np.ndarray, np.ndarray]:
        """``(y, thresholds)``: the rotated coordinates (N, d) float64 that ``encode`` compares with the
        thresholds (a coordinate equal to one takes the lower cell), for tie tests."""
        x = as_array("x", x, dim=self.dim)
        return rotated_unit(np.ascontiguousarray(x.reshape(-1, self.dim)), self.rot)[1], self.table.thresholds

    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape (..., dim)."""
        x = as_array("x", x, dim=self.dim)
        codes, scale = quantize_rotated(np.ascontiguousarray(x.reshape(-1, self.dim)), self.rot, self.table,
                                        self.norm_correction)
        lead = x.shape[:-1]
        return self._make(x.shape, {
            "codes": pack_codes(codes, self.bits).reshape(lead + (-1,)),
            "norms": to_fp("norms", scale, fp_dtype(self.norm_dtype)).reshape(lead),
        })

    def _parts(self, enc: Encoded):
        """(c_hat in the rotated domain (N, d), scales (N,)) after validation."""
        self._check(enc)
        codes = unpack_codes(enc.arrays["codes"].reshape(-1, enc.arrays["codes"].shape[-1]), self.bits, self.dim)
        return self.table.levels[codes], enc.arrays["norms"].reshape(-1).astype(np.float64)

    def _rotated(self, enc: Encoded) -> np.ndarray:
        chat, scale = self._parts(enc)
        return chat * scale[:, None]


@dataclass(frozen=True)
class TurboQuantProd(Quantizer):
    """TurboQuant_prod: (bits-1)-bit TurboQuantMSE plus a 1-bit QJL sketch of the residual.

    Parameters
    ----------
    dim : int
    bits : int
        1..9 total bits per coordinate (bits = 1 is the QJL sketch alone).
    rotation : {"hadamard", "haar"}
    seed : int
    sketch : {"gaussian", "orthogonal"}
        QJL matrix: i.i.d. Gaussian, or orthogonal rows (lower variance).
    m : int, optional
        Sketch rows (default dim, one sign bit per coordinate).
    norm_dtype : {"float16", "float32"}

    Notes
    -----
    ``<q, x_hat>`` is unbiased (TurboQuant Theorem 2); with a Gaussian sketch its error is exactly
    ``theory.qjl_prod_distortion``. Not idempotent: the sketch reconstruction ``S^T sign(S r)`` is
    an unbiased estimate of r, not a point whose sketch is ``sign(S r)``.
    """

    dim: int
    bits: int
    rotation: str = "hadamard"
    seed: int = 0
    sketch: str = "gaussian"
    m: int | None = None
    norm_dtype: str = "float16"
    name: ClassVar[str] = "turboquant_prod"
    idempotent: ClassVar[bool] = False
    estimator: ClassVar[bool] = True

    def __post_init__(self):
        _check_common(self.dim, self.bits, 1, 9, self.rotation, self.seed, self.norm_dtype)
        if self.sketch not in ("gaussian", "orthogonal"):
            raise ValueError(f"sketch must be 'gaussian' or 'orthogonal', got {self.sketch!r}")
        if self.m is not None and (isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1):
            raise ValueError(f"m must be a positive integer or None, got {self.m!r}")

    @property
    def rows(self) -> int:
        return self.m or self.dim

    @cached_property
    def mse(self) -> TurboQuantMSE | None:
        """The (bits-1)-bit MSE stage (None at bits = 1)."""
        if self.bits == 1:
            return None
        return TurboQuantMSE(self.dim, self.bits - 1, self.rotation, self.seed, False, self.norm_dtype)

    @cached_property
    def qjl(self) -> QJLSketch:
        return QJLSketch(self.rows, self.dim, self.sketch, self.seed)

    def layout(self, shape):
        lead = tuple(shape[:-1])
        out = {"signs": (lead + (packed_size(self.rows, 1),), np.dtype(np.uint8)),
               "residual_norms": (lead, fp_dtype(self.norm_dtype))}
        if self.mse is not None:
            out.update({f"mse_{k}": v for k, v in self.mse.layout(shape).items()})
        return out

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        lead = x.shape[:-1]
        arrays = {}
        if self.mse is None:
            resid = x
        else:
            inner = self.mse.encode(x)
            arrays.update({f"mse_{k}": v for k, v in inner.arrays.items()})
            resid = x - self.mse.decode(inner).astype(np.float64)
        flat = np.ascontiguousarray(resid.reshape(-1, self.dim))
        rnorm = to_fp("residual_norms", row_norms(flat), fp_dtype(self.norm_dtype))
        arrays["signs"] = pack_codes(self.qjl.signs(flat).astype(np.uint8), 1).reshape(lead + (-1,))
        arrays["residual_norms"] = rnorm.reshape(lead)
        return self._make(x.shape, arrays)

    def _inner(self, enc: Encoded) -> Encoded | None:
        if self.mse is None:
            return None
        return Encoded(self.mse.name, self.mse.config, enc.shape,
                       {k[4:]: v for k, v in enc.arrays.items() if k.startswith("mse_")})

    def _sketch_parts(self, enc: Encoded):
        self._check(enc)
        signs = unpack_codes(enc.arrays["signs"].reshape(-1, enc.arrays["signs"].shape[-1]), 1, self.rows)
        return signs.astype(bool), enc.arrays["residual_norms"].reshape(-1).astype(np.float64)

    def decode(self, enc: Encoded) -> np.ndarray:
        signs, rnorm = self._sketch_parts(enc)
        out = self.qjl.reconstruct(signs, rnorm)
        if self.mse is not None:
            out = out + self.mse.decode(self._inner(enc)).reshape(-1, self.dim)
        return out.astype(np.float32).reshape(enc.shape)

    def scores(self, q_prepared, enc):
        signs, rnorm = self._sketch_parts(enc)
        s = self.qjl.estimate(q_prepared, signs, rnorm)
        if self.mse is not None:
            s = s + self.mse.scores(self.mse.prepare_query(q_prepared), self._inner(enc))
        return s


@dataclass(frozen=True)
class TurboQuantSplit(Quantizer):
    """Fractional rates by an outlier-channel split into two TurboQuantMSE instances.

    Parameters
    ----------
    dim : int
    outliers : tuple of int
        Channel indices quantized with ``bits_outlier``; the rest use ``bits_regular``.
    bits_outlier, bits_regular : int
    rotation, seed, norm_dtype
        As for ``TurboQuantMSE`` (the two parts get seeds ``seed`` and ``seed + 1``).

    Notes
    -----
    TurboQuant's 2.5-bit setting is 32 outlier channels at 3 bits and 96 at 2 bits (d=128); with
    the two float16 norms the stored rate is (32*3 + 96*2 + 32) / 128 = 2.5 bits/element exactly
    (3.5 likewise with 4 and 3 bits). ``calibrate`` picks the outliers by RMS magnitude.
    """

    dim: int
    outliers: tuple
    bits_outlier: int = 3
    bits_regular: int = 2
    rotation: str = "hadamard"
    seed: int = 0
    norm_dtype: str = "float16"
    name: ClassVar[str] = "turboquant_split"
    idempotent: ClassVar[bool] = False  # plain norms (see TurboQuantMSE)

    def __post_init__(self):
        _check_common(self.dim, self.bits_outlier, 1, 8, self.rotation, self.seed, self.norm_dtype)
        _check_common(self.dim, self.bits_regular, 1, 8, self.rotation, self.seed, self.norm_dtype)
        idx = tuple(int(i) for i in np.asarray(self.outliers).ravel())
        if len(idx) < 2 or len(idx) > self.dim - 2 or len(set(idx)) != len(idx) \
                or min(idx) < 0 or max(idx) >= self.dim:
            raise ValueError(f"outliers must be 2..dim-2 distinct channel indices in 0..{self.dim - 1}")
        object.__setattr__(self, "outliers", tuple(sorted(idx)))

    @classmethod
    def calibrate(cls, samples, rate: float = 2.5, n_outliers: int | None = None, **kwargs) -> "TurboQuantSplit":
        """Choose outlier channels from calibration vectors by RMS magnitude.

        Parameters
        ----------
        samples : array_like, shape (..., dim)
        rate : {2.5, 3.5}
            2.5: outliers at 3 bits, the rest at 2; 3.5: 4 and 3 bits.
        n_outliers : int, optional
            Default dim // 4 (32 of 128).
        """
        x = as_array("samples", samples)
        dim = x.shape[-1]
        if rate not in (2.5, 3.5):
            raise ValueError(f"rate must be 2.5 or 3.5, got {rate!r}")
        hi = int(math.ceil(rate))
        n = n_outliers if n_outliers is not None else dim // 4
        rms = np.sqrt(np.mean(x.reshape(-1, dim) ** 2, axis=0))
        top = np.argsort(-rms, kind="stable")[:n]
        return cls(dim, tuple(int(i) for i in top), hi, hi - 1, **kwargs)

    @cached_property
    def _index(self):
        out = np.asarray(self.outliers)
        reg = np.setdiff1d(np.arange(self.dim), out)
        return out, reg

    @cached_property
    def parts(self) -> tuple[TurboQuantMSE, TurboQuantMSE]:
        out, reg = self._index
        return (TurboQuantMSE(out.size, self.bits_outlier, self.rotation, self.seed, False, self.norm_dtype),
                TurboQuantMSE(reg.size, self.bits_regular, self.rotation, self.seed + 1, False, self.norm_dtype))

    def layout(self, shape):
        lead = tuple(shape[:-1])
        out = {}
        for tag, q, idx in zip(("out", "reg"), self.parts, self._index):
            out.update({f"{tag}_{k}": v for k, v in q.layout(lead + (idx.size,)).items()})
        return out

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        arrays = {}
        for tag, q, idx in zip(("out", "reg"), self.parts, self._index):
            arrays.update({f"{tag}_{k}": v for k, v in q.encode(x[..., idx]).arrays.items()})
        return self._make(x.shape, arrays)

    def _sub(self, enc, tag, q, idx):
        return Encoded(q.name, q.config, tuple(enc.shape[:-1]) + (idx.size,),
                       {k[4:]: v for k, v in enc.arrays.items() if k.startswith(tag + "_")})

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        out = np.empty(enc.shape, dtype=np.float32)
        for tag, q, idx in zip(("out", "reg"), self.parts, self._index):
            out[..., idx] = q.decode(self._sub(enc, tag, q, idx))
        return out

    def scores(self, q_prepared, enc):
        self._check(enc)
        total = 0.0
        for tag, q, idx in zip(("out", "reg"), self.parts, self._index):
            total = total + q.scores(q.prepare_query(q_prepared[:, idx]), self._sub(enc, tag, q, idx))
        return total

    def accumulate(self, p, enc):
        self._check(enc)
        out = np.empty((p.shape[0], self.dim))
        for tag, q, idx in zip(("out", "reg"), self.parts, self._index):
            out[:, idx] = q.accumulate(p, self._sub(enc, tag, q, idx))
        return out
