"""The plan artifact: a per-(layer, role) quantizer choice and one 16-bit band, as a validated JSON file.

A plan (``Plan``) names, for every layer of a model, the candidate that stores its keys and the one
that stores its values, and the band (sink, recent window) kept in float16 for every layer. Its
file (``save_plan``/``load_plan``, schema ``"kvq-plan"`` version ``PLAN_VERSION``) holds:

``schema``, ``version``, ``name``, ``model``, ``band``, ``context``, ``target``
    What the plan is for: the model (name, layers, KV heads, head dimension), the band, the
    context length its quality and stored bits refer to, and the quality target (fractional
    perplexity increase, e.g. 0.01 for 1 %).
``layers``
    ``[{"key": candidate, "value": candidate}, ...]``, one per layer (``CANDIDATE`` names:
    ``tq_mse1`` .. ``tq_mse8`` or a registered uncalibrated method with no band of its own).
``tables``
    Every codebook the plan's quantizers read (``sphere_d64_b5``, ...): density, bits and the
    sha256 of its four arrays exactly as a table set's manifest records them
    (``codebooks.tables``), so ``gpu.plan`` can refuse a table folder that does not hold them.
``seeds``
    The rotation/sketch seed of every (layer, KV head) for keys and values, the rule of the
    registered methods (``1000 layer + 10 head + (role == value)``): what a kernel needs to
    rebuild each head's quantizer (``gpu.plan``).
``stored_bits``
    ``kvq_eval.accounting`` for the plan at ``context`` tokens: mean rate of keys, of values and
    of both, band pairs and pair-weighted bits per element (band and tables included).
``record``
    How the plan was found and what it measured (``kvq_eval.planner``): calibration and
    validation text and windows, the sensitivity table, the model's prediction, every validation
    round with its t interval, the chosen round, provenance. Free-form JSON, covered by the digest.
``digest``
    sha256 of the canonical JSON of everything else.

A file is written atomically (``codebooks._atomic.write_file``); loading refuses, with one
``ValueError`` naming the file, anything that is not such a plan: unreadable JSON, another schema or
version, a digest that does not match (a flipped byte), malformed fields, a candidate this toolkit
does not know, tables whose arrays differ from this toolkit's, stored bits that the accounting does
not reproduce, or (``model=``) a plan made for another model.

``register_plan`` makes a plan a method of the evaluation: ``plan:<name>`` in
``kvq_eval.methods.method_info``, run by ``kvq-eval run --plan PLAN.json`` as the entry
``plan:<name>@<band>`` (the plan's own band only).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from codebooks._atomic import read_file, write_file
from codebooks.artifacts import array_spec, canonical_json, sha256

from .methods import PLANS, MethodSpec, _half, _seed, _tq, method_info
from .models import canonical_model, model_info

__all__ = ["Plan", "PLAN_SCHEMA", "PLAN_VERSION", "CANDIDATE", "candidate_make", "check_candidate", "plan_spec",
           "layer_spec", "plan_tables", "stored_bits", "save_plan", "load_plan", "plan_from_json", "register_plan",
           "registered_plans", "plan_digest", "plan_json", "plan_seeds", "PLAN_PREFIX"]

PLAN_SCHEMA = "kvq-plan"
PLAN_VERSION = 1
PLAN_PREFIX = "plan:"
#: Candidate names: TurboQuantMSE at 1..8 bits (seeded per layer, head and role as the registered
#: ``tq_mse*`` methods), or a registered method (``kvq_eval.methods.METHODS``) checked by
#: ``check_candidate``.
CANDIDATE = re.compile(r"tq_mse[1-8]|[A-Za-z0-9_.\-]{1,40}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")
_MAX_BYTES = 1 << 24
_ROLES = ("key", "value")


@lru_cache(maxsize=None)
def candidate_make(name: str):
    """The ``make(layer, head, role, d, tables)`` of a candidate (one object per name, so that specs
    built from it compare equal and share quantizers)."""
    m = re.fullmatch(r"tq_mse([1-8])", name)
    if m:
        return _tq(int(m.group(1)))
    return method_info(name)["make"]


@lru_cache(maxsize=None)
def check_candidate(name, d: int) -> str:
    """``name`` if it can store one layer's keys or values in a plan, else ``ValueError``.

    A registered method qualifies when it needs no calibration tables, keeps no band of its own
    (the plan's band is global) and encodes tokens one at a time (token group 1: KIVI and QJL
    keys group tokens, and the band's token group is one number for the whole cache).
    """
    from .band import token_group

    if not isinstance(name, str) or not CANDIDATE.fullmatch(name):
        raise ValueError(f"candidate must be tq_mse1..tq_mse8 or a registered method name, got {name!r}")
    if not re.fullmatch(r"tq_mse[1-8]", name):
        info = method_info(name)  # (the name pattern has no ':': no half methods, no plans)
        if info.get("calibrated"):
            raise ValueError(f"candidate {name!r} needs calibration tables, which a plan does not carry")
        if info.get("sink", 0) or info.get("window", 0):
            raise ValueError(f"candidate {name!r} keeps a band of its own; a plan's band is global")
    make = candidate_make(name)
    for role in _ROLES:
        if token_group(make(0, 0, role, d, None)) != 1:
            raise ValueError(f"candidate {name!r} groups tokens (its {role}s); a plan mixes only per-token methods")
    return name


def layer_spec(candidate: str, layer: int, role: str, sink: int = 0, window: int = 0) -> MethodSpec:
    """The spec that stores only ``layer``'s ``role`` by ``candidate`` (the other role exactly): what a
    sensitivity measurement simulates in that layer (``kvq_eval.sensitivity``)."""
    if role not in _ROLES:
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")
    return MethodSpec(name=f"{candidate}:{role}s@L{layer}", make=_half(candidate_make(candidate), role),
                      sink=sink, window=window)


@dataclass(frozen=True)
class Plan:
    """A plan (module docstring).

    Attributes
    ----------
    name : str
        ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``; the evaluation's method is ``plan:<name>``.
    model : str
        A ``kvq_eval.models.MODELS`` name or a local model's path (made absolute:
        ``kvq_eval.models.canonical_model``); a plan for a local model is read where that path holds it.
    layers : tuple of (str, str)
        (key candidate, value candidate) per layer, one per model layer.
    sink, window : int
        The float16 band of every layer.
    context : int
        Tokens the quality and stored bits refer to.
    target : float
        Fractional perplexity increase the plan was searched for (0 < target <= 1).
    record : dict
        JSON-serializable account of the search (``kvq_eval.planner``).
    """

    name: str
    model: str
    layers: tuple
    sink: int = 0
    window: int = 0
    context: int = 8192
    target: float = 0.01
    record: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"name must match {_NAME.pattern}, got {self.name!r}")
        object.__setattr__(self, "model", canonical_model(self.model))  # ValueError for an unknown model
        info = model_info(self.model)
        layers = tuple(tuple(x) for x in self.layers) if isinstance(self.layers, (list, tuple)) else None
        if layers is None or len(layers) != info.layers or any(len(x) != 2 for x in layers):
            raise ValueError(f"layers must hold {info.layers} (key, value) candidate pairs for {self.model}")
        for pair in layers:
            for c in pair:
                check_candidate(c, info.head_dim)
        object.__setattr__(self, "layers", layers)
        for name in ("sink", "window", "context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (16 if name == "context" else 0):
                raise ValueError(f"{name} must be an integer >= {16 if name == 'context' else 0}, got {v!r}")
        t = self.target
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"target must be a fractional perplexity increase in (0, 1], got {t!r}")
        object.__setattr__(self, "target", float(t))
        if not isinstance(self.record, dict):
            raise ValueError(f"record must be a dict, got {type(self.record).__name__}")

    @property
    def method(self) -> str:
        """The evaluation's method name, ``plan:<name>``."""
        return PLAN_PREFIX + self.name

    @property
    def entry(self) -> str:
        """The evaluation's entry name, ``plan:<name>@<band>``."""
        from .band import Band

        return f"{self.method}@{Band(self.sink, self.window).label}"

    def bits(self, role: str) -> list[int | None]:
        """Per layer, the TurboQuantMSE bits of ``role`` (None where another method is chosen)."""
        i = _ROLES.index(role)
        return [int(p[i][6:]) if re.fullmatch(r"tq_mse[1-8]", p[i]) else None for p in self.layers]


def _make(layers):
    makes = {c: candidate_make(c) for pair in layers for c in pair}

    def make(layer, head, role, d, tables):
        return makes[layers[layer][_ROLES.index(role)]](layer, head, role, d, tables)

    return make


@lru_cache(maxsize=64)
def _plan_make(layers):
    return _make(layers)  # one object per layer table, so two specs of a plan compare equal


def plan_spec(plan: Plan) -> MethodSpec:
    """The plan as a ``MethodSpec``: its candidates per layer and role, its band."""
    rates = stored_bits(plan)
    return MethodSpec(name=plan.method, make=_plan_make(plan.layers), sink=plan.sink, window=plan.window,
                      nominal_bits=rates["rate"])


def _codebooks(q) -> list:
    from codebooks import Codebook

    inner = getattr(q, "inner", None)
    out = _codebooks(inner) if inner is not None else []
    table = getattr(type(q), "table", None)
    if table is not None:
        cb = q.table
        if isinstance(cb, Codebook):
            out.append(cb)
    return out


def plan_tables(layers, d: int) -> dict:
    """``{table name: {"density", "bits", "arrays": {array: sha256}}}`` of every codebook the
    candidates in ``layers`` read at head dimension ``d``, as a table set's manifest records them."""
    from codebooks.tables import _arrays  # the table set's own array naming and byte form

    out = {}
    for c in sorted({c for pair in layers for c in pair}):
        for cb in _codebooks(candidate_make(c)(0, 0, "key", d, None)) + _codebooks(candidate_make(c)(0, 0, "value", d, None)):
            out[cb.name] = {"density": {"kind": cb.density.kind, "params": cb.density.params()}, "bits": cb.bits,
                            "arrays": {k: array_spec(a)["sha256"] for k, a in _arrays(cb).items()}}
    return dict(sorted(out.items()))


def stored_bits(plan: Plan) -> dict:
    """Stored bits of the plan at ``plan.context`` tokens (``kvq_eval.accounting``): ``rate`` (mean
    middle bits per element), ``key_rate``, ``value_rate``, ``group``, ``table_bits``,
    ``bits_per_element`` (pair-weighted, band and tables included) and ``band_pairs``."""
    return _stored_bits(plan.model, plan.layers, plan.sink, plan.window, plan.context)


@lru_cache(maxsize=256)
def _stored_bits(model, layers, sink, window, context) -> dict:
    from .accounting import method_rate, pair_weighted_bits, spec_rates

    info = model_info(model)
    spec = MethodSpec(name="plan", make=_make(layers), sink=sink, window=window)
    r = spec_rates(spec, info.layers, info.kv_heads, info.head_dim)
    acc = pair_weighted_bits(context, sink, window, r["group"], r["rate"], r["table_bits"], info.layers,
                             info.kv_heads, info.head_dim)
    per_role = {role: float(np.mean([method_rate(candidate_make(pair[i])(layer, 0, role, info.head_dim, None),
                                                 info.head_dim) for layer, pair in enumerate(layers)]))
                for i, role in enumerate(_ROLES)}
    return {"tokens": context, "rate": r["rate"], "key_rate": per_role["key"], "value_rate": per_role["value"],
            "group": r["group"], "table_bits": r["table_bits"], "bits_per_element": acc["bits"],
            "band_pairs": acc["band_pairs"]}


def _body(plan: Plan) -> dict:
    info = model_info(plan.model)
    return {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, "name": plan.name,
            "model": {"name": plan.model, "layers": info.layers, "kv_heads": info.kv_heads, "head_dim": info.head_dim},
            "band": {"sink": plan.sink, "window": plan.window}, "context": plan.context, "target": plan.target,
            "layers": [{"key": k, "value": v} for k, v in plan.layers],
            "tables": plan_tables(plan.layers, info.head_dim), "seeds": plan_seeds(plan.model),
            "stored_bits": stored_bits(plan), "record": plan.record}


def plan_seeds(model: str) -> dict:
    """``{"key": [[seed per KV head] per layer], "value": ...}`` (module docstring)."""
    info = model_info(model)
    return {role: [[_seed(layer, h, role) for h in range(info.kv_heads)] for layer in range(info.layers)]
            for role in _ROLES}


def plan_json(plan: Plan) -> dict:
    """The file's JSON object (module docstring), digest included."""
    body = _body(plan)
    return {**body, "digest": sha256(canonical_json(body))}


def plan_digest(plan: Plan) -> str:
    """The digest its file records."""
    return plan_json(plan)["digest"]


def save_plan(plan: Plan, path) -> Path:
    """Write ``plan`` to ``path`` atomically (a synced temporary file, then a rename)."""
    return write_file(path, canonical_json(plan_json(plan)))


def _fail(where, problem):
    raise ValueError(f"{where}: not a valid kvq plan: {problem}")


def plan_from_json(obj, where: str = "plan", model: str | None = None) -> Plan:
    """A ``Plan`` from its file's JSON object, checked (module docstring); ``where`` names it in errors."""
    if not isinstance(obj, dict):
        _fail(where, f"a plan is a JSON object, got {type(obj).__name__}")
    if obj.get("schema") != PLAN_SCHEMA:
        _fail(where, f"schema must be {PLAN_SCHEMA!r}, got {obj.get('schema')!r}")
    if obj.get("version") != PLAN_VERSION:
        _fail(where, f"version {obj.get('version')!r}; this toolkit reads version {PLAN_VERSION}")
    body = {k: v for k, v in obj.items() if k != "digest"}
    try:
        digest = sha256(canonical_json(body))
    except (TypeError, ValueError) as exc:
        _fail(where, f"not canonical JSON ({exc})")
    if obj.get("digest") != digest:
        _fail(where, "its digest does not match its content (the file was changed or corrupted)")
    expected = {"schema", "version", "name", "model", "band", "context", "target", "layers", "tables", "seeds",
                "stored_bits", "record"}
    if set(body) != expected:
        _fail(where, f"fields must be {sorted(expected)}, got {sorted(body)}")
    try:
        m, band = body["model"], body["band"]
        plan = Plan(name=body["name"], model=m["name"], layers=tuple((x["key"], x["value"]) for x in body["layers"]),
                    sink=band["sink"], window=band["window"], context=body["context"], target=body["target"],
                    record=body["record"])
    except (KeyError, TypeError) as exc:
        _fail(where, f"a field is missing or of the wrong type ({exc!r})")
    except ValueError as exc:
        _fail(where, str(exc))
    info = model_info(plan.model)
    if (m.get("layers"), m.get("kv_heads"), m.get("head_dim")) != (info.layers, info.kv_heads, info.head_dim):
        _fail(where, f"its model geometry {m} is not {plan.model}'s ({info.layers} layers, {info.kv_heads} KV heads, "
                     f"head dimension {info.head_dim})")
    if model is not None and plan.model != canonical_model(model):
        raise ValueError(f"{where}: a plan for {plan.model}, not for {model}")
    want = plan_tables(plan.layers, info.head_dim)
    if body["tables"] != want:
        bad = sorted(k for k in set(want) | set(body["tables"]) if want.get(k) != body["tables"].get(k))
        _fail(where, f"its tables differ from this toolkit's ({', '.join(bad)})")
    if body["seeds"] != plan_seeds(plan.model):
        _fail(where, "its seeds are not the evaluation's per-(layer, head, role) seeds")
    bits = stored_bits(plan)
    if not isinstance(body["stored_bits"], dict) or set(body["stored_bits"]) != set(bits) or not all(
            math.isclose(body["stored_bits"][k], v, rel_tol=1e-12, abs_tol=0) for k, v in bits.items()):
        _fail(where, f"its stored bits {body['stored_bits']} are not what the accounting gives ({bits})")
    return plan


def load_plan(path, model: str | None = None) -> Plan:
    """Read and check a plan file (module docstring); ``model``: refuse a plan for another model."""
    raw = read_file(path, _MAX_BYTES)
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        _fail(path, f"unreadable JSON ({exc})")
    return plan_from_json(obj, str(path), model)


_REGISTERED: dict[str, tuple[Plan, str]] = {}


def register_plan(plan: Plan) -> str:
    """Make ``plan`` the evaluation's method ``plan:<name>`` in this process; returns that name.

    Registering another plan under a name already taken is refused (a name means one plan)."""
    digest = plan_digest(plan)
    have = _REGISTERED.get(plan.method)
    if have is not None and have[1] != digest:
        raise ValueError(f"another plan is already registered as {plan.method!r}; give the plans distinct names")
    _REGISTERED[plan.method] = (plan, digest)
    spec = plan_spec(plan)
    PLANS[plan.method] = dict(make=spec.make, sink=plan.sink, window=plan.window, nominal_bits=spec.nominal_bits)
    return plan.method


def registered_plans() -> dict[str, tuple[Plan, str]]:
    """``{method: (plan, digest)}`` of the plans registered in this process."""
    return dict(_REGISTERED)
