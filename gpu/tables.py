"""Loading exported table sets onto a device, refusing mismatches before any kernel launch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from codebooks import TABLE_SCHEMA_VERSION, Codebook, SphereMarginal, load_tables
from codebooks._validate import check_int
from codebooks.build import SHIPPED_DIR

__all__ = ["DeviceTable", "load_device_table", "check_device_table", "TableMismatchError"]


class TableMismatchError(ValueError):
    """The table set does not hold what a kernel was asked to run (method, dimension, bits, schema)."""


@dataclass(frozen=True)
class DeviceTable:
    """One codebook as device tensors.

    Attributes
    ----------
    codebook : codebooks.Codebook
        The validated table (float64 on the host).
    levels, thresholds : torch.Tensor, float64
        Exact values, for quantize kernels that must reproduce kvq_ref's codes bit for bit.
    levels32, thresholds32 : torch.Tensor, float32
        The header's float32 values, for dequantize and attention kernels.
    """

    codebook: Codebook
    levels: object
    thresholds: object
    levels32: object
    thresholds32: object

    @property
    def bits(self) -> int:
        return self.codebook.bits

    @property
    def dim(self) -> int:
        return self.codebook.density.d


def check_device_table(table, dim: int, bits: int) -> DeviceTable:
    """Refuse, before any launch, a table the kernels cannot index safely or that is not the exact
    SphereMarginal(dim) table at ``bits`` (a hand-built ``DeviceTable`` is trusted in nothing).

    The four tensors must be 1-D, contiguous, on one device, of dtypes float64/float64/float32/
    float32 and sizes 2^bits / 2^bits - 1, and hold exactly the codebook's levels and thresholds
    (float32: their rounding). Costs one small device-to-host copy per tensor (<= 4096 values).

    Raises
    ------
    TypeError
        Not a DeviceTable, or a field of the wrong type or dtype.
    TableMismatchError
        Another table, another size, device or values.
    """
    import torch

    if not isinstance(table, DeviceTable):
        raise TypeError(f"table must be a gpu.tables.DeviceTable, got {type(table).__name__}")
    cb = table.codebook
    if not isinstance(cb, Codebook) or not isinstance(cb.density, SphereMarginal):
        raise TableMismatchError(f"table.codebook must be a SphereMarginal Codebook, got {type(cb).__name__}")
    if cb.density.d != dim or cb.bits != bits:
        raise TableMismatchError(f"table is SphereMarginal({cb.density.d}) at {cb.bits} bits, the kernel needs "
                                 f"SphereMarginal({dim}) at {bits} bits")
    k = 1 << bits
    want = {"levels": (torch.float64, cb.levels), "thresholds": (torch.float64, cb.thresholds),
            "levels32": (torch.float32, cb.levels.astype(np.float32)),
            "thresholds32": (torch.float32, cb.thresholds.astype(np.float32))}
    device = getattr(table.levels, "device", None)
    for name, (dtype, values) in want.items():
        t = getattr(table, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"table.{name} must be a {dtype} torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        size = k if name.startswith("levels") else k - 1
        if t.ndim != 1 or t.shape[0] != size or not t.is_contiguous() or t.device != device:
            raise TableMismatchError(f"table.{name} must be a contiguous 1-D tensor of {size} values on {device}, "
                                     f"got shape {tuple(t.shape)} on {t.device}")
        if not np.array_equal(t.detach().cpu().numpy(), values):
            raise TableMismatchError(f"table.{name} does not hold the values of {cb.name} (edited or hand-built)")
    return table


def load_device_table(dim: int, bits: int, folder=None, device="cpu", schema: int = TABLE_SCHEMA_VERSION) -> DeviceTable:
    """The SphereMarginal(dim) table at ``bits`` from a table folder, as tensors on ``device``.

    Parameters
    ----------
    dim, bits : int
        What the kernel will run (TurboQuantMSE or a turbo block format of ``dim`` values).
    folder : path, optional
        Table set written by ``kvq-codebooks build`` (default: the set shipped in ``codebooks``).
    device : str or torch.device
    schema : int
        Schema version the kernels were written for.

    Raises
    ------
    TableFileError
        The folder is corrupted or of another schema version (``codebooks.load_tables``).
    TableMismatchError
        The set holds no table for (dim, bits), or one whose arrays disagree with the request.
    """
    import torch

    dim, bits = check_int("dim", dim, lo=2), check_int("bits", bits, 1, 12)  # bits=True is not 1 bit
    if schema != TABLE_SCHEMA_VERSION:
        raise TableMismatchError(f"kernels expect table schema {schema}, this toolkit writes {TABLE_SCHEMA_VERSION}")
    tables = load_tables(Path(folder) if folder is not None else SHIPPED_DIR)
    if tables.schema_version != schema:
        raise TableMismatchError(f"table set has schema {tables.schema_version}, kernels expect {schema}")
    try:
        cb = tables.find(SphereMarginal(dim), bits)
    except KeyError as exc:
        raise TableMismatchError(str(exc).strip("'\"")) from None
    if cb.levels.size != 2**bits:
        raise TableMismatchError(f"table {cb.name} has {cb.levels.size} levels, {bits} bits need {2**bits}")
    def tensor(a, dtype):
        return torch.tensor(np.array(a), dtype=dtype, device=device)  # a copy: table arrays are read-only

    return DeviceTable(cb, tensor(cb.levels, torch.float64), tensor(cb.thresholds, torch.float64),
                       tensor(cb.levels.astype(np.float32), torch.float32),
                       tensor(cb.thresholds.astype(np.float32), torch.float32))
