"""The methods the evaluation compares, as factories of per-(layer, KV head) quantizers.

Each ``MethodSpec`` names a key and a value quantizer for every head (seeded per layer and head,
so rotations and sketches differ between heads as in a real deployment) and the 16-bit band the
method keeps: NOVA-KV and OSCAR keep the first 64 and last 256 tokens (:ref:`ref-nova-kv`),
KIVI and QJL their recent full-precision residual of 128 tokens (:ref:`ref-qjl`,
:ref:`ref-kivi`), the others none.

Names and settings. The names of the committed results keep the settings they were run with (our
variants, each a named option documented in its module): ``kivi2``/``kivi4`` = ``KIVI(rule="exact",
value_window="block", residual=32)`` on the tokens that leave a 128-token float16 window (the cache's
chunks of 32 tokens; KIVI's own value window is these 128 tokens, its keys keep only the newest
``T mod 128`` in float16, so the evaluation keeps up to 127 more keys in float16 than KIVI), ``quarot2``/``quarot4`` =
``QuaRot(rule="exact", rotation="randomized", clip_ratio=0.95)``, ``oscar`` = ``Oscar(clip_mode="quantile",
rule="uniform", rows="float64")``, ``nova`` = ``NovaKV`` with float16 key gains and VQ values
(``values="vq"``) on tables calibrated with ``grouping="swap"`` (``calib.py``). The ``*_official`` names are the modules' defaults, which reproduce the
official code (README "Fidelity"): ``quarot2_official``/``quarot4_official`` (plain Hadamard, INT kernel
rule, no clip), ``oscar_official``, ``nova_official`` (``NovaKV`` defaults: float32 key gains, values by
OSCAR's rotation + INT2, on tables calibrated with the release's ``grouping="round_robin"``, made on
first use beside the swap tables: ``calib.CalibrationTables.official_model``).

A name ``<method>:keys`` (or ``:values``) is the method applied to the keys only (values only), with
the other half stored exactly (float32) and the method's band kept: it tells which half of the
cache a failure comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ClassVar

import numpy as np

from kvq_ref.common import Encoded, Quantizer, as_array
from kvq_ref.kivi import KIVI
from kvq_ref.polarquant import PolarQuant
from kvq_ref.qjl import QJL
from kvq_ref.quarot import QuaRot
from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turboquant import TurboQuantMSE, TurboQuantProd, TurboQuantSplit

from .keyopts import study_methods

__all__ = ["MethodSpec", "Identity", "Blocked", "METHODS", "DEFAULT_METHODS", "PLANS", "make_spec", "method_info"]


@dataclass(frozen=True)
class Identity(Quantizer):
    """Stores float32 exactly: the lossless method that tests the evaluation pipeline."""

    dim: int
    name: ClassVar[str] = "identity"

    def layout(self, shape):
        return {"values": (tuple(shape), np.dtype(np.float32))}

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        return self._make(x.shape, {"values": x.astype(np.float32)})

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        return enc.arrays["values"].copy()


@dataclass(frozen=True)
class Blocked(Quantizer):
    """Applies a fixed-size block quantizer (e.g. a 32-value TurboBlock) to every block of a vector.

    Parameters
    ----------
    inner : Quantizer
        With ``inner.dim`` (or ``inner.block``) dividing ``dim``.
    dim : int
    """

    inner: Quantizer
    dim: int
    name: ClassVar[str] = "blocked"
    idempotent: ClassVar[bool] = False

    @property
    def b(self) -> int:
        return getattr(self.inner, "block", None) or self.inner.dim

    def __post_init__(self):
        if self.dim % self.b:
            raise ValueError(f"block size {self.b} must divide dim {self.dim}")

    @property
    def config(self):
        return {"inner": self.inner.name, **self.inner.config, "dim": self.dim}

    def _inner_shape(self, shape):
        return tuple(shape[:-1]) + (shape[-1] // self.b, self.b)

    def layout(self, shape):
        return self.inner.layout(self._inner_shape(shape))

    def encode(self, x) -> Encoded:
        x = as_array("x", x, dim=self.dim)
        inner = self.inner.encode(x.reshape(self._inner_shape(x.shape)))
        return self._make(x.shape, dict(inner.arrays))

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        inner = Encoded(self.inner.name, self.inner.config, self._inner_shape(enc.shape), enc.arrays)
        return self.inner.decode(inner).reshape(enc.shape)


@dataclass(frozen=True)
class MethodSpec:
    """A method of the evaluation: per-head key/value quantizers and its 16-bit band.

    Attributes
    ----------
    name : str
    make : callable (layer, head, role, d) -> Quantizer
    sink, window : int
        Tokens kept in float16 at the start and at the end.
    nominal_bits : float
        The method's advertised bits per element (stored rates are measured separately).
    calibrated : bool
        Needs NOVA-KV/OSCAR tables (``make`` then reads ``tables``).
    """

    name: str
    make: Callable
    sink: int = 0
    window: int = 0
    nominal_bits: float = 16.0
    calibrated: bool = False
    tables: object = None  # compared by identity: a spec per calibration

    def key(self, layer: int, head: int, d: int) -> Quantizer:
        return _instance(self, layer, head, "key", d)

    def value(self, layer: int, head: int, d: int) -> Quantizer:
        return _instance(self, layer, head, "value", d)


@lru_cache(maxsize=4096)
def _instance(spec: MethodSpec, layer: int, head: int, role: str, d: int) -> Quantizer:
    return spec.make(layer, head, role, d, spec.tables)


def _seed(layer: int, head: int, role: str) -> int:
    return 1000 * layer + 10 * head + (role == "value")


def _tq(bits):
    return lambda l, h, r, d, t: TurboQuantMSE(d, bits, seed=_seed(l, h, r))


def _prod(bits):
    return lambda l, h, r, d, t: (TurboQuantProd(d, bits, seed=_seed(l, h, r)) if r == "key"
                                  else TurboQuantMSE(d, bits, seed=_seed(l, h, r)))


def _split(rate):
    def make(layer, head, role, d, tables):
        # outlier channels by calibration magnitude: RMS of the calibration keys/values per channel
        rms = tables.channel_rms(layer, head, role)
        hi = int(np.ceil(rate))
        top = np.argsort(-rms, kind="stable")[: d // 4]
        return TurboQuantSplit(d, tuple(int(i) for i in top), hi, hi - 1, seed=_seed(layer, head, role))
    return make


def _turbo(fmt):
    # profile "kvq" (seeded per-head signs, exact tables; 32-value blocks for head_dim 64), the
    # setting the published turbo3/turbo4 results were measured with, not the fork's default bytes
    def make(layer, head, role, d, tables):
        block = 128 if d % 128 == 0 else 32
        inner = TurboBlock(fmt, block, seed=_seed(layer, head, role), profile="kvq")
        return inner if d == block else Blocked(inner, d)
    return make


def _nova(layer, head, role, d, tables):
    from kvq_ref.nova import NovaKV

    if role == "key":
        return NovaKV(tables.model.head(layer, head), role, gain_dtype="float16")
    return NovaKV(tables.model.head(layer, head), role, values="vq")


def _nova_official(layer, head, role, d, tables):
    from kvq_ref.nova import NovaKV

    # NovaKV's defaults (float32 key gains, values by OSCAR's rotation + INT2) on the release's
    # round_robin grouping
    return NovaKV(tables.official_model().head(layer, head), role)


def _oscar(layer, head, role, d, tables):
    from kvq_ref.nova import Oscar

    return Oscar(tables.model.head(layer, head), role, clip_mode="quantile", rule="uniform", rows="float64")


def _oscar_official(layer, head, role, d, tables):
    from kvq_ref.nova import Oscar

    return Oscar(tables.model.head(layer, head), role)


def _kivi(bits):
    # the evaluation's 128-token window holds KIVI's float16 tokens; its token chunks of 32 are quantized
    return lambda l, h, r, d, t: KIVI(d, bits, r, group=32, residual=32, rule="exact", value_window="block")


def _quarot(bits, official):
    if official:
        return lambda l, h, r, d, t: QuaRot(d, bits, group=min(128, d))
    return lambda l, h, r, d, t: QuaRot(d, bits, group=min(128, d), seed=_seed(l, h, r), clip_ratio=0.95,
                                        rotation="randomized", rule="exact")


METHODS: dict[str, dict] = {
    "identity": dict(make=lambda l, h, r, d, t: Identity(d), nominal_bits=32.0),
    "tq_mse2": dict(make=_tq(2), nominal_bits=2.0),
    "tq_mse3": dict(make=_tq(3), nominal_bits=3.0),
    "tq_mse4": dict(make=_tq(4), nominal_bits=4.0),
    "tq_prod3": dict(make=_prod(3), nominal_bits=3.0),
    "tq_prod4": dict(make=_prod(4), nominal_bits=4.0),
    "tq_split2.5": dict(make=_split(2.5), nominal_bits=2.5, calibrated=True),
    "tq_split3.5": dict(make=_split(3.5), nominal_bits=3.5, calibrated=True),
    "qjl": dict(make=lambda l, h, r, d, t: QJL(d, r, m=2 * d, m_outlier=d // 4, seed=_seed(l, h, r)),
                window=128, nominal_bits=3.0),
    "polarquant": dict(make=lambda l, h, r, d, t: PolarQuant(d, seed=_seed(l, h, r)), nominal_bits=3.875),
    "kivi2": dict(make=_kivi(2), window=128, nominal_bits=2.0),
    "kivi4": dict(make=_kivi(4), window=128, nominal_bits=4.0),
    "quarot2": dict(make=_quarot(2, False), nominal_bits=2.25),
    "quarot4": dict(make=_quarot(4, False), nominal_bits=4.25),
    "quarot2_official": dict(make=_quarot(2, True), nominal_bits=2.25),
    "quarot4_official": dict(make=_quarot(4, True), nominal_bits=4.25),
    "turbo3": dict(make=_turbo("turbo3"), nominal_bits=3.125),
    "turbo4": dict(make=_turbo("turbo4"), nominal_bits=4.25),
    "oscar": dict(make=_oscar, sink=64, window=256, nominal_bits=2.28, calibrated=True),
    "oscar_official": dict(make=_oscar_official, sink=64, window=256, nominal_bits=2.5, calibrated=True),
    "nova": dict(make=_nova, sink=64, window=256, nominal_bits=2.22, calibrated=True),
    "nova_official": dict(make=_nova_official, sink=64, window=256, nominal_bits=2.5, calibrated=True),
}

METHODS.update(study_methods(METHODS, _seed))  # key-error study: <base>-mc, tq_k4v2, ... (keyopts)

#: The issue's comparison set (the fp32 baseline is run as "fp32", without quantization).
DEFAULT_METHODS = ("tq_mse2", "tq_mse3", "tq_mse4", "tq_prod3", "tq_prod4", "tq_split2.5", "tq_split3.5",
                   "qjl", "polarquant", "kivi2", "kivi4", "quarot2", "quarot4", "turbo3", "turbo4", "oscar", "nova")


_HALVES = {"keys": "key", "values": "value"}

#: Per-layer plans registered as methods ``plan:<name>`` (``kvq_eval.planfile.register_plan``).
PLANS: dict[str, dict] = {}


def method_info(name: str) -> dict:
    """The registry entry of a method name, ``<method>:keys``/``:values`` and the registered plans'
    ``plan:<name>`` (``kvq_eval.planfile``) included (module docstring).

    Raises ``ValueError`` naming the known methods for anything else. The entry of a half method has
    no ``nominal_bits`` (half of the cache is stored exactly).
    """
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__}")
    if name in PLANS:
        return dict(PLANS[name])
    base, sep, half = name.partition(":")
    if base not in METHODS or (sep and half not in _HALVES):
        plans = (f"; plans: {', '.join(sorted(PLANS))}" if PLANS else
                 " (a plan is loaded by kvq-eval run --plan FILE)" if base == "plan" else "")
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(METHODS))}, "
                         f"each also as <method>:keys or <method>:values{plans}")
    kw = dict(METHODS[base])
    if half:
        role, make = _HALVES[half], kw["make"]
        kw["make"] = _half(make, role)
        kw.pop("nominal_bits", None)
    return kw


@lru_cache(maxsize=None)
def _half(make, role):
    # cached, so that two specs of the same half method compare (and share quantizers) equal
    return lambda l, h, r, d, t: make(l, h, r, d, t) if r == role else Identity(d)


def make_spec(name: str, tables=None) -> MethodSpec:
    """The ``MethodSpec`` of a registered method (``tables`` for calibrated ones)."""
    kw = method_info(name)
    if kw.get("calibrated") and tables is None:
        raise ValueError(f"method {name!r} needs calibration tables")
    return MethodSpec(name=name, tables=tables, **kw)
