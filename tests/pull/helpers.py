"""Helpers for the engine tests: models with many tensors, stores with many versions.

A "store" here is a real local :class:`VersionStore` filled by the real :class:`DeltaPublisher`
from an evolving model; ``states[v]`` keeps the model's bytes at each version so tests can
compare a pulled checkpoint with what the trainer had, independently of the published digests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deltastore import VersionStore
from deltastore.format.checkpoint import scan_checkpoint
from tests.conftest import make_checkpoint, publish_run

INDEX_NAME = "model.safetensors.index.json"
_CONFIG = '{"model_type": "toy"}'
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
    """An HF checkpoint: ``shards`` safetensors files, an index and a ``config.json``."""
    return make_checkpoint(directory, tensors, shards, extra_files={"config.json": _CONFIG})


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
    rng = np.random.default_rng(seed)

    def models() -> Iterator[dict[str, torch.Tensor]]:
        current = dict(start if start is not None else base)
        for _ in range(count):
            current = evolve(current, rng, fraction, density)
            yield current

    run = publish_run(
        store_dir,
        base_dir,
        models(),
        full_at=set(full_at),
        encoding=encoding,
        workers=2,
        new_stream=new_stream,
    )
    published = Published(store_dir, base_dir, stream_id=run.publisher.stream_id)
    if start is None:
        published.states[0] = dict(base)
    published.states.update(run.models)
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
