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

The tests use only the public store API plus the on-disk layout (``_claims/``, abort markers).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from deltastore.errors import (
    FormatError,
    StoreError,
    TransientStoreError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, delta_shard_name, full_shard_name
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.storage import RetryPolicy, VersionStore, new_token
from deltastore.storage.writer import VersionWriter
from deltastore.testing.faults import Fault, FaultProxy

__all__ = [
    "FAST_RETRY",
    "StoreConformance",
    "fill_version",
    "shard_bytes",
    "start_version",
    "write_version",
]

WRITER_STEPS = ("fence-check", "successor", "index", "recheck")
"""The points of :meth:`VersionWriter.commit` a test can pause at (its ``_step_hook``)."""


class _WriterKilled(BaseException):
    """Stands for a writer process killed at a protocol step."""


FAST_RETRY = RetryPolicy(attempts=4, deadline_s=30.0, initial_wait_s=0.01, max_wait_s=0.05)
"""Short real waits, for tests against real servers."""


def shard_bytes(tensors: dict[str, bytes], digests: dict[str, str] | None = None) -> bytes:
    """A safetensors file of 1-D ``U8`` tensors (names in sorted order)."""
    names = sorted(tensors)
    header = build_header([TensorLayout(n, "U8", (len(tensors[n]),)) for n in names], digests or {})
    return header + b"".join(tensors[n] for n in names)


def start_version(
    store: VersionStore,
    version: int,
    *,
    base: int | None = None,
    tensors: dict[str, bytes] | None = None,
    token: str | None = None,
) -> tuple[VersionWriter, VersionIndex]:
    """Claim a version and write its one shard; returns the writer and the index to commit.

    ``base=None`` makes a full version, otherwise a delta on ``base``. Raises whatever the
    store raises (e.g. VersionConflictError).
    """
    writer = store.begin(version, token=token)
    return writer, fill_version(writer, base=base, tensors=tensors)


def fill_version(
    writer: VersionWriter, *, base: int | None = None, tensors: dict[str, bytes] | None = None
) -> VersionIndex:
    """Write a claimed version's one shard; returns the index to commit (see start_version)."""
    version = writer.version
    tensors = tensors if tensors is not None else {"w": f"v{version}-{writer.token}".encode()}
    shard = full_shard_name(0, 1) if base is None else delta_shard_name(0, 1)
    writer.write_file(shard, shard_bytes(tensors))
    return VersionIndex(
        version=version,
        weight_map=dict.fromkeys(sorted(tensors), shard),
        base_version=base,
        encoding=None if base is None else "xor",
        compression=None if base is None else "zstd",
        checksum="xxh3-128",
        commit_token=writer.token,
    )


def write_version(
    store: VersionStore,
    version: int,
    *,
    base: int | None = None,
    tensors: dict[str, bytes] | None = None,
    token: str | None = None,
    commit: bool = True,
) -> VersionIndex:
    """Claim, write one shard, and (unless ``commit=False``) commit a version through
    :class:`VersionWriter`; returns the index (committed or not)."""
    writer, index = start_version(store, version, base=base, tensors=tensors, token=token)
    return writer.commit(index) if commit else index


def _race_worker(
    url: str,
    options: dict[str, Any],
    version: int,
    token: str,
    barrier: Any,
    results: Any,
) -> None:
    """One writer process of a commit race: reports (token, outcome) on ``results``."""
    try:
        store = VersionStore(url, options, retry=FAST_RETRY)
        barrier.wait(timeout=60)
        write_version(store, version, token=token)
        results.put((token, "committed"))
    except VersionConflictError:
        results.put((token, "conflict"))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((token, f"error {exc!r}"))


def _publish_in_child(
    url: str, options: dict[str, Any], version: int, base: int, token: str, results: Any
) -> None:
    try:
        write_version(VersionStore(url, options, retry=FAST_RETRY), version, base=base, token=token)
        results.put("ok")
    except BaseException as exc:
        results.put(f"error {exc!r}")


def _fork_context() -> Any:
    return multiprocessing.get_context("fork")


class StoreConformance:
    """The behaviour every store backend must show; see the module docstring."""

    supports_processes = True
    """False for stores that live in one process (``memory://``)."""
    block_size: int | None = None
    """``block_size`` for the stores under test (None: the store's default)."""

    # ----------------------------------------------------------- backend hooks
    @pytest.fixture
    def store_url(self) -> str:
        """A fresh, empty store root for one test."""
        raise NotImplementedError("a backend's conformance class must override store_url")

    @pytest.fixture
    def storage_options(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def store(self, store_url: str, storage_options: dict[str, Any]) -> VersionStore:
        return self.make_store(store_url, storage_options)

    def make_store(self, url: str, options: dict[str, Any], **kwargs: Any) -> VersionStore:
        """Another client of the same store (its own instance, as another host would have)."""
        kwargs.setdefault("retry", FAST_RETRY)
        kwargs.setdefault("block_size", self.block_size)
        return VersionStore(url, options, **kwargs)

    @pytest.fixture
    def faulty(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> Iterator[tuple[VersionStore, FaultProxy, list[float]]]:
        """A store of ``store_url`` whose requests pass through a fault proxy, with the waits
        its retry policy took (recorded, not slept). Backends without a transport skip."""
        pytest.skip("this backend has no network transport to inject faults into")
        yield  # type: ignore[misc]  # pragma: no cover

    def index_write_fault(self, action: str, **kwargs: Any) -> Fault:
        """A fault rule matching this backend's request that writes an index."""
        raise NotImplementedError

    def transient_fault(self) -> Fault:
        """A transient fault on the index write that the client library does not absorb."""
        raise NotImplementedError

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
        raw.write_file(3, full_shard_name(0, 1), shard_bytes({"w": b"x"}))
        reader = self.make_store(store_url, storage_options)
        assert reader.versions() == [1]
        assert reader.latest() == 1
        with pytest.raises(VersionNotFoundError):
            reader.index(2)

    def test_commit_again_by_its_writer_is_not_a_conflict(self, store: VersionStore) -> None:
        # What a writer whose acknowledgement was lost does: the index exists with its token.
        index = write_version(store, 1)
        assert index.commit_token is not None
        VersionWriter(store, 1, index.commit_token).commit(index)
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
            VersionWriter(other, 1, new_token()).commit(winner)
        assert store.index(1).commit_token == winner.commit_token
        shard = next(iter(winner.shards()))
        header = store.read_shard_header(1, shard)
        entry = header.tensors["w"]
        assert store.read_range(1, shard, entry.start, entry.end) == b"winner"

    def test_concurrent_committers_threads(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        writers = 6
        stores = [self.make_store(store_url, storage_options) for _ in range(writers)]
        tokens = [new_token() for _ in range(writers)]
        barrier = threading.Barrier(writers)
        outcomes: dict[str, str] = {}

        def race(i: int) -> None:
            barrier.wait(timeout=60)
            try:
                write_version(stores[i], 1, token=tokens[i])
                outcomes[tokens[i]] = "committed"
            except VersionConflictError:
                outcomes[tokens[i]] = "conflict"
            except BaseException as exc:
                outcomes[tokens[i]] = f"error {exc!r}"

        threads = [threading.Thread(target=race, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        self._check_race(store_url, storage_options, outcomes, writers)

    def test_concurrent_committers_processes(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        if not self.supports_processes:
            pytest.skip("this store lives inside one process")
        writers = 4
        ctx = _fork_context()
        barrier = ctx.Barrier(writers)
        results = ctx.Queue()
        tokens = [new_token() for _ in range(writers)]
        procs = [
            ctx.Process(
                target=_race_worker,
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
        index = reader.index(1)
        assert index.commit_token == winners[0]
        shard = next(iter(index.shards()))
        entry = reader.read_shard_header(1, shard).tensors["w"]
        assert reader.read_range(1, shard, entry.start, entry.end) == f"v1-{winners[0]}".encode()

    # ----------------------------------------------------------------- refresh
    def test_refresh_sees_a_commit_from_another_process(
        self, store: VersionStore, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        if not self.supports_processes:
            pytest.skip("this store lives inside one process")
        write_version(store, 1)
        assert store.versions() == [1]
        assert store.list_files(1)  # warm whatever listing the reader keeps
        ctx = _fork_context()
        results = ctx.Queue()
        token = new_token()
        child = ctx.Process(
            target=_publish_in_child, args=(store_url, storage_options, 2, 1, token, results)
        )
        child.start()
        assert results.get(timeout=120) == "ok"
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

    def test_failed_streamed_write_leaves_no_file(self, store: VersionStore) -> None:
        writer = store.begin(1)

        class Boom(Exception):
            pass

        with pytest.raises(Boom), writer.open_write("half.safetensors") as fh:
            fh.write(b"x" * 1000)
            raise Boom
        assert "half.safetensors" not in store.list_files(1)

    def test_create_only_is_exclusive(self, store: VersionStore) -> None:
        assert store.check_exclusive_create() is True
        assert store.supports_exclusive_create is True

    def test_create_only_race_has_one_winner(
        self, store_url: str, storage_options: dict[str, Any]
    ) -> None:
        # The low-level create itself, apart from any later check: racing writers of one
        # object, each its own client; exactly one succeeds, the rest get FileExistsError.
        writers = 6
        stores = [self.make_store(store_url, storage_options) for _ in range(writers)]
        path = stores[0].claim_path(1)
        barrier = threading.Barrier(writers)
        outcomes: dict[int, str] = {}

        def race(i: int) -> None:
            barrier.wait(timeout=60)
            try:
                stores[i].create_only(path, f"writer {i}".encode())
                outcomes[i] = "created"
            except FileExistsError:
                outcomes[i] = "exists"
            except BaseException as exc:
                outcomes[i] = f"error {exc!r}"

        threads = [threading.Thread(target=race, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        winners = [i for i, outcome in outcomes.items() if outcome == "created"]
        assert sorted(outcomes.values()) == ["created"] + ["exists"] * (writers - 1), outcomes
        assert stores[0].read_optional(path) == f"writer {winners[0]}".encode()

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
        odd = store.version_path(2).replace("weight_v000002", "weight_v0000002")
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

    # ------------------------------------------------------------------ races
    # Each race pauses a writer before one protocol step (VersionWriter._step_hook) while the
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
        writer._step_hook = lambda name: pruner.prune(keep=5, grace_s=0) if name == step else None
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
                raise _WriterKilled
            elif name == "recheck":

                def unreachable(version: int) -> bool:
                    raise TransientStoreError("store unreachable (injected)")

                writer.store.is_fenced = unreachable  # type: ignore[method-assign]

        writer._step_hook = hook
        with pytest.raises((_WriterKilled, StoreError)):
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
        index = reader.index(version)
        for shard in index.shards():
            entry = reader.read_shard_header(version, shard).tensors["w"]
            data = reader.read_range(version, shard, entry.start, entry.end)
            assert data == f"v{version}-{index.commit_token}".encode()

    @pytest.mark.parametrize("step", WRITER_STEPS)
    def test_two_resumed_writers_never_fork(
        self, store_url: str, storage_options: dict[str, Any], step: str
    ) -> None:
        """Two publishers resumed on one store both build on v1: the second skips the first's
        live claim (v2) and takes v3, yet only one of them commits a successor of v1."""
        write_version(self.make_store(store_url, storage_options), 1)
        first = self.make_store(store_url, storage_options).begin_next(1)
        second = self.make_store(store_url, storage_options).begin_next(1)
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

        second._step_hook = lambda name: commit(first, first_index) if name == step else None
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
        resumed = self.make_store(store_url, storage_options).begin_next(1)
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

        failing._step_hook = fail
        with pytest.raises(OSError, match="injected"), failing:
            failing.commit(index)  # took v1's successor, then failed: aborted on exit
        retry = self.make_store(store_url, storage_options).begin_next(1)
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
            store.begin_next(1)

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
            pruner.fs.pipe_file(pruner.abort_path(2), b'{"reason": "fenced"}')

        # The abort marker lands after the zombie's checks, before its index is written.
        proxy.add(self.index_write_fault("forward", before=fence))
        with pytest.raises(VersionConflictError, match="fenced"):
            write_version(zombie, 2, base=1)
        assert pruner.versions() == [1]
        assert INDEX_NAME not in pruner.list_files(2)
