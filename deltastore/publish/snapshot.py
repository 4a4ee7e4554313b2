"""The trainer's snapshot: the bytes of the last published state of every tensor."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltastore.codecs import ByteArray
from deltastore.errors import ConfigError, PublishError
from deltastore.format.checkpoint import checkpoint_files
from deltastore.format.safetensors_io import read_header_file


@dataclass
class SnapshotTensor:
    """One tensor's published state: dtype string, shape and raw bytes (1-D uint8)."""

    dtype: str
    shape: tuple[int, ...]
    data: ByteArray


class Snapshot:
    """Name → :class:`SnapshotTensor`, in the base checkpoint's order."""

    def __init__(self, tensors: dict[str, SnapshotTensor]) -> None:
        self.tensors = tensors

    @classmethod
    def from_checkpoint(cls, directory: str) -> Snapshot:
        """Read every tensor's bytes from a safetensors checkpoint directory (one read per file)."""
        tensors: dict[str, SnapshotTensor] = {}
        for path in checkpoint_files(directory):
            header = read_header_file(path)
            length = header.data_length or 0
            buffer = np.empty(length, dtype=np.uint8)
            with open(path, "rb") as fh:
                fh.seek(header.data_start)
                if fh.readinto(memoryview(buffer)) != length:
                    raise ConfigError(f"{path} is truncated")
            for name, entry in header.tensors.items():
                if name in tensors:
                    raise ConfigError(f"tensor {name!r} appears twice in checkpoint {directory}")
                lo, hi = entry.start - header.data_start, entry.end - header.data_start
                tensors[name] = SnapshotTensor(entry.dtype, entry.shape, buffer[lo:hi])
        return cls(tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> SnapshotTensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.data.size for t in self.tensors.values())


_TORCH_DTYPES: dict[str, str] = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
    "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip
_NUMPY_DTYPES: dict[str, str] = {
    "float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "uint8": "U8",
    "int16": "I16", "int32": "I32", "int64": "I64", "uint16": "U16", "uint32": "U32",
    "uint64": "U64", "bool": "BOOL",
}  # fmt: skip


def safetensors_dtype_of(tensor: Any) -> str | None:
    """The safetensors dtype string of a torch tensor or numpy array, if it has one."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return None
    if isinstance(tensor, np.ndarray):
        return _NUMPY_DTYPES.get(tensor.dtype.name)
    return _TORCH_DTYPES.get(str(dtype).removeprefix("torch."))


def tensor_bytes(name: str, tensor: Any) -> ByteArray:
    """The raw little-endian bytes of a CPU tensor/array as 1-D uint8 (contiguous first).

    Non-contiguous tensors (transposed, sliced) are made contiguous so the bytes are the
    tensor's logical row-major content, as safetensors stores it.
    """
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.reshape(-1).view(np.uint8)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(tensor, torch.Tensor):
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous().reshape(-1)
        # torch calls a 0- or 1-element view with stride != 1 contiguous and keeps its stride,
        # which .view(uint8) then rejects: copy it into a fresh stride-1 tensor.
        if t.stride(0) != 1:
            t = t.clone(memory_format=torch.contiguous_format)
        return t.view(torch.uint8).numpy()
    raise PublishError(
        f"tensor {name!r} is a {type(tensor).__name__}; pass a torch.Tensor or numpy.ndarray"
    )


def check_against_snapshot(name: str, tensor: Any, data: ByteArray, base: SnapshotTensor) -> None:
    """Refuse a tensor whose byte size, dtype or shape differs from the base's."""
    if data.size != base.data.size:
        raise PublishError(
            f"tensor {name!r} has {data.size} bytes, the base has {base.data.size} "
            f"({base.dtype}{list(base.shape)}); a delta needs equal sizes"
        )
    dtype = safetensors_dtype_of(tensor)
    # Raw uint8 byte arrays are accepted for any dtype: they are the dtype-blind path.
    if dtype is not None and dtype != "U8" and dtype != base.dtype:
        raise PublishError(
            f"tensor {name!r} is {dtype}, the base stores it as {base.dtype}; cast it first"
        )
    shape = tuple(getattr(tensor, "shape", ()))
    if dtype is not None and dtype != "U8" and shape != base.shape:
        raise PublishError(
            f"tensor {name!r} has shape {list(shape)}, the base has {list(base.shape)}"
        )
