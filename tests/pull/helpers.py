"""Helpers for the engine tests: models with many tensors, stores with many versions.

A "store" here is a real local :class:`VersionStore` filled by the real :class:`DeltaPublisher`
from an evolving model; ``states[v]`` keeps the model's bytes at each version so tests can
compare a pulled checkpoint with what the trainer had, independently of the published digests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from deltastore import DeltaPublisher, VersionStore
from deltastore.format.checkpoint import scan_checkpoint

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8)


def many_tensors(count: int, seed: int = 0, elements: int = 2048) -> dict[str, torch.Tensor]:
    """``count`` tensors of mixed dtypes, about ``elements`` elements each (sizes vary)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(count):
        dtype = _DTYPES[i % len(_DTYPES)]
        n = elements // 2 + int(torch.randint(0, elements, (1,), generator=g))
        base = torch.randn(n, generator=g)
        tensor = (base * 50).to(torch.int8) if dtype == torch.int8 else base.to(dtype)
        tensors[f"model.layers.{i // 8}.block{i % 8}.weight"] = tensor
    return tensors


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """An HF checkpoint: ``shards`` safetensors files and an index."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = {n: tensors[n].contiguous().clone() for n in names[s::shards]}
        save_file(group, str(directory / file_name))
        weight_map.update(dict.fromkeys(group, file_name))
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text('{"model_type": "toy"}')
    return directory


def evolve(
    tensors: dict[str, torch.Tensor], rng: np.random.Generator, fraction: float, density: float
) -> dict[str, torch.Tensor]:
    """A copy where ``fraction`` of the tensors have ``density`` of their bytes randomised."""
    out = dict(tensors)
    names = sorted(tensors)
    chosen = rng.choice(len(names), size=max(1, int(len(names) * fraction)), replace=False)
    for i in chosen:
        name = names[int(i)]
        raw = tensors[name].contiguous().view(torch.uint8).clone().numpy()
        k = max(1, int(raw.size * density))
        raw[rng.choice(raw.size, size=k, replace=False)] = rng.integers(0, 256, size=k)
        out[name] = torch.from_numpy(raw).view(tensors[name].dtype)
    return out


@dataclass
class Published:
    """A store filled with versions, and the model's bytes at each version."""

    store_dir: Path
    base_dir: Path
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    stream_id: str | None = None

    def store(self) -> VersionStore:
        return VersionStore(str(self.store_dir))


def publish_versions(
    store_dir: Path,
    base_dir: Path,
    base: dict[str, torch.Tensor],
    count: int,
    *,
    encoding: str = "xor",
    seed: int = 1,
    fraction: float = 0.3,
    density: float = 0.05,
    full_at: Iterable[int] = (),
    new_stream: bool = False,
    start: dict[str, torch.Tensor] | None = None,
) -> Published:
    """Publish ``count`` versions from ``start`` (default ``base``); ``full_at`` are full."""
    publisher = DeltaPublisher(
        str(store_dir), str(base_dir), encoding=encoding, workers=2, new_stream=new_stream
    )
    publisher.seed()
    rng = np.random.default_rng(seed)
    current = dict(start if start is not None else base)
    published = Published(store_dir, base_dir, stream_id=publisher.stream_id)
    if start is None:
        published.states[0] = dict(base)
    full = set(full_at)
    for _ in range(count):
        current = evolve(current, rng, fraction, density)
        result = publisher.publish(current.items(), full=publisher.next_version in full)
        published.states[result.version] = current
    return published


def local_bytes(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every tensor's raw bytes in a checkpoint dir, by name."""
    out = {}
    for name, tensor in scan_checkpoint(os.fspath(directory)).items():
        with open(tensor.file, "rb") as fh:
            fh.seek(tensor.entry.start)
            out[name] = fh.read(tensor.entry.nbytes)
    return out


def state_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def write_tensor(
    directory: str | os.PathLike[str], name: str, data: bytes, *, keep_mtime: bool = False
) -> None:
    """Overwrite one tensor's bytes in a local checkpoint (as a crash mid-apply would leave it).

    ``keep_mtime`` puts the file's mtime back afterwards: a change the state's file
    fingerprints (size, mtime) cannot see, as a disk fault would leave it.
    """
    tensor = scan_checkpoint(os.fspath(directory))[name]
    assert len(data) == tensor.entry.nbytes
    before = os.stat(tensor.file)
    with open(tensor.file, "r+b") as fh:
        fh.seek(tensor.entry.start)
        fh.write(data)
    if keep_mtime:
        os.utime(tensor.file, ns=(before.st_atime_ns, before.st_mtime_ns))


def changed_between(published: Published, after: int, upto: int) -> set[str]:
    """Names a delta in ``(after, upto]`` changed (compared by bytes, as the publisher does)."""
    names: set[str] = set()
    for version in range(after + 1, upto + 1):
        before = state_bytes(published.states[version - 1])
        now = state_bytes(published.states[version])
        names |= {n for n in now if now[n] != before[n]}
    return names
