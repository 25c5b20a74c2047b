"""Single source of the package version and the table-file schema version."""

__version__ = "0.1.0"

#: Version of the table-file layout (manifest.json + safetensors + C header).
#: Bump it whenever a reader of older files would misinterpret newer ones.
TABLE_SCHEMA_VERSION = 1
