"""Race conformance: a writer paused at each commit step while a pruner or a second resumed
writer runs. Part of :class:`~deltastore.testing.store_tests.StoreConformance`."""

from __future__ import annotations

from typing import Any

import pytest

from deltastore.errors import (
    StoreError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME
from deltastore.storage.writer import VersionWriter
from deltastore.testing.store_helpers import (
    WRITER_STEPS,
    ConformanceBase,
    WriterKilled,
    committed_w,
    fill_version,
    start_version,
    write_version,
)


class RaceConformance(ConformanceBase):
    """The writer-against-pruner and resumed-writer races every backend must survive."""

    # ------------------------------------------------------------------ races
    # Each race pauses a writer before one protocol step (VersionWriter.step_hook) while the
    # other party runs to completion, for every step in turn.

    @pytest.mark.parametrize("step", WRITER_STEPS)
    def test_pruner_against_a_stalled_writer(
        self, store_url: str, storage_options: dict[str, Any], step: str
    ) -> None:
        """A pruner fences and deletes a stalled writer's version: the version ends either
        committed and complete, or invisible to every reader, never listed without shards."""
        write_version(self.make_store(store_url, storage_options), 1)
        writer, index = start_version(self.make_store(store_url, storage_options), 2, base=1)
        pruner = self.make_store(store_url, storage_options)
        writer.step_hook = lambda name: pruner.prune(keep=5, grace_s=0) if name == step else None
        try:
            writer.commit(index)
            committed = True
        except VersionConflictError:
            committed = False
        # Only once the index has landed does the pruner see it and back off.
        assert committed == (step == "recheck")
        pruner.prune(keep=5, grace_s=0)
        self._check_complete_or_invisible(store_url, storage_options, 2, committed)

    @pytest.mark.parametrize("failure", ["dies", "recheck-fails"])
    def test_late_index_of_a_fenced_version_stays_invisible(
        self, store_url: str, storage_options: dict[str, Any], failure: str
    ) -> None:
        """The pruner fences and deletes while the writer is about to write its index; the
        index lands, then the writer dies, or its re-check fails: no reader ever sees it."""
        write_version(self.make_store(store_url, storage_options), 1)
        writer, index = start_version(self.make_store(store_url, storage_options), 2, base=1)
        pruner = self.make_store(store_url, storage_options)

        def hook(name: str) -> None:
            if name == "index":
                assert pruner.prune(keep=5, grace_s=0).delete == (2,)
            elif name == "recheck" and failure == "dies":
                raise WriterKilled
            elif name == "recheck":

                def unreachable(version: int) -> bool:
                    raise TransientStoreError("store unreachable (injected)")

                writer.objects.is_fenced = unreachable  # type: ignore[method-assign]

        writer.step_hook = hook
        with pytest.raises((WriterKilled, StoreError)):
            writer.commit(index)
        assert INDEX_NAME in pruner.list_files(2), "the late index should have landed"
        for _ in range(2):  # and a later prune run does not resurrect it
            self._check_complete_or_invisible(store_url, storage_options, 2, False)
            pruner.prune(keep=5, grace_s=0)

    def _check_complete_or_invisible(
        self, url: str, options: dict[str, Any], version: int, committed: bool
    ) -> None:
        reader = self.make_store(url, options)
        if not committed:
            assert version not in reader.versions()
            with pytest.raises(VersionNotFoundError):
                reader.index(version)
            return
        assert version in reader.versions()
        token = reader.index(version).commit_token
        assert committed_w(reader, version) == f"v{version}-{token}".encode()

    @pytest.mark.parametrize("step", WRITER_STEPS)
    def test_two_resumed_writers_never_fork(
        self, store_url: str, storage_options: dict[str, Any], step: str
    ) -> None:
        """Two publishers resumed on one store both build on v1: the second skips the first's
        live claim (v2) and takes v3, yet only one of them commits a successor of v1."""
        write_version(self.make_store(store_url, storage_options), 1)
        first = self.make_store(store_url, storage_options).begin(after=1)
        second = self.make_store(store_url, storage_options).begin(after=1)
        assert (first.version, second.version) == (2, 3)
        first_index = fill_version(first, base=1)
        second_index = fill_version(second, base=1)
        outcomes: dict[int, str] = {}

        def commit(writer: VersionWriter, index: VersionIndex) -> None:
            try:
                writer.commit(index)
                outcomes[writer.version] = "committed"
            except VersionConflictError as exc:
                assert "weight_v000001" in str(exc) and "resume" in str(exc)
                outcomes[writer.version] = "conflict"

        second.step_hook = lambda name: commit(first, first_index) if name == step else None
        commit(second, second_index)
        assert sorted(outcomes.values()) == ["committed", "conflict"], outcomes
        winner = next(v for v, outcome in outcomes.items() if outcome == "committed")
        # The second writer already holds v1's successor once it is past that step.
        assert winner == (3 if step in ("index", "recheck") else 2)
        reader = self.make_store(store_url, storage_options)
        assert reader.versions() == [1, winner]
        self._check_complete_or_invisible(store_url, storage_options, winner, True)

    def test_resume_continues_past_a_dead_writers_claim(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        write_version(self.make_store(store_url, storage_options), 1)
        start_version(self.make_store(store_url, storage_options), 2, base=1)  # then kill -9
        resumed = self.make_store(store_url, storage_options).begin(after=1)
        assert resumed.version == 3
        resumed.commit(fill_version(resumed, base=1))
        assert self.make_store(store_url, storage_options).versions() == [1, 3]

    def test_an_aborted_writer_frees_its_successor(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        write_version(self.make_store(store_url, storage_options), 1)
        failing, index = start_version(self.make_store(store_url, storage_options), 2, base=1)

        def fail(name: str) -> None:
            if name == "index":
                raise OSError("index write failed (injected)")

        failing.step_hook = fail
        with pytest.raises(OSError, match="injected"), failing:
            failing.commit(index)  # took v1's successor, then failed: aborted on exit
        retry = self.make_store(store_url, storage_options).begin(after=1)
        assert retry.version == 2  # the aborted claim was removed: the number is reused
        retry.commit(fill_version(retry, base=1))
        assert self.make_store(store_url, storage_options).versions() == [1, 2]

    def test_begin_next_refuses_to_pass_a_committed_version(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        store = self.make_store(store_url, storage_options)
        write_version(store, 1)
        write_version(store, 2, base=1)
        with pytest.raises(VersionConflictError, match=r"weight_v000002.*resume"):
            store.begin(after=1)
