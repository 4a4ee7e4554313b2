"""``StoreConformance``: the tests every :class:`~deltastore.VersionStore` backend must pass.

Subclass it once per backend and override the fixtures that describe the backend::

    class TestMyBackend(StoreConformance):
        @pytest.fixture
        def store_url(self) -> str:          # a fresh, empty root for each test
            return f"s3://bucket/{uuid.uuid4().hex}"

        @pytest.fixture
        def storage_options(self) -> dict:   # passed to fsspec unchanged
            return {...}

Backends reached over HTTP also override :meth:`StoreConformance.faulty` (a store whose
requests pass through a :class:`~deltastore.testing.faults.FaultProxy`) and
:meth:`StoreConformance.index_write_fault`, which unlocks the tests of retries, lost
acknowledgements, permanent errors and fencing mid-commit. ``supports_processes = False``
skips the multi-process tests (``memory://`` lives inside one process).

The tests use only the public store API plus the on-disk layout (``_claims/``, tombstones),
and :class:`VersionWriter`'s ``step_hook`` to pause a writer between protocol steps.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from deltastore.errors import (
    FormatError,
    StoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.names import INDEX_NAME, full_shard_name
from deltastore.storage import VersionStore, new_token, store_objects
from deltastore.storage.writer import VersionWriter
from deltastore.testing.faults import Fault, FaultProxy
from deltastore.testing.store_helpers import (
    FAST_RETRY,
    committed_w,
    fill_version,
    race_worker,
    shard_bytes,
    start_version,
    write_version,
)
from deltastore.testing.store_prune_tests import PruneConformance
from deltastore.testing.store_race_tests import RaceConformance

__all__ = [
    "FAST_RETRY",
    "StoreConformance",
    "fill_version",
    "shard_bytes",
    "start_version",
    "write_version",
]


class StoreConformance(PruneConformance, RaceConformance):
    """The behaviour every store backend must show; see the module docstring. Prune and race
    tests live in :mod:`~deltastore.testing.store_prune_tests` and
    :mod:`~deltastore.testing.store_race_tests`; the backend fixtures in
    :class:`~deltastore.testing.store_helpers.ConformanceBase`."""

    # ------------------------------------------------------ commit visibility
    def test_empty_store_has_no_versions(self, store: VersionStore) -> None:
        assert store.versions() == []
        assert store.latest() == 0
        with pytest.raises(VersionNotFoundError):
            store.index(1)

    def test_commit_makes_a_version_visible(self, store: VersionStore) -> None:
        writer, index = start_version(store, 1)
        assert store.versions() == []
        assert writer.commit(index) == index
        assert store.versions() == [1]
        assert store.latest() == 1
        assert store.index(1) == index
        assert INDEX_NAME in store.list_files(1)

    def test_uncommitted_shards_are_invisible(
        self, store: VersionStore, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        write_version(store, 1)
        write_version(store, 2, base=1, commit=False)
        # Shards in a version directory nobody claimed, as a crashed foreign writer leaves.
        raw = self.make_store(store_url, storage_options)
        store_objects(raw).write_file(3, full_shard_name(0, 1), shard_bytes({"w": b"x"}))
        reader = self.make_store(store_url, storage_options)
        assert reader.versions() == [1]
        assert reader.latest() == 1
        with pytest.raises(VersionNotFoundError):
            reader.index(2)

    def test_commit_again_by_its_writer_is_not_a_conflict(self, store: VersionStore) -> None:
        # What a writer whose acknowledgement was lost does: the index exists with its token.
        index = write_version(store, 1)
        assert index.commit_token is not None
        VersionWriter(store_objects(store), 1, index.commit_token).commit(index)
        assert store.versions() == [1]

    def test_second_writer_never_touches_the_winners_files(
        self, store: VersionStore, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        other = self.make_store(store_url, storage_options)
        writer, winner = start_version(store, 1, tensors={"w": b"winner"})
        with pytest.raises(VersionConflictError):
            write_version(other, 1, tensors={"w": b"loser!"})
        winner = writer.commit(winner)
        # A writer that lost its claim (e.g. a zombie) cannot commit either.
        with pytest.raises(VersionConflictError):
            VersionWriter(store_objects(other), 1, new_token()).commit(winner)
        assert store.index(1).commit_token == winner.commit_token
        assert committed_w(store, 1) == b"winner"

    def test_concurrent_committers_threads(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        writers = 6
        stores = [self.make_store(store_url, storage_options) for _ in range(writers)]
        tokens = [new_token() for _ in range(writers)]
        barrier = threading.Barrier(writers)

        def race(i: int) -> str:
            barrier.wait(timeout=60)
            try:
                write_version(stores[i], 1, token=tokens[i])
                return "committed"
            except VersionConflictError:
                return "conflict"
            except BaseException as exc:
                return f"error {exc!r}"

        with ThreadPoolExecutor(writers) as pool:
            outcomes = dict(zip(tokens, pool.map(race, range(writers))))
        self._check_race(store_url, storage_options, outcomes, writers)

    def test_concurrent_committers_processes(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        if not self.supports_processes:
            pytest.skip("this store lives inside one process")
        writers = 4
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(writers)
        results = ctx.Queue()
        tokens = [new_token() for _ in range(writers)]
        procs = [
            ctx.Process(
                target=race_worker,
                args=(store_url, storage_options, 1, token, barrier, results),
            )
            for token in tokens
        ]
        for proc in procs:
            proc.start()
        outcomes = dict(results.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
        self._check_race(store_url, storage_options, outcomes, writers)

    def _check_race(
        self, url: str, options: dict[str, Any], outcomes: dict[str, str], writers: int
    ) -> None:
        assert len(outcomes) == writers
        errors = [o for o in outcomes.values() if o.startswith("error")]
        assert errors == []
        winners = [t for t, o in outcomes.items() if o == "committed"]
        assert len(winners) == 1, outcomes
        reader = self.make_store(url, options)
        assert reader.versions() == [1]
        assert reader.index(1).commit_token == winners[0]
        assert committed_w(reader, 1) == f"v1-{winners[0]}".encode()

    # ----------------------------------------------------------------- refresh
    def test_refresh_sees_a_commit_from_another_process(
        self, store: VersionStore, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        if not self.supports_processes:
            pytest.skip("this store lives inside one process")
        write_version(store, 1)
        assert store.versions() == [1]
        assert store.list_files(1)  # warm whatever listing the reader keeps
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        token = new_token()
        child = ctx.Process(
            target=race_worker, args=(store_url, storage_options, 2, token, None, results, 1)
        )
        child.start()
        assert results.get(timeout=120) == (token, "committed")
        child.join(30)
        store.refresh()
        assert store.versions() == [1, 2]
        assert store.index(2).commit_token == token
        assert store.index(2).base_version == 1

    # ---------------------------------------------------------------- reading
    def test_ranged_reads(self, store: VersionStore) -> None:
        tensors = {"a": bytes(range(256)) * 3, "b": b"", "c": b"0123456789"}
        index = write_version(store, 1, tensors=tensors)
        shard = next(iter(index.shards()))
        header = store.read_shard_header(1, shard)
        assert set(header.tensors) == {"a", "b", "c"}
        for name, data in tensors.items():
            entry = header.tensors[name]
            assert store.read_range(1, shard, entry.start, entry.end) == data
        a = header.tensors["a"]
        assert store.read_range(1, shard, a.start + 250, a.start + 262) == tensors["a"][250:262]
        size = store.file_size(1, shard)
        with pytest.raises(FormatError):
            store.read_range(1, shard, size - 4, size + 4)
        with pytest.raises(VersionNotFoundError):
            store.read_range(1, "model-99999-of-99999.safetensors", 0, 8)

    def test_streamed_file_larger_than_a_block(self, store: VersionStore) -> None:
        size = 2 * store.block_size + 12345
        chunk = 256 * 1024
        pattern = bytes(range(251)) * (chunk // 251 + 1)
        writer = store.begin(1)
        with writer.open_write("big.safetensors") as fh:
            written = 0
            while written < size:
                piece = pattern[: min(chunk, size - written)]
                fh.write(piece)
                written += len(piece)
        assert store.file_size(1, "big.safetensors") == size

        def expected(start: int, end: int) -> bytes:
            return b"".join(pattern[(i % chunk) : (i % chunk) + 1] for i in range(start, end))

        edge = store.block_size
        assert store.read_range(1, "big.safetensors", edge - 5, edge + 5) == expected(
            edge - 5, edge + 5
        )
        with store.open_read(1, "big.safetensors") as fh:
            fh.seek(size - 10)
            assert fh.read() == expected(size - 10, size)

    def test_download_feeds_every_byte_in_order(self, store: VersionStore, tmp_path: Path) -> None:
        size = 2 * store.block_size + 12345  # several streamed blocks, the last one short
        data = (bytes(range(251)) * (size // 251 + 1))[:size]
        store.begin(1).write_file("big.safetensors", data)

        class Sink:
            def __init__(self) -> None:
                self.restarts, self.data = 0, bytearray()

            def restart(self) -> None:
                self.restarts, self.data = self.restarts + 1, bytearray()

            def update(self, piece: bytes) -> None:
                self.data += piece

        sink = Sink()
        assert store.download(1, "big.safetensors", str(tmp_path / "copy"), sink) == size
        assert (tmp_path / "copy").read_bytes() == data
        assert bytes(sink.data) == data and sink.restarts == 1
        assert store.download(1, "big.safetensors", str(tmp_path / "bare")) == size
        assert (tmp_path / "bare").read_bytes() == data
        with pytest.raises(VersionNotFoundError):
            store.download(1, "missing.safetensors", str(tmp_path / "none"), Sink())

    def test_failed_streamed_write_leaves_no_file(self, store: VersionStore) -> None:
        writer = store.begin(1)

        class Boom(Exception):
            pass

        with pytest.raises(Boom), writer.open_write("half.safetensors") as fh:
            fh.write(b"x" * 1000)
            raise Boom
        assert "half.safetensors" not in store.list_files(1)

    def test_create_only_is_exclusive(self, store: VersionStore) -> None:
        assert store_objects(store).check_exclusive_create() is True
        assert store.supports_exclusive_create is True

    def test_create_only_race_has_one_winner(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        # The low-level create itself, apart from any later check: racing writers of one
        # object, each its own client; exactly one succeeds, the rest get FileExistsError.
        writers = 6
        stores = [self.make_store(store_url, storage_options) for _ in range(writers)]
        path = store_objects(stores[0]).claim_path(1)
        barrier = threading.Barrier(writers)

        def race(i: int) -> str:
            barrier.wait(timeout=60)
            try:
                store_objects(stores[i]).create_only(path, f"writer {i}".encode())
                return "created"
            except FileExistsError:
                return "exists"
            except BaseException as exc:
                return f"error {exc!r}"

        with ThreadPoolExecutor(writers) as pool:
            outcomes = dict(enumerate(pool.map(race, range(writers))))
        winners = [i for i, outcome in outcomes.items() if outcome == "created"]
        assert sorted(outcomes.values()) == ["created"] + ["exists"] * (writers - 1), outcomes
        assert store_objects(stores[0]).read_optional(path) == f"writer {winners[0]}".encode()

    # ------------------------------------------------- faults (HTTP backends)
    def test_transient_errors_are_retried(
        self, faulty: tuple[VersionStore, FaultProxy, list[float]]
    ) -> None:
        store, proxy, waits = faulty
        fault = proxy.add(self.transient_fault())
        times = fault.times
        write_version(store, 1)
        assert [i.action for i in proxy.injected] == [fault.action] * times
        assert len(waits) == times  # our layer retried the whole step once per fault
        assert store.versions() == [1]

    def test_lost_acknowledgement_is_not_a_conflict(
        self, faulty: tuple[VersionStore, FaultProxy, list[float]]
    ) -> None:
        store, proxy, _ = faulty
        proxy.add(self.index_write_fault("drop-response"))
        index = write_version(store, 1)
        assert [i.action for i in proxy.injected] == ["drop-response"]
        assert store.versions() == [1]
        assert store.index(1).commit_token == index.commit_token

    def test_permanent_error_fails_at_once(
        self, faulty: tuple[VersionStore, FaultProxy, list[float]]
    ) -> None:
        store, proxy, waits = faulty
        write_version(store, 1)
        proxy.add(Fault("status", path_contains=INDEX_NAME, status=403, times=100))
        with pytest.raises(StoreError, match="access denied") as info:
            store.index(1)
        assert store.url in str(info.value)
        assert waits == []

    def test_fence_during_commit_withdraws_the_index(
        self,
        faulty: tuple[VersionStore, FaultProxy, list[float]],
        store_url: str,
        storage_options: dict[str, Any],
    ) -> None:
        zombie, proxy, _ = faulty
        pruner = self.make_store(store_url, storage_options)
        write_version(pruner, 1)

        def fence() -> None:
            pruner.fs.pipe_file(store_objects(pruner).abort_path(2), b'{"reason": "fenced"}')

        # The abort marker lands after the zombie's checks, before its index is written.
        proxy.add(self.index_write_fault("forward", before=fence))
        with pytest.raises(VersionConflictError, match="fenced"):
            write_version(zombie, 2, base=1)
        assert pruner.versions() == [1]
        assert INDEX_NAME not in pruner.list_files(2)
