"""Exact Lloyd-Max codebooks for KV-cache quantization, their table files and audits.

Data flow: density -> ``lloyd_max`` -> ``Codebook`` -> ``save_tables`` (manifest.json,
tables.safetensors, kvq_tables.h) -> quantizers and kernels. This package imports neither
``kvq_ref`` nor ``gpu``.
"""

from ._version import TABLE_SCHEMA_VERSION, __version__
from .audit import AuditReport, audit, cell_integrals, distortion
from .build import default_densities, shipped_tables
from .codebook import Codebook, ConvergenceError
from .densities import Density, Gaussian, PolarAngle, SphereMarginal
from .empirical import Empirical
from .grouping import Grouping, equal_volume_groups
from .solver import lloyd_max
from .artifacts import Artifacts, load_artifacts, save_artifacts
from .tables import TableFileError, TableSet, load_tables, save_tables
from .vq import VQCodebook, ecvq, gain_shape_split, kmeans, train_group_codebooks

__all__ = [
    "__version__", "TABLE_SCHEMA_VERSION",
    "Density", "SphereMarginal", "Gaussian", "PolarAngle", "Empirical",
    "Codebook", "ConvergenceError", "lloyd_max",
    "distortion", "cell_integrals", "audit", "AuditReport",
    "save_tables", "load_tables", "TableSet", "TableFileError", "save_artifacts", "load_artifacts", "Artifacts",
    "default_densities", "shipped_tables", "Grouping", "equal_volume_groups", "VQCodebook", "kmeans", "ecvq",
    "gain_shape_split", "train_group_codebooks",
]
