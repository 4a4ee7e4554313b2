"""Helpers for replication tests: a source run to copy, and checks that a replica equals it."""

from __future__ import annotations

from pathlib import Path

import deltastore as ds
from deltastore.format.names import INDEX_NAME
from deltastore.replicate.plan import same_content
from deltastore.storage import VersionStore
from tests.storage.models import assert_model, model_at


def publish_run(store: VersionStore, base: Path, kinds: dict[int, str]) -> None:
    """Publish ``model_at(step)`` for each step of ``kinds`` (``full`` or ``delta``)."""
    publisher = ds.DeltaPublisher(store, base, resume=bool(store.versions()))
    publisher.seed()
    for step, kind in kinds.items():
        assert publisher.publish(model_at(step).items(), full=kind == "full").version == step


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
