"""Helpers shared by the store conformance classes: building versions, racing writers, and
:class:`ConformanceBase`, the backend fixtures every conformance class is written against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from deltastore.errors import (
    VersionConflictError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import delta_shard_name, full_shard_name
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.storage import RetryPolicy, VersionStore
from deltastore.storage.writer import VersionWriter
from deltastore.testing.faults import Fault, FaultProxy

WRITER_STEPS = ("fence-check", "successor", "index", "recheck")
"""The points of :meth:`VersionWriter.commit` a test can pause at (its ``step_hook``)."""


class WriterKilled(BaseException):
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
    ``base=None`` makes a full version, otherwise a delta on ``base``."""
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


def committed_w(store: VersionStore, version: int) -> bytes:
    """The bytes of tensor ``w`` in the one shard of the committed ``version``."""
    shard = next(iter(store.index(version).shards()))
    entry = store.read_shard_header(version, shard).tensors["w"]
    return store.read_range(version, shard, entry.start, entry.end)


def race_worker(
    url: str,
    options: dict[str, Any],
    version: int,
    token: str,
    barrier: Any,
    results: Any,
    base: int | None = None,
) -> None:
    """One writer process (of a commit race, once ``barrier`` lets it go; None: at once):
    reports (token, outcome) on ``results``."""
    try:
        store = VersionStore(url, options, retry=FAST_RETRY)
        if barrier is not None:
            barrier.wait(timeout=60)
        write_version(store, version, base=base, token=token)
        results.put((token, "committed"))
    except VersionConflictError:
        results.put((token, "conflict"))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((token, f"error {exc!r}"))


class ConformanceBase:
    """The fixtures that describe a backend; see :mod:`deltastore.testing.store_tests`."""

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
