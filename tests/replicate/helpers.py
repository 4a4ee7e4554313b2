"""Helpers for replication tests: a source run to copy, and checks that a replica equals it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import deltastore as ds
from deltastore.format.names import INDEX_NAME
from deltastore.replicate.version import same_content
from deltastore.storage import VersionStore
from tests import conftest
from tests.storage.models import assert_model, local_tensors, model_at


def publish_run(
    store: VersionStore,
    base: Path,
    kinds: dict[int, str],
    *,
    encoding: str = "xor",
    model: Callable[[int], dict[str, torch.Tensor]] = model_at,
) -> None:
    """Publish ``model(step)`` (default ``model_at``) as version ``step`` for each step of
    ``kinds`` (``full`` or ``delta``), resuming the run already in ``store`` if any."""
    full = [step for step, kind in kinds.items() if kind == "full"]
    models = (model(step) for step in kinds)
    resume = bool(store.versions())
    run = conftest.publish_run(store, base, models, full_at=full, resume=resume, encoding=encoding)
    assert list(run.models) == list(kinds)


def assert_replica(src: VersionStore, dst: VersionStore, versions: list[int]) -> None:
    """``dst`` lists exactly ``versions``, each with ``src``'s index content and file bytes."""
    dst.refresh()
    assert dst.versions() == versions
    for version in versions:
        ours, theirs = src.index(version), dst.index(version)
        assert same_content(ours, theirs), version
        assert theirs.commit_token and theirs.commit_token != ours.commit_token
        names = [n for n in src.list_files(version) if n != INDEX_NAME]
        assert sorted(n for n in dst.list_files(version) if n != INDEX_NAME) == sorted(names)
        for name in names:
            size = src.file_size(version, name)
            assert dst.file_size(version, name) == size
            assert dst.read_range(version, name, 0, size) == src.read_range(version, name, 0, size)


def assert_pulls(dst: VersionStore, base: Path, local: Path, versions: list[int]) -> None:
    """A host pulling each of ``versions`` from ``dst`` in turn ends verified at each step."""
    for version in versions:
        ds.pull_weights(local, dst, version, base_dir=base)
        assert_model(local, version)


def big_model_at(step: int, megabytes: int = 4) -> dict[str, torch.Tensor]:
    """A model of about ``megabytes`` MB (fp32 and bf16) after ``step`` steps: each step
    changes a few rows of two tensors, so deltas are small and full versions are not."""
    g = torch.Generator().manual_seed(7)
    rows = megabytes * 1024 * 1024 // (4 * 1024 * 4)
    tensors = {
        f"layers.{i}.weight": torch.randn(rows, 1024, generator=g).to(
            torch.float32 if i % 2 else torch.bfloat16
        )
        for i in range(6)
    }
    for s in range(1, step + 1):
        tensors[f"layers.{s % 6}.weight"][s % rows, :64] += 1.0
        tensors[f"layers.{(s + 3) % 6}.weight"][(3 * s) % rows, :32] -= 0.5
    return tensors


def publish_big_run(store: VersionStore, base: Path, kinds: dict[int, str]) -> None:
    """Publish ``big_model_at(step)`` for each step of ``kinds``; writes the base to ``base``."""
    conftest.make_checkpoint(base, big_model_at(0))
    publish_run(store, base, kinds, model=big_model_at)


def assert_big_model(directory: Path, step: int) -> None:
    got = local_tensors(directory)
    want = big_model_at(step)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, step)


def assert_pulls_big(dst: VersionStore, base: Path, local: Path, versions: list[int]) -> None:
    """As :func:`assert_pulls`, for ``big_model_at``."""
    for version in versions:
        ds.pull_weights(local, dst, version, base_dir=base)
        assert_big_model(local, version)
