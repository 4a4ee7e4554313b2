"""Prune conformance: retention keeps chains whole, deletion is two-phase, stale claims are
fenced. Part of :class:`~deltastore.testing.store_tests.StoreConformance`."""

from __future__ import annotations

from typing import Any

import pytest

from deltastore.errors import (
    FormatError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.names import INDEX_NAME, delta_shard_name, full_shard_name
from deltastore.storage import VersionStore
from deltastore.testing.store_helpers import (
    ConformanceBase,
    shard_bytes,
    start_version,
    write_version,
)


class PruneConformance(ConformanceBase):
    """Prune behaviour every backend must show."""

    # ------------------------------------------------------------------ prune
    def _chain_is_contiguous(self, store: VersionStore, target: int) -> None:
        version = target
        while True:
            index = store.index(version)
            if not index.is_delta or not index.base_version:
                return
            assert index.base_version in store.versions(), f"v{version} lost its base"
            version = index.base_version

    def test_prune_keeps_chains_contiguous(self, store: VersionStore) -> None:
        # v1 Δ0, v2 Δ1, v3 full, v4 Δ3, v5 Δ4, v6 Δ5
        write_version(store, 1, base=0)
        write_version(store, 2, base=1)
        write_version(store, 3)
        for v in (4, 5, 6):
            write_version(store, v, base=v - 1)
        assert store.prune(keep=2, grace_s=3600, dry_run=True).unpublish == (1, 2)
        assert store.versions() == [1, 2, 3, 4, 5, 6]

        report = store.prune(keep=2, grace_s=0)
        assert report.keep == (3, 4, 5, 6)
        assert report.unpublish == (1, 2)
        assert store.versions() == [3, 4, 5, 6]
        for version in store.versions():
            self._chain_is_contiguous(store, version)
        assert store.list_files(1) == []

        write_version(store, 7)
        write_version(store, 8, base=7)
        report = store.prune(keep=2, grace_s=0)
        assert report.keep == (7, 8)
        assert store.versions() == [7, 8]
        self._chain_is_contiguous(store, 8)

    def test_prune_never_cuts_a_chain_from_the_base(self, store: VersionStore) -> None:
        for v in (1, 2, 3, 4):
            write_version(store, v, base=v - 1)
        report = store.prune(keep=1, grace_s=0)
        assert report.keep == (1, 2, 3, 4)
        assert report.unpublish == ()
        assert store.versions() == [1, 2, 3, 4]
        # It says why it kept more than asked, and what would let them go.
        assert report.chain_kept == (1, 2, 3)
        why = "\n".join(report.lines())
        assert "v000001, v000002, v000003" in why and "--full" in why

    def test_oversized_index_is_refused_by_size(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        tensors = {f"tensor-{i:04d}": b"x" for i in range(200)}
        write_version(self.make_store(store_url, storage_options), 1, tensors=tensors)
        reader = self.make_store(store_url, storage_options)
        reader.max_index_bytes = 1024  # the index of 200 tensors is larger
        with pytest.raises(FormatError, match=r"weight_v000001.*1024 byte limit"):
            reader.index(1)

    def test_only_canonical_version_names_are_versions(self, store: VersionStore) -> None:
        write_version(store, 1)
        # A 7-digit name beside the canonical one: listing and reading must agree.
        odd = f"{store.root}/weight_v0000002"
        store.fs.makedirs(odd, exist_ok=True)
        store.fs.pipe_file(f"{odd}/{INDEX_NAME}", store.index_bytes(1))
        assert store.versions() == [1]
        with pytest.raises(VersionNotFoundError):
            store.index(2)

    def test_prune_is_two_phase(self, store: VersionStore) -> None:
        write_version(store, 1, tensors={"w": b"old bytes"})
        write_version(store, 2)
        shard = full_shard_name(0, 1)
        entry = store.read_shard_header(1, shard).tensors["w"]

        report = store.prune(keep=1, grace_s=3600)
        assert report.unpublish == (1,)
        assert report.delete == ()
        assert store.versions() == [2]
        # Unpublished, not deleted: a host in the middle of a pull can finish reading.
        assert store.read_range(1, shard, entry.start, entry.end) == b"old bytes"
        assert store.prune(keep=1, grace_s=3600).waiting == (1,)

        report = store.prune(keep=1, grace_s=0)
        assert report.delete == (1,)
        with pytest.raises(VersionNotFoundError, match="re-resolve"):
            store.read_range(1, shard, entry.start, entry.end)
        assert store.versions() == [2]
        # The tombstone stays: an index landing late is never visible.
        assert set(store.listing().aborted) == {1}

    def test_prune_dry_run_changes_nothing(self, store: VersionStore) -> None:
        write_version(store, 1)
        write_version(store, 2)
        write_version(store, 3, commit=False)
        before = store.listing()
        report = store.prune(keep=1, grace_s=0, dry_run=True)
        assert report.dry_run and report.unpublish == (1,) and report.fence == (3,)
        after = store.listing()
        assert (after.indexes, after.claims.keys(), after.files.keys()) == (
            before.indexes,
            before.claims.keys(),
            before.files.keys(),
        )
        assert after.aborted == {}

    def test_prune_fences_a_stale_claim(
        self, store: VersionStore, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        write_version(store, 1)
        zombie = self.make_store(store_url, storage_options)
        writer, stale = start_version(zombie, 2, base=1)
        assert store.prune(keep=5, grace_s=3600).waiting == (2,)

        report = store.prune(keep=5, grace_s=0)
        assert report.fence == (2,) and report.delete == (2,)
        assert store.list_files(2) == []
        # The zombie wakes up, rewrites its shard and tries to commit: refused.
        writer.write_file(delta_shard_name(0, 1), shard_bytes({"w": b"late"}))
        with pytest.raises(VersionConflictError):
            writer.commit(stale)
        assert store.versions() == [1]
        assert store.prune(keep=5, grace_s=0).delete == (2,)
        assert store.list_files(2) == []
        with pytest.raises(VersionConflictError, match="fenced"):
            zombie.begin(2)
