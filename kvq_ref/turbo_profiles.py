"""Versioned profiles of the turbo2/turbo3/turbo4 block formats: layout, signs, tables and rules as data.

Notes
-----
A profile pins down everything a ``TurboBlock`` needs to write a fork revision's bytes, so a new
revision of the llama.cpp TurboQuant fork is a new record in ``kvq_ref/data/turbo_profiles.json``
(or any file given to ``load_profiles``), not new code. One record (a JSON object)::

    name          unique name, e.g. "fork@69d8e4be"
    base          optional: the name of an earlier record of the same file; its fields are the
                  defaults of this one (top-level keys replaced as a whole)
    revision      the fork commit the record reproduces ("kvq-toolkit" for our own variant)
    date, source, description    provenance, free text
    layouts       {block: {fmt: [field, ...]}}: the byte layout of one block of ``block`` values
                  (a power of two) per format (turbo2/turbo3/turbo4 = 2/3/4-bit indices). Fields,
                  concatenated in order:
                    ["norm"]                 the scale, IEEE fp16 little-endian (2 B); exactly once
                    ["zero", n]              n bytes written as 0; a non-zero byte is refused
                    ["codes", shift, width]  bits shift .. shift+width-1 of every index, packed by
                                             kvq_ref.packing (value j at bits width*(j % (8/width))
                                             of byte j*width/8); width in {1, 2, 4, 8}; the codes
                                             fields cover the index bits 0 .. bits-1 exactly once
    signs         {"signs1": [+-1] * block, "signs2": [...]}: the rotation D(s2) (H/sqrt(block)) D(s1)
                  (one block size only), or "seeded": drawn from ``rng(seed, STREAM_MISC)``
    tables        {bits: {"levels": [decimal], "thresholds": [decimal]}}: 2^b increasing levels and
                  2^b - 1 interleaved thresholds, decimal strings rounded to float32 like C ``f``
                  literals; or "lloyd-max": the exact Lloyd-Max table of SphereMarginal(block)
                  (``codebooks``), rounded to float32 under float32 arithmetic
    arithmetic    "float32": the fork's rule (``TurboBlock`` Notes): IEEE float32 without FMA, sums
                  left to right; "float64": ``kvq_ref.turboquant.quantize_rotated`` (needs tie
                  "low", tiny_norm "0", no rotation_scale)
    tie           "high": index = first i with v < t_i (a value on a threshold takes the higher
                  cell); "low": index = #{t_i < v}
    tiny_norm     decimal: a norm (and the norm of the reconstruction) not above it counts as zero
    rotation_scale  decimal, float32 arithmetic only: the fork's float32 1/sqrt(block) constant
                  (within one float32 ulp of 1/sqrt(block))
    zero_unit     optional, float32 arithmetic only: formats whose unit vector is set to 0 when the
                  norm is not above tiny_norm (the fork's turbo4 memsets it); the others compute
                  ``x * 0``. The two differ only for NaN input (``TurboBlock(overflow="fork")``):
                  0 puts every index in the middle cell, NaN in the last

Every record is validated when loaded; bad data raises one ``ValueError`` naming the profile and
the field. ``TurboProfile.to_dict`` writes a record ``from_dict`` reads back to an equal profile.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path

import numpy as np

from .packing import pack_codes, unpack_codes

__all__ = ["TurboProfile", "BlockLayout", "FORMATS", "DEFAULT_PROFILE", "PROFILES_FILE", "get_profile",
           "load_profiles", "profile_names"]

#: bits per index of each format
FORMATS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}
#: the profile ``TurboBlock`` uses unless told otherwise: the fork's bytes at 69d8e4be
DEFAULT_PROFILE = "fork@69d8e4be"
PROFILES_FILE = Path(__file__).resolve().parent / "data" / "turbo_profiles.json"
_F16 = np.dtype("<f2")
_KEYS = {"name", "base", "revision", "date", "source", "description", "layouts", "signs", "tables",
         "arithmetic", "tie", "tiny_norm", "rotation_scale", "zero_unit"}


def parse_f32(text: str) -> np.float32:
    """A decimal string rounded once to the nearest float32 (ties to even), like a C ``f`` literal.

    ``np.float32(float(text))`` rounds twice (to float64, then float32) and can differ by one ulp.
    """
    exact = Fraction(text)
    with np.errstate(over="ignore"):
        f = np.float32(float(text))
    if not np.isfinite(f):  # past the float32 range (the caller refuses it)
        return f
    cands = [c for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))) if np.isfinite(c)]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.uint32)) & 1))


def _f32_text(v: float) -> str:
    """Shortest decimal that reads back (``parse_f32``) as the same float32."""
    return np.format_float_positional(np.float32(v), unique=True, trim="-")


@dataclass(frozen=True)
class BlockLayout:
    """The bytes of one block: fields in order (see the module Notes).

    Parameters
    ----------
    fmt : {"turbo2", "turbo3", "turbo4"}
    block : int
        Values per block (a power of two >= 8).
    fields : tuple of tuples
        ``("norm",)``, ``("zero", n)``, ``("codes", shift, width)``.
    """

    fmt: str
    block: int
    fields: tuple

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"layout format must be one of {sorted(FORMATS)}, got {self.fmt!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 8 \
                or self.block & (self.block - 1):
            raise ValueError(f"layout block must be a power of two >= 8, got {self.block!r}")
        fields = tuple(tuple(f) for f in self.fields)
        object.__setattr__(self, "fields", fields)
        where = f"{self.fmt} layout of {self.block} values"
        kinds = [f[0] if f else None for f in fields]
        if kinds.count("norm") != 1:
            raise ValueError(f"{where}: needs exactly one ['norm'] field, got {list(fields)}")
        covered: list[int] = []
        for f in fields:
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in f[1:])
            if f == ("norm",) or (len(f) == 2 and f[0] == "zero" and ints and f[1] >= 1):
                continue
            if len(f) == 3 and f[0] == "codes" and ints and f[2] in (1, 2, 4, 8) and f[1] >= 0:
                covered += range(f[1], f[1] + f[2])
                continue
            raise ValueError(f"{where}: bad field {list(f)} (use ['norm'], ['zero', n >= 1] or "
                             "['codes', shift >= 0, width in 1/2/4/8])")
        if sorted(covered) != list(range(self.bits)):
            raise ValueError(f"{where}: the codes fields must cover index bits 0..{self.bits - 1} exactly once, "
                             f"they cover {sorted(covered)}")

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt]

    def _size(self, f) -> int:
        if f[0] == "codes":
            return self.block * f[2] // 8
        return 2 if f[0] == "norm" else f[1]

    @property
    def nbytes(self) -> int:
        """Bytes per block (the sum of the field sizes)."""
        return sum(self._size(f) for f in self.fields)

    def _spans(self):
        off = 0
        for f in self.fields:
            yield f, off, off + self._size(f)
            off += self._size(f)

    def pack(self, indices: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Blocks (N, nbytes) uint8 from indices (N, block) in 0..2^bits-1 and float16 scales (N,)."""
        out = np.zeros((indices.shape[0], self.nbytes), dtype=np.uint8)
        for f, a, b in self._spans():
            if f[0] == "norm":
                out[:, a:b] = scales.astype(_F16).reshape(-1, 1).view(np.uint8)
            elif f[0] == "codes":
                out[:, a:b] = pack_codes((indices >> f[1]) & ((1 << f[2]) - 1), f[2])
        return out

    def unpack(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(indices (N, block) uint8, scales (N,) float16, zero fields all zero) of blocks (N, nbytes)."""
        idx = np.zeros((blocks.shape[0], self.block), dtype=np.uint8)
        scales, zeros_ok = None, True
        for f, a, b in self._spans():
            if f[0] == "norm":
                scales = np.ascontiguousarray(blocks[:, a:b]).view(_F16)[:, 0].astype(np.float16)
            elif f[0] == "zero":
                zeros_ok = zeros_ok and not np.any(blocks[:, a:b])
            else:
                idx |= unpack_codes(blocks[:, a:b], f[2], self.block) << f[1]
        return idx, scales, zeros_ok


@dataclass(frozen=True)
class TurboProfile:
    """One validated profile record (module Notes); build it with ``from_dict`` or ``get_profile``.

    Attributes
    ----------
    name, revision, date, source, description : str
    layouts : tuple of BlockLayout
    signs : (tuple of int, tuple of int) or None
        ``(signs1, signs2)``; None: seeded signs.
    tables : tuple of (bits, levels, thresholds) or None
        float32 values as Python floats, one entry per bit width used; None: Lloyd-Max tables.
    arithmetic : {"float32", "float64"}
    tie : {"high", "low"}
    tiny_norm : float
    rotation_scale : float or None
    zero_unit : tuple of str
    """

    name: str
    revision: str
    date: str
    source: str
    description: str
    layouts: tuple
    signs: tuple | None
    tables: tuple | None
    arithmetic: str
    tie: str
    tiny_norm: float
    rotation_scale: float | None
    zero_unit: tuple = ()

    def __post_init__(self):
        def bad(what):
            raise ValueError(f"turbo profile {self.name!r}: {what}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"turbo profile name must be a non-empty string, got {self.name!r}")
        for key in ("revision", "date", "source", "description"):
            if not isinstance(getattr(self, key), str):
                bad(f"{key} must be a string")
        if not self.layouts or not all(isinstance(lay, BlockLayout) for lay in self.layouts):
            bad("layouts must be a non-empty tuple of BlockLayout")
        if len({(lay.fmt, lay.block) for lay in self.layouts}) != len(self.layouts):
            bad("layouts name one (format, block) twice")
        if self.signs is not None:
            if len(self.blocks) != 1:
                bad(f"explicit signs fit one block size, the layouts have {self.blocks}")
            if len(self.signs) != 2 or any(len(s) != self.blocks[0] or set(s) - {1, -1} for s in self.signs):
                bad(f"signs1 and signs2 must be {self.blocks[0]} values of +1/-1 each")
        bits_used = sorted({lay.bits for lay in self.layouts})
        if self.tables is not None:
            if sorted(t[0] for t in self.tables) != bits_used:
                bad(f"tables must give bit widths {bits_used}, got {sorted(t[0] for t in self.tables)}")
            for bits, levels, thresholds in self.tables:
                _check_table(self.name, bits, levels, thresholds)
        if self.arithmetic not in ("float32", "float64"):
            bad(f"arithmetic must be 'float32' or 'float64', got {self.arithmetic!r}")
        if self.tie not in ("high", "low"):
            bad(f"tie must be 'high' or 'low', got {self.tie!r}")
        if not isinstance(self.tiny_norm, float) or not math.isfinite(self.tiny_norm) or self.tiny_norm < 0:
            bad(f"tiny_norm must be a finite float >= 0, got {self.tiny_norm!r}")
        if not isinstance(self.zero_unit, tuple) or set(self.zero_unit) - set(FORMATS):
            bad(f"zero_unit must list formats among {sorted(FORMATS)}, got {self.zero_unit!r}")
        if self.arithmetic == "float64":
            if self.tie != "low" or self.tiny_norm != 0.0 or self.rotation_scale is not None or self.zero_unit:
                bad("float64 arithmetic is quantize_rotated's rule: tie 'low', tiny_norm '0', no rotation_scale, "
                    "no zero_unit")
        else:
            if self.rotation_scale is None:
                bad("float32 arithmetic needs rotation_scale (the float32 1/sqrt(block))")
            for b in self.blocks:
                ulp = float(np.spacing(np.float32(1 / math.sqrt(b))))
                if abs(self.rotation_scale - 1 / math.sqrt(b)) > ulp:
                    bad(f"rotation_scale {self.rotation_scale!r} is not 1/sqrt({b}) to one float32 ulp")

    @property
    def blocks(self) -> tuple[int, ...]:
        """Block sizes the profile defines, increasing."""
        return tuple(sorted({lay.block for lay in self.layouts}))

    def layout(self, fmt: str, block: int) -> BlockLayout:
        """The layout of ``fmt`` at ``block`` values; ``ValueError`` when the profile has none."""
        for lay in self.layouts:
            if (lay.fmt, lay.block) == (fmt, block):
                return lay
        have = sorted((lay.fmt, lay.block) for lay in self.layouts)
        raise ValueError(f"turbo profile {self.name!r} has no {fmt!r} block of {block!r} values; it has {have}")

    def table(self, bits: int):
        """(levels, thresholds) as float32 arrays, or None for Lloyd-Max tables."""
        for b, levels, thresholds in self.tables or ():
            if b == bits:
                return np.array(levels, np.float32), np.array(thresholds, np.float32)
        return None

    def to_dict(self) -> dict:
        """The record as JSON-ready data (``from_dict(p.to_dict()) == p``)."""
        lay: dict = {}
        for la in self.layouts:
            lay.setdefault(str(la.block), {})[la.fmt] = [list(f) for f in la.fields]
        return {
            "name": self.name, "revision": self.revision, "date": self.date, "source": self.source,
            "description": self.description, "layouts": lay,
            "signs": "seeded" if self.signs is None else {"signs1": list(self.signs[0]), "signs2": list(self.signs[1])},
            "tables": "lloyd-max" if self.tables is None else {
                str(b): {"levels": [_f32_text(v) for v in lv], "thresholds": [_f32_text(v) for v in th]}
                for b, lv, th in self.tables},
            "arithmetic": self.arithmetic, "tie": self.tie, "tiny_norm": repr(self.tiny_norm),
            "rotation_scale": None if self.rotation_scale is None else repr(self.rotation_scale),
            "zero_unit": list(self.zero_unit),
        }

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of ``to_dict`` (how a config names an unregistered profile)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, record: dict, bases: dict | None = None) -> "TurboProfile":
        """Validate one JSON record (module Notes); ``bases`` maps names to earlier records' dicts."""
        if not isinstance(record, dict):
            raise ValueError(f"a turbo profile record must be a JSON object, got {type(record).__name__}")
        name = record.get("name")
        where = f"turbo profile {name!r}"
        if "base" in record:
            if record["base"] not in (bases or {}):
                raise ValueError(f"{where}: base {record['base']!r} is not an earlier record")
            record = {**bases[record["base"]], **{k: v for k, v in record.items() if k != "base"}}
        missing, unknown = _KEYS - {"base", "zero_unit"} - set(record), set(record) - _KEYS
        if missing or unknown:
            raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        return cls(name=name, revision=record["revision"], date=record["date"], source=record["source"],
                   description=record["description"], layouts=_layouts(where, record["layouts"]),
                   signs=_signs(where, record["signs"]), tables=_tables(where, record["tables"]),
                   arithmetic=record["arithmetic"], tie=record["tie"],
                   tiny_norm=float(_decimal(where, "tiny_norm", record["tiny_norm"], np.float64)),
                   rotation_scale=None if record["rotation_scale"] is None else
                   float(_decimal(where, "rotation_scale", record["rotation_scale"], np.float32)),
                   zero_unit=_zero_unit(where, record.get("zero_unit", [])))


def _zero_unit(where: str, data) -> tuple:
    if not isinstance(data, list) or not all(isinstance(f, str) for f in data):
        raise ValueError(f"{where}: zero_unit must be a list of format names")
    return tuple(data)


def _decimal(where: str, key: str, text, dtype):
    if not isinstance(text, str):
        raise ValueError(f"{where}: {key} must be a decimal string (read like a C literal), got {text!r}")
    try:
        value = parse_f32(text) if dtype == np.float32 else np.float64(Fraction(text))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{where}: {key} {text!r} is not a decimal number") from None
    if not np.isfinite(value):
        raise ValueError(f"{where}: {key} {text!r} is not finite in {np.dtype(dtype).name}")
    return value


def _layouts(where: str, data) -> tuple:
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: layouts must be a non-empty object {{block: {{format: [fields]}}}}")
    out = []
    for block, fmts in data.items():
        if not str(block).isdigit() or not isinstance(fmts, dict) or not fmts:
            raise ValueError(f"{where}: layouts[{block!r}] must map a block size to {{format: [fields]}}")
        for fmt, fields in fmts.items():
            if not isinstance(fields, list):
                raise ValueError(f"{where}: layouts[{block!r}][{fmt!r}] must be a list of fields")
            try:
                out.append(BlockLayout(fmt, int(block), tuple(tuple(f) if isinstance(f, list) else (f,)
                                                              for f in fields)))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
    return tuple(out)


def _signs(where: str, data):
    if data == "seeded":
        return None
    if not isinstance(data, dict) or set(data) != {"signs1", "signs2"}:
        raise ValueError(f"{where}: signs must be 'seeded' or {{'signs1': [...], 'signs2': [...]}}")
    for key in ("signs1", "signs2"):
        if not isinstance(data[key], list) or not all(v in (1, -1) and not isinstance(v, bool) for v in data[key]):
            raise ValueError(f"{where}: {key} must be a list of +1/-1")
    return tuple(data["signs1"]), tuple(data["signs2"])


def _tables(where: str, data):
    if data == "lloyd-max":
        return None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: tables must be 'lloyd-max' or {{bits: {{'levels': [...], 'thresholds': [...]}}}}")
    out = []
    for bits, tab in data.items():
        if not str(bits).isdigit() or not isinstance(tab, dict) or set(tab) != {"levels", "thresholds"} \
                or not all(isinstance(tab[k], list) for k in tab):
            raise ValueError(f"{where}: tables[{bits!r}] must be {{'levels': [...], 'thresholds': [...]}}")
        parse = [tuple(float(_decimal(where, f"tables[{bits!r}].{k}", v, np.float32)) for v in tab[k])
                 for k in ("levels", "thresholds")]
        out.append((int(bits), *parse))
    return tuple(sorted(out))


def _check_table(name: str, bits: int, levels: tuple, thresholds: tuple) -> None:
    k = 1 << bits
    lv, th = np.array(levels, np.float64), np.array(thresholds, np.float64)
    if lv.size != k or th.size != k - 1:
        raise ValueError(f"turbo profile {name!r}: the {bits}-bit table needs {k} levels and {k - 1} thresholds, "
                         f"got {lv.size} and {th.size}")
    if not (np.all(np.isfinite(lv)) and np.all(np.isfinite(th)) and np.all(lv[:-1] < th) and np.all(th < lv[1:])):
        raise ValueError(f"turbo profile {name!r}: the {bits}-bit table must have increasing levels with one "
                         "threshold strictly between each neighbouring pair")


def load_profiles(path=None) -> dict[str, TurboProfile]:
    """Every profile of a profiles file (default: the shipped ``PROFILES_FILE``), by name.

    Raises
    ------
    ValueError
        Unreadable JSON, a wrong schema, a duplicate name or an invalid record (the message names it).
    """
    path = Path(PROFILES_FILE if path is None else path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"turbo profiles file {path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("profiles"), list):
        raise ValueError(f"turbo profiles file {path}: expected {{'schema': 1, 'profiles': [...]}}")
    raw: dict[str, dict] = {}
    out: dict[str, TurboProfile] = {}
    for record in doc["profiles"]:
        prof = TurboProfile.from_dict(record, raw)
        if prof.name in out:
            raise ValueError(f"turbo profiles file {path}: profile {prof.name!r} is defined twice")
        raw[prof.name] = {k: v for k, v in ({**raw.get(record.get("base"), {}), **record}).items() if k != "base"}
        out[prof.name] = prof
    return out


@cache
def _shipped() -> dict[str, TurboProfile]:
    return load_profiles()


def profile_names() -> tuple[str, ...]:
    """Names of the shipped profiles, in file order."""
    return tuple(_shipped())


def get_profile(name: str) -> TurboProfile:
    """The shipped profile called ``name``; ``ValueError`` naming the known ones otherwise."""
    if not isinstance(name, str) or name not in _shipped():
        raise ValueError(f"profile must be one of {list(_shipped())} or a TurboProfile, got {name!r}")
    return _shipped()[name]
