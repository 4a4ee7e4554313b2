"""Pure format code: names, the index, safetensors headers and engine-side state files."""

from deltastore.format.index import VersionIndex, check_shard_names
from deltastore.format.names import (
    INDEX_NAME,
    delta_shard_name,
    format_version,
    full_shard_name,
    parse_version_dir,
    version_dir_name,
)
from deltastore.format.payload import PayloadRef
from deltastore.format.safetensors_io import (
    SafetensorsHeader,
    TensorEntry,
    TensorLayout,
    parse_header,
    read_header,
    read_header_file,
    write_safetensors,
)
from deltastore.format.state import AppliedState, PendingTransition

__all__ = [
    "INDEX_NAME",
    "AppliedState",
    "PayloadRef",
    "PendingTransition",
    "SafetensorsHeader",
    "TensorEntry",
    "TensorLayout",
    "VersionIndex",
    "check_shard_names",
    "delta_shard_name",
    "format_version",
    "full_shard_name",
    "parse_header",
    "parse_version_dir",
    "read_header",
    "read_header_file",
    "version_dir_name",
    "write_safetensors",
]
