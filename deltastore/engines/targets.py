"""What ``LiveWeights`` writes into: the target's tensors by checkpoint name, as raw words.

The apply is byte-level, as the format is: a tensor is addressed as a flat run of unsigned
words of its checkpoint dtype's size (``int16`` words for bf16, ``uint8`` for bool or fp8), so
any dtype is handled the same way and a changed element is one word written.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from deltastore.errors import ConfigError
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.format.safetensors_io import DTYPE_SIZES

NameMap = Mapping[str, str] | Callable[[str], str]
"""Checkpoint name → target name: a dict (names not in it are kept) or a function."""

TORCH_WORDS: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
"""Word dtype of each element size (signed where torch has no unsigned one that indexes)."""
NUMPY_WORDS: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}
"""The torch dtype of each safetensors dtype string (what the ``loader=`` callback receives)."""


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat ``uint8`` view (shares memory; the tensor is contiguous)."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True)
class Target:
    """One checkpoint tensor's place in the live weights."""

    name: str
    """Checkpoint name."""
    target_name: str
    """Name in the target (after ``name_map``)."""
    tensor: torch.Tensor
    itemsize: int
    """Word size the patches address (the checkpoint dtype's size, 1 where the target's
    storage cannot be viewed in such words)."""

    @property
    def bytes(self) -> torch.Tensor:
        return flat_bytes(self.tensor)

    @property
    def words(self) -> torch.Tensor:
        flat = self.bytes
        return flat if self.itemsize == 1 else flat.view(TORCH_WORDS[self.itemsize])

    @property
    def device(self) -> torch.device:
        return self.tensor.device


def target_tensors(model: object) -> dict[str, torch.Tensor]:
    """Name → tensor of an ``nn.Module`` (``state_dict(keep_vars=True)``) or a mapping."""
    if isinstance(model, torch.nn.Module):
        return dict(model.state_dict(keep_vars=True))
    if isinstance(model, Mapping):
        found = dict(model)
        for name, value in found.items():
            if not isinstance(value, torch.Tensor):
                raise ConfigError(f"target {name!r} is a {type(value).__name__}, not a tensor")
        return found
    raise ConfigError(
        f"the live weights must be an nn.Module or a mapping of name to tensor, not a "
        f"{type(model).__name__}"
    )


def map_name(name_map: NameMap | None) -> Callable[[str], str]:
    if name_map is None:
        return lambda name: name
    if callable(name_map):
        return name_map
    mapping = dict(name_map)
    return lambda name: mapping.get(name, name)


def resolve_targets(
    tensors: Mapping[str, torch.Tensor],
    checkpoint: Mapping[str, CheckpointTensor],
    name_map: NameMap | None,
    where: str,
) -> dict[str, Target]:
    """Each checkpoint tensor's :class:`Target`; :class:`ConfigError` names a checkpoint
    tensor without one, or whose target differs in size or is not contiguous."""
    rename = map_name(name_map)
    targets = {}
    for name, entry in sorted(checkpoint.items()):
        target_name = rename(name)
        tensor = tensors.get(target_name)
        if tensor is None:
            raise ConfigError(
                f"checkpoint tensor {name!r} ({where}) has no target {target_name!r} in the "
                "live weights; pass name_map= to map checkpoint names to the model's, or "
                "loader= for an engine whose parameters are not the checkpoint's tensors"
            )
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != entry.entry.nbytes:
            raise ConfigError(
                f"checkpoint tensor {name!r} has {entry.entry.nbytes} bytes "
                f"({entry.entry.dtype}{list(entry.entry.shape)}), its target {target_name!r} "
                f"has {nbytes} ({tensor.dtype}{list(tensor.shape)}); the model is not the "
                "checkpoint's"
            )
        if not tensor.is_contiguous():
            raise ConfigError(
                f"target {target_name!r} of checkpoint tensor {name!r} is not contiguous; "
                "LiveWeights writes a tensor's storage in place"
            )
        targets[name] = Target(name, target_name, tensor, _word_size(tensor, entry))
    return targets


def _word_size(tensor: torch.Tensor, entry: CheckpointTensor) -> int:
    itemsize = DTYPE_SIZES[entry.entry.dtype]
    if itemsize == 1 or tensor.numel() == 0:
        return 1
    try:
        flat_bytes(tensor).view(TORCH_WORDS[itemsize])
    except RuntimeError:  # storage offset or size not a multiple of the word
        return 1
    return itemsize


def pinned_like(array: np.ndarray, pin: bool) -> torch.Tensor:
    """``array`` as a torch tensor: itself (shared), or a copy in pinned host memory."""
    tensor = torch.from_numpy(array)
    if not pin:
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor)
    return out


def can_pin(targets: Iterable[Target]) -> bool:
    """Whether patches should sit in pinned memory: some target is on CUDA and it can be had."""
    if not any(t.device.type == "cuda" for t in targets):
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


class CheckpointViews:
    """Zero-copy views of a local checkpoint's tensors (private copy-on-write maps, so the
    views are writable for torch and nothing written to them could reach the file)."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def array(self, tensor: CheckpointTensor) -> np.ndarray:
        """The tensor's bytes as a 1-D ``uint8`` array over the file's map."""
        mm = self._maps.get(tensor.file)
        if mm is None:
            with open(tensor.file, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            if mm is None:
                return np.empty(0, dtype=np.uint8)
            self._maps[tensor.file] = mm
        entry = tensor.entry
        return np.frombuffer(mm, dtype=np.uint8, count=entry.nbytes, offset=entry.start)

    def tensor(self, tensor: CheckpointTensor) -> torch.Tensor:
        """The tensor with its checkpoint dtype and shape, over the file's map."""
        raw = torch.from_numpy(self.array(tensor))
        dtype = TORCH_DTYPES[tensor.entry.dtype]
        typed = raw if dtype == torch.uint8 else raw.view(dtype)
        return typed.reshape(tensor.entry.shape)
