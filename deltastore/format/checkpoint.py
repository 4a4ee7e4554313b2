"""A Hugging Face safetensors checkpoint directory, read through its headers only."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deltastore.errors import ConfigError, FormatError
from deltastore.format.names import INDEX_NAME
from deltastore.format.safetensors_io import TensorEntry, read_header_file


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor of a checkpoint lives on disk."""

    file: str
    """Absolute path of the safetensors file."""
    entry: TensorEntry


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory, sorted by name: those its HF index
    maps when it has one (stray files are ignored), else every ``*.safetensors`` file."""
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint directory {directory!r} does not exist")
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index_path):
        with open(index_path, "rb") as fh:
            try:
                weight_map = json.load(fh).get("weight_map", {})
            except (ValueError, AttributeError) as exc:
                raise FormatError(f"{index_path} is not a valid index: {exc}") from None
        if not isinstance(weight_map, dict):
            raise FormatError(f"{index_path} is not a valid index: weight_map is not an object")
        names = list(weight_map.values())
    else:
        names = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    for name in names:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise FormatError(f"{index_path} maps to {name!r}, not a plain file name")
    if not names:
        raise ConfigError(f"checkpoint directory {directory!r} holds no *.safetensors files")
    return [os.path.join(directory, n) for n in sorted(set(names))]


def scan_checkpoint(directory: str) -> dict[str, CheckpointTensor]:
    """Tensor name → file and byte range for every tensor of a checkpoint directory;
    :class:`FormatError` when a name appears in two files."""
    tensors: dict[str, CheckpointTensor] = {}
    for path in checkpoint_files(directory):
        header = read_header_file(path)
        for name, entry in header.tensors.items():
            if name in tensors:
                raise FormatError(
                    f"tensor {name!r} appears in both {tensors[name].file} and {path}; the "
                    "checkpoint is ambiguous"
                )
            tensors[name] = CheckpointTensor(path, entry)
    return tensors


def read_file_range(path: str, offset: int, nbytes: int, *, what: str) -> npt.NDArray[np.uint8]:
    """``nbytes`` bytes of ``path`` from ``offset``, as a fresh writable 1-D uint8 array;
    :class:`FormatError` naming ``what`` when the file ends first."""
    data = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb") as fh:
        fh.seek(offset)
        if nbytes and fh.readinto(memoryview(data)) != nbytes:
            raise FormatError(f"{path} is truncated inside {what}")
    return data


def read_tensor(tensor: CheckpointTensor, name: str) -> npt.NDArray[np.uint8]:
    """One tensor's raw bytes from a local checkpoint file (a fresh writable array)."""
    return read_file_range(
        tensor.file, tensor.entry.start, tensor.entry.nbytes, what=f"tensor {name!r}"
    )
