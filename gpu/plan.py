"""A per-layer plan's tables for the kernels: which codebook and rotation each layer's keys and values read.

A plan file (written by ``kvq-plan``, schema ``"kvq-plan"``; ``kvq_eval.planfile`` documents it)
names a candidate per (layer, role), the sha256 of every table array it was measured with and the
seed of every (layer, KV head, role). ``plan_layers`` turns it into what the decode kernels take
(``gpu.triton.attention.decode_attention_mse``/``kernel_params``): per layer and role, one
``kvq_ref.TurboQuantMSE`` per KV head and the ``DeviceTable`` of its bits, loaded from a table set
(default: the shipped one). Nothing is computed here: the tables come from the table files, the
quantizers from ``kvq_ref``; a table set whose arrays differ from the plan's digests, a plan file
whose digest does not match its content, or a plan of another schema is refused before anything
reaches a device.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from codebooks import SphereMarginal, load_tables
from codebooks._atomic import read_file
from codebooks.artifacts import array_spec, canonical_json, sha256
from codebooks.build import SHIPPED_DIR
from codebooks.tables import _arrays
from kvq_ref.turboquant import TurboQuantMSE

from .tables import DeviceTable, TableMismatchError, load_device_table

__all__ = ["LayerTables", "plan_layers", "PLAN_SCHEMA", "PLAN_VERSION"]

#: The plan files this module reads (``kvq_eval.planfile`` writes them).
PLAN_SCHEMA, PLAN_VERSION = "kvq-plan", 1
_TQ = re.compile(r"tq_mse([1-8])")


@dataclass(frozen=True)
class LayerTables:
    """One layer of a plan, for the kernels.

    Attributes
    ----------
    layer : int
    key, value : tuple of (TurboQuantMSE, DeviceTable), one per KV head, or None
        None where the plan stores that role by a method that is not TurboQuantMSE (no codebook
        kernel here).
    key_candidate, value_candidate : str
        The plan's names (``tq_mse4``, ...).
    """

    layer: int
    key: tuple | None
    value: tuple | None
    key_candidate: str
    value_candidate: str


def _plan_object(plan) -> dict:
    if isinstance(plan, dict):
        obj, where = plan, "plan"
    else:
        where = str(plan)
        try:
            obj = json.loads(read_file(Path(plan), 1 << 24))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: not a valid kvq plan: unreadable JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("schema") != PLAN_SCHEMA or obj.get("version") != PLAN_VERSION:
        raise ValueError(f"{where}: not a kvq plan of schema {PLAN_SCHEMA!r} version {PLAN_VERSION}")
    body = {k: v for k, v in obj.items() if k != "digest"}
    if obj.get("digest") != sha256(canonical_json(body)):
        raise ValueError(f"{where}: not a valid kvq plan: its digest does not match its content")
    return obj


def plan_layers(plan, folder=None, device="cpu") -> list[LayerTables]:
    """Per layer, the quantizers and device tables a plan's kernels read (module docstring).

    Parameters
    ----------
    plan : path or dict
        A plan file (or its JSON object).
    folder : path, optional
        Table set (default: the one shipped in ``codebooks``).
    device : str or torch.device

    Raises
    ------
    ValueError
        The plan is not a valid plan file (schema, digest).
    TableMismatchError
        The table set lacks a table the plan needs, or holds one whose arrays differ from the plan's.
    """
    obj = _plan_object(plan)
    d = int(obj["model"]["head_dim"])
    tables = load_tables(Path(folder) if folder is not None else SHIPPED_DIR)
    for name, want in obj["tables"].items():
        if name not in tables:
            raise TableMismatchError(f"the plan needs table {name!r}, which {tables.folder} does not hold")
        have = {k: array_spec(a)["sha256"] for k, a in _arrays(tables[name]).items()}
        if have != want["arrays"]:
            raise TableMismatchError(f"table {name!r} in {tables.folder} differs from the one the plan was measured with")
    device_tables: dict[int, DeviceTable] = {}
    out = []
    for layer, pair in enumerate(obj["layers"]):
        per_role = {}
        for role in ("key", "value"):
            m = _TQ.fullmatch(pair[role])
            if m is None:
                per_role[role] = None
                continue
            bits = int(m.group(1))
            if f"{SphereMarginal(d).kind}_d{d}_b{bits}" not in obj["tables"]:
                raise ValueError(f"plan layer {layer}: {pair[role]} but no sphere_d{d}_b{bits} table is listed")
            if bits not in device_tables:
                device_tables[bits] = load_device_table(d, bits, folder, device)
            per_role[role] = tuple((TurboQuantMSE(d, bits, seed=int(seed)), device_tables[bits])
                                   for seed in obj["seeds"][role][layer])
        out.append(LayerTables(layer, per_role["key"], per_role["value"], pair["key"], pair["value"]))
    return out
