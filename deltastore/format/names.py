"""Names of version directories, shards and engine-side state files (the reference layout)."""

from __future__ import annotations

import re

from deltastore.errors import FormatError

INDEX_NAME = "model.safetensors.index.json"
"""File whose presence publishes (commits) a version."""

STATE_DIR = ".weight_sync"  # engine-side folder inside a local checkpoint
STATE_NAME = "state.json"
LOCK_NAME = "lock"
PENDING_NAME = "pending.json"

_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")


def version_dir_name(version: int) -> str:
    """``weight_v000007`` for version 7."""
    if version < 1:
        raise FormatError(f"version {version} cannot be published: versions start at 1")
    return f"weight_v{version:06d}"


def parse_version_dir(name: str) -> int | None:
    """The version number of a ``weight_vNNNNNN`` directory name, or None for any other name."""
    match = _VERSION_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def format_version(version: int) -> str:
    """The 6-digit zero-padded string the reference index and state file use."""
    return f"{version:06d}"


def parse_version(value: object, *, what: str = "version") -> int:
    """Parse a reference version field (``"000007"``; ints are tolerated)."""
    if isinstance(value, bool):
        raise FormatError(f"{what} {value!r} is not a version number")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        # ASCII only: str.isdigit() also accepts e.g. "²", on which int() raises.
        number = int(value)
    else:
        raise FormatError(f"{what} {value!r} is not a version number (expected e.g. '000007')")
    if number < 0:
        raise FormatError(f"{what} {value!r} is negative")
    return number


def delta_shard_name(index: int, count: int) -> str:
    """Delta shard name: 0-based ``model-{i:05d}-of-{n:05d}.safetensors`` (reference pattern)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def full_shard_name(index: int, count: int) -> str:
    """Full-checkpoint shard name: ordinary 1-based Hugging Face ``model-00001-of-00003``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def check_shard_file_name(name: object, *, version: int | None = None) -> str:
    """Accept a weight_map target only if it is a plain ``*.safetensors`` file name: one with a
    separator, ``..`` or an absolute path could make a reader open a file outside the version
    directory, so it is refused rather than normalised."""
    where = f" in weight_v{version:06d}" if version is not None else ""
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or "\x00" in name
    ):
        raise FormatError(
            f"weight_map target {name!r}{where} is not a plain '*.safetensors' file name "
            "inside the version directory; refusing to read it"
        )
    return name
