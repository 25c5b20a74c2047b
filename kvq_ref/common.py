"""The common quantizer interface: ``Encoded`` buffers, the ``Quantizer`` base, input checks.

Conventions every method follows (kernels and the evaluation rely on them):

* Inputs are arrays of shape ``(..., d)`` (numpy, or torch tensors, any float dtype), vectors
  along the last axis; methods that group tokens (KIVI keys, QJL outlier groups) read the second
  to last axis as tokens, shape ``(..., n, d)``. Computation is in float64; ``decode`` returns
  float32.
* ``encode(x) -> Encoded`` holds everything stored, by name: packed codes (uint8), norms and scales
  (float16 or float32), indices. ``Encoded.bits_per_element`` is ``8 * nbytes / x.size`` of those
  arrays, so the rate is what is stored, never a formula. Shared state (rotations, codebooks,
  sketch matrices) is derived from the quantizer's config and seed and is not counted.
* ``decode`` refuses an ``Encoded`` made by another method or config, or whose arrays do not have
  the expected names, dtypes and shapes (``Quantizer.layout``), with one ``ValueError``.
* Zero vectors encode and decode to zeros, never NaN.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import ClassVar

import numpy as np
from numba import njit, prange

from .threads import rows_parallel

__all__ = ["Encoded", "Quantizer", "RotatedQuantizer", "as_array", "codebook", "row_norm", "row_norms", "fp_dtype", "to_fp", "check_fp_finite", "check_shape"]


@dataclass(frozen=True, eq=False)
class Encoded:
    """The stored form of a tensor.

    Attributes
    ----------
    method : str
        Name of the quantizer (``Quantizer.name``).
    config : dict
        The quantizer's parameters; decode checks they match its own.
    shape : tuple of int
        Shape of the encoded tensor.
    arrays : dict of str -> ndarray
        Everything stored (packed codes as uint8, norms and scales as float16/float32, ...).
    """

    method: str
    config: dict
    shape: tuple
    arrays: dict

    def __post_init__(self):
        object.__setattr__(self, "shape", check_shape("shape", self.shape))
        if not isinstance(self.arrays, dict):
            raise TypeError(f"arrays must be a dict of name -> ndarray, got {type(self.arrays).__name__}")

    @property
    def nbytes(self) -> int:
        """Total bytes of the stored arrays."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def elements(self) -> int:
        """Number of encoded scalars (``prod(shape)``)."""
        return int(math.prod(self.shape))

    @property
    def bits_per_element(self) -> float:
        """``8 * nbytes / elements``: the rate, from what is stored; 0.0 for an empty tensor (no
        element, nothing stored)."""
        if self.elements == 0:
            return 0.0
        return 8.0 * self.nbytes / self.elements

    def __eq__(self, other):
        if not isinstance(other, Encoded):
            return NotImplemented
        return (self.method == other.method and self.config == other.config and self.shape == other.shape
                and self.arrays.keys() == other.arrays.keys()
                and all(self.arrays[k].dtype == other.arrays[k].dtype
                        and np.array_equal(self.arrays[k], other.arrays[k]) for k in self.arrays))

    __hash__ = None  # type: ignore[assignment]


def check_shape(name: str, shape) -> tuple:
    """A tensor shape: a tuple/list of at least one int >= 0 (booleans and floats such as 2.9 refused)."""
    if isinstance(shape, np.ndarray):
        shape = shape.tolist()
    if not isinstance(shape, tuple | list) or not shape:
        raise ValueError(f"{name} must be a non-empty tuple of ints, got {shape!r}")
    out = []
    for s in shape:
        if isinstance(s, bool | np.bool_) or not isinstance(s, int | np.integer) or s < 0:
            raise ValueError(f"{name} must hold ints >= 0, got {shape!r}")
        out.append(int(s))
    return tuple(out)


def _plain(v):
    """Config values as plain Python (tuples of ints, floats, str) for comparison and JSON."""
    if isinstance(v, np.ndarray):
        return tuple(v.tolist())
    if isinstance(v, tuple | list):
        return tuple(_plain(e) for e in v)
    if isinstance(v, np.generic):
        return v.item()
    if hasattr(v, "digest"):  # calibrated tables (e.g. codebooks.nova.NovaHead): identified by hash
        return f"sha256:{v.digest}"
    return v


@lru_cache(maxsize=256)
def codebook(density, bits: int):
    """The exact Lloyd-Max ``Codebook`` of ``density`` at ``bits``, correctly rounded (solved once per
    process; the same levels as the shipped tables, on every platform)."""
    from codebooks import lloyd_max

    return lloyd_max(density, bits, exact=True)


@njit(cache=True)
def row_norm(x) -> float:
    """Euclidean norm of one row: sequential float64 sum of squares, then sqrt (the spec's rule)."""
    s = 0.0
    for v in x:
        w = np.float64(v)  # float32 input is squared in float64 (numba keeps float(v) in float32)
        s += w * w
    return math.sqrt(s)


@rows_parallel
@njit(parallel=True, cache=True)
def row_norms(x):
    """``row_norm`` of every row of a 2-D array: shape (n,), float64."""
    out = np.empty(x.shape[0])
    for r in prange(x.shape[0]):
        out[r] = row_norm(x[r])
    return out


def as_array(name: str, x, dim: int | None = None, min_ndim: int = 1, finite: bool = True) -> np.ndarray:
    """``x`` (numpy or torch, any real float dtype) as a float64 numpy array, checked.

    ``finite=False`` lets NaN/Inf through (only where a method defines their result).

    Raises
    ------
    TypeError
        Not a real floating array.
    ValueError
        Wrong last dimension, too few axes, or NaN/Inf (the message names ``name``).
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"{name} must be a real floating-point array, got dtype {arr.dtype}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {arr.shape}")
    if dim is not None and arr.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim}, got shape {arr.shape}")
    with np.errstate(invalid="ignore"):  # a signalling NaN is quieted (then refused unless finite=False)
        arr = arr.astype(np.float64)
    if finite and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or Inf ({int(np.count_nonzero(~np.isfinite(arr)))} values)")
    return arr


def fp_dtype(name: str) -> np.dtype:
    """numpy dtype for a side-information precision name: 'float16' or 'float32'."""
    if name not in ("float16", "float32"):
        raise ValueError(f"precision must be 'float16' or 'float32', got {name!r}")
    return np.dtype(name)


def to_fp(name: str, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round side information to its storage precision; refuse values it cannot hold."""
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name} overflow {dtype} (max {np.finfo(dtype).max:g}); store them in float32")
    return out


def check_fp_finite(name: str, arr: np.ndarray) -> None:
    """Refuse stored floating side information that is NaN/Inf (a corrupted buffer)."""
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"encoded array {name!r} holds NaN/Inf: corrupted buffer")


# --- rules shared by every method (applied by Quantizer.__init_subclass__) ------------------------
def _rows(shape) -> int:
    return math.prod(shape[:-1])


def _input_shape(x) -> tuple | None:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.shape(x)


def _rule_encode(fn):
    @functools.wraps(fn)
    def encode(self, x):
        shape = _input_shape(x)
        if len(shape) >= 1 and _rows(shape) == 0:
            as_array("x", x, dim=self.dim)  # dtype and last-dimension checks still apply
            return self._make(shape, {k: np.zeros(s, dt) for k, (s, dt) in self.layout(tuple(shape)).items()})
        return fn(self, x)
    encode._shared_rules = True
    return encode


def _rule_decode(fn):
    @functools.wraps(fn)
    def decode(self, enc):
        self._check(enc)
        if _rows(enc.shape) == 0:
            return np.zeros(enc.shape, np.float32)
        with np.errstate(over="ignore"):
            out = fn(self, enc)
        bad = ~np.all(np.isfinite(out.reshape(_rows(enc.shape), -1)), axis=1)
        if bad.any() and hasattr(self, "nonfinite_rows"):  # rows whose stored format defines NaN/Inf
            bad &= ~self.nonfinite_rows(enc)
        if bad.any():
            raise ValueError(f"{self.name} reconstruction overflows float32 (max {np.finfo(np.float32).max:g}): "
                             "the encoded values or scales are out of range")
        return out
    decode._shared_rules = True
    return decode


def _empty_rows_rule(empty):
    """Wrap a method whose last argument is an ``Encoded``: for zero rows return ``empty(self, *args)``."""
    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args):
            enc = args[-1]
            if isinstance(enc, Encoded) and _rows(enc.shape) == 0:
                self._check(enc)
                return empty(self, *args)
            return fn(self, *args)
        method._shared_rules = True
        return method
    return wrap


_SHARED_RULES = {
    "encode": _rule_encode,
    "decode": _rule_decode,
    "_rotated": _empty_rows_rule(lambda self, enc: np.zeros((0, self.dim))),
    "scores": _empty_rows_rule(lambda self, q, enc: np.zeros((q.shape[0], 0))),
    "accumulate": _empty_rows_rule(lambda self, p, enc: np.zeros((p.shape[0], self.dim))),
}


class Quantizer(ABC):
    """Base of every method: subclasses are frozen dataclasses of validated parameters.

    Subclasses implement ``encode``, ``decode`` and ``layout``; methods with an inner-product
    estimator or a rotated domain override ``prepare_query``/``scores``/``accumulate``.
    """

    name: ClassVar[str]
    #: decode(encode(x)) is a fixed point for every finite x: encode(decode(encode(x))) == encode(x)
    #: exactly. Methods where it is not (clipping, sketches, norm-normalized codes) state in their
    #: Notes the weaker law that does hold, and their tests check that law.
    idempotent: ClassVar[bool] = True
    #: ``scores`` is an inner-product estimator (QJL sketches), not ``<q, decode(enc)>``.
    estimator: ClassVar[bool] = False

    @property
    def config(self) -> dict:
        """The parameters (what ``Encoded.config`` records): the dataclass's init fields.

        Computed once per instance (the fields are frozen; calibrated tables are identified by a
        sha256 digest, which is not cheap) and returned as a fresh dict each time."""
        cached = self.__dict__.get("_config_cache")
        if cached is None:
            cached = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.init}
            object.__setattr__(self, "_config_cache", cached)  # not a field: eq, repr, replace ignore it
        return dict(cached)

    @abstractmethod
    def encode(self, x) -> Encoded:
        """Encode ``x`` of shape ``(..., d)``."""

    @abstractmethod
    def decode(self, enc: Encoded) -> np.ndarray:
        """Reconstruction, float32, of shape ``enc.shape``."""

    @abstractmethod
    def layout(self, shape: tuple) -> dict[str, tuple[tuple, np.dtype]]:
        """Expected ``{array name: (shape, dtype)}`` of the encoding of a tensor of ``shape``."""

    def __init_subclass__(cls, **kwargs):
        """Wrap each subclass's ``encode``/``decode``/``_rotated``/``scores``/``accumulate`` with the
        rules every method shares (so no method can forget them):

        * zero rows (``prod(shape[:-1]) == 0``): ``encode`` returns arrays of the layout's (empty)
          shapes, ``decode`` an empty float32 array, ``scores`` an (m, 0) and ``accumulate`` an
          (m, d) zero array, without calling the method;
        * ``decode`` refuses a reconstruction that overflows float32 instead of returning inf.
        """
        super().__init_subclass__(**kwargs)
        for meth in ("encode", "decode", "_rotated", "scores", "accumulate"):
            fn = cls.__dict__.get(meth)
            if fn is not None and not getattr(fn, "_shared_rules", False) \
                    and not getattr(fn, "__isabstractmethod__", False):
                setattr(cls, meth, _SHARED_RULES[meth](fn))

    def _make(self, shape: tuple, arrays: dict) -> Encoded:
        enc = Encoded(self.name, self.config, check_shape("shape", shape), arrays)
        self._check(enc)
        return enc

    def _check(self, enc: Encoded) -> None:
        """Refuse an Encoded from another method/config or with malformed arrays."""
        if not isinstance(enc, Encoded):
            raise TypeError(f"expected an Encoded, got {type(enc).__name__}")
        if enc.method != self.name:
            raise ValueError(f"Encoded was made by {enc.method!r}, not {self.name!r}")
        if enc.config != self.config:
            raise ValueError(f"Encoded was made with config {enc.config}, this {self.name} has {self.config}")
        if enc.shape[-1] != self.dim:
            raise ValueError(f"Encoded shape {enc.shape} does not end in this {self.name}'s dim={self.dim}: "
                             "corrupted buffer")
        want = self.layout(enc.shape)
        if set(enc.arrays) != set(want):
            raise ValueError(f"Encoded arrays {sorted(enc.arrays)} do not match {sorted(want)}: corrupted buffer")
        for key, (shape, dtype) in want.items():
            arr = enc.arrays[key]
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != tuple(shape):
                got = (getattr(arr, "shape", None), getattr(arr, "dtype", type(arr).__name__))
                raise ValueError(f"encoded array {key!r} should be {dtype} of shape {tuple(shape)}, "
                                 f"got {got[1]} of shape {got[0]}: corrupted buffer")
            if np.issubdtype(dtype, np.floating):
                check_fp_finite(key, arr)

    # --- attention hooks: how a query meets stored vectors --------------------------------------
    def prepare_query(self, q: np.ndarray) -> np.ndarray:
        """Transform queries once (e.g. rotate them into the codebook domain). Default: as is."""
        return q

    def scores(self, q_prepared: np.ndarray, enc: Encoded) -> np.ndarray:
        """``<q, x_hat>`` for prepared queries ``(m, d)`` against ``enc`` ``(n, d)``: shape (m, n)."""
        return q_prepared @ self.decode(enc).reshape(-1, enc.shape[-1]).astype(np.float64).T

    def accumulate(self, p: np.ndarray, enc: Encoded) -> np.ndarray:
        """``p @ x_hat`` for weights ``p`` ``(m, n)``: shape (m, d), in the original domain."""
        return p @ self.decode(enc).reshape(-1, enc.shape[-1]).astype(np.float64)

    def inner_product(self, q, enc: Encoded) -> np.ndarray:
        """Scores of queries ``q`` (``(d,)`` or ``(m, d)``) against every encoded vector.

        Returns
        -------
        ndarray, float64, shape ``q.shape[:-1] + enc.shape[:-1]``

        Raises
        ------
        ValueError
            A score beyond the float64 range.

        Notes
        -----
        Scores are linear in q: q is scaled by a power of two to ``max |q| < 1`` (exact) and the
        scores scaled back, so intermediate sums (a rotation of q, a sketch) cannot overflow where
        the scores themselves are finite (queries near 1e307 gave NaN before).
        """
        self._check(enc)
        d = enc.shape[-1]
        qa = as_array("q", q, dim=d)
        top = float(np.max(np.abs(qa))) if qa.size else 0.0
        e = math.frexp(top)[1] if top > 0 else 0
        s = self.scores(self.prepare_query(np.ldexp(qa.reshape(-1, d), -e)), enc)
        with np.errstate(over="ignore"):
            s = np.ldexp(s, e)
        if not np.all(np.isfinite(s)):
            raise ValueError(f"q: {int(np.sum(~np.isfinite(s)))} score(s) exceed the float64 range (max |q| {top:.3g})")
        return s.reshape(qa.shape[:-1] + tuple(enc.shape[:-1]))


class RotatedQuantizer(Quantizer):
    """A method that quantizes ``y = R x`` for a seeded rotation ``R`` (``self.rot``).

    Subclasses provide ``rot`` and ``_rotated(enc)``, the reconstruction in the rotated domain
    (after validating ``enc``). Then ``decode`` is ``R^T y_hat``, queries are rotated once
    (``<q, x_hat> = <R q, y_hat>``) and weighted sums of values are formed on ``y_hat`` with a
    single inverse rotation of the result.
    """

    @abstractmethod
    def _rotated(self, enc: Encoded) -> np.ndarray:
        """``y_hat``: float64, shape (N, d), N = number of encoded vectors."""

    def decode(self, enc: Encoded) -> np.ndarray:
        return self.rot.inverse(self._rotated(enc)).astype(np.float32).reshape(enc.shape)

    def prepare_query(self, q):
        return self.rot.apply(q)

    def scores(self, q_prepared, enc):
        return q_prepared @ self._rotated(enc).T

    def accumulate(self, p, enc):
        return self.rot.inverse(p @ self._rotated(enc))

