"""Loading exported table sets onto a device, refusing mismatches before any kernel launch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from codebooks import TABLE_SCHEMA_VERSION, Codebook, SphereMarginal, load_tables
from codebooks._validate import check_int
from codebooks.build import SHIPPED_DIR

__all__ = ["DeviceTable", "load_device_table", "TableMismatchError"]


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
