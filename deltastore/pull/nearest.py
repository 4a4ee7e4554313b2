"""Reading one run from several copies of its store, nearest first.

``pull_weights(..., source_dir=[near, far])`` reads each version from the first store that has
it committed, falling back to the next (a replica that has not caught up yet, or is missing or
unreachable). The stores must be copies of one run (e.g. made by ``deltastore replicate``):
where a pull can see one version in two stores (a delta read from one store building on a
version read from another, or a file of a version vanishing from one store mid-read), the two
indexes must publish the same content (``VersionIndex.content_digest``; their bytes differ,
since each replica's writer stamps its own commit token), else the pull fails naming both
stores.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO, TypeVar

from deltastore.errors import ConfigError, FormatError, StoreError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.storage import DownloadSink, VersionStore

log = logging.getLogger("deltastore.pull")

T = TypeVar("T")


@dataclass(frozen=True)
class _Served:
    """The index of one version as the store that serves it holds it."""

    position: int
    """Position of that store in :attr:`NearestStores.stores`."""
    data: bytes
    index: VersionIndex
    digest: str
    """:meth:`VersionIndex.content_digest`: what two copies must share to be one version."""


class NearestStores(VersionStore):
    """Read-only view of several copies of one store, nearest first (see the module doc).

    Every read of a version goes to the store that served its index. :meth:`source_of` names
    that store's URL. Raises :class:`ConfigError` for an empty list.
    """

    def __init__(self, stores: Sequence[VersionStore]) -> None:
        if not stores:
            raise ConfigError("no store given to pull from; pass at least one store URL")
        first = stores[0]
        super().__init__(first.url, first.storage_options)
        self.stores = tuple(stores)
        self.url = "[" + ", ".join(s.url for s in self.stores) + "]"
        self._lock = threading.Lock()
        self._served: dict[int, _Served] = {}
        self._down: set[int] = set()
        self._built_on_from: dict[int, int] = {}
        """Base version → position of the store whose delta named it as its base."""

    # ----------------------------------------------------------------- routing
    def _serve(self, version: int) -> _Served:
        with self._lock:
            if version in self._served:
                return self._served[version]
        found: _Served | None = None
        for position, store in enumerate(self.stores):
            if position in self._down:
                continue
            try:
                found = self._read_index(position, version)
                break
            except VersionNotFoundError:
                continue
            except (StoreError, ConfigError) as exc:
                log.warning("store %s is unreachable (%s); reading the next one", store.url, exc)
                self._down.add(position)
        if found is None:
            raise VersionNotFoundError(
                f"weight_v{version:06d} is not committed in any of {self.url} (or those that "
                "have it are unreachable); list committed versions with `deltastore ls`"
            )
        linked = self._built_on_from.get(version)
        if linked is not None and linked != found.position:
            self._check_agree(found, linked)
        with self._lock:
            self._served[version] = found
        return found

    def _read_index(self, position: int, version: int) -> _Served:
        """``version``'s index as store ``position`` holds it, parsed and digested once."""
        store = self.stores[position]
        data = store.index_bytes(version)
        source = f"{store.url}/{version_dir_name(version)}/{INDEX_NAME}"
        index = VersionIndex.from_json(data, version=version, source=source)
        return _Served(position, data, index, index.content_digest())

    def _check_agree(self, found: _Served, other: int) -> None:
        """Store ``other``'s copy of ``found``'s version (if it has one) must hold the same
        content; its bytes may differ (each replica's writer stamps its own commit token)."""
        version = found.index.version
        try:
            theirs = self._read_index(other, version)
        except (VersionNotFoundError, StoreError, ConfigError):
            return
        if theirs.digest != found.digest:
            a, b = self.stores[found.position].url, self.stores[other].url
            raise FormatError(
                f"{version_dir_name(version)}/{INDEX_NAME} publishes other content in {a} "
                f"than in {b} (stream {found.index.stream_id} vs {theirs.index.stream_id}); "
                "the stores are not copies of one run. Pull from one of them, or re-replicate"
            )

    def _read(self, version: int, read: Callable[[VersionStore], T]) -> T:
        """``read`` on the store serving ``version``; if the file vanished there (pruned),
        on the next store holding the same content for that version."""
        found = self._serve(version)
        try:
            return read(self.stores[found.position])
        except VersionNotFoundError:
            for other in range(len(self.stores)):
                if other == found.position or other in self._down:
                    continue
                self._check_agree(found, other)
                with contextlib.suppress(VersionNotFoundError):
                    result = read(self.stores[other])
                    with self._lock:
                        self._served[version] = replace(found, position=other)
                    return result
            raise

    def source_of(self, version: int) -> str:
        """URL of the store ``version`` was read from (the first store if it was not read)."""
        served = self._served.get(version)
        return self.stores[served.position if served else 0].url

    # ------------------------------------------------------------------- reads
    def refresh(self, version: int | None = None) -> None:
        for store in self.stores:
            store.refresh(version)
        with self._lock:
            self._served.clear()
            self._down.clear()
            self._built_on_from.clear()

    def versions(self) -> list[int]:
        """Versions committed in any reachable store, ascending."""
        found: set[int] = set()
        for store in self.stores:
            try:
                found.update(store.versions())
            except (StoreError, ConfigError) as exc:
                log.warning("store %s is unreachable (%s); listing the others", store.url, exc)
        return sorted(found)

    def index_bytes(self, version: int) -> bytes:
        return self._serve(version).data

    def index(self, version: int) -> VersionIndex:
        found = self._serve(version)
        index = found.index
        if index.is_delta and index.base_version:
            with self._lock:
                self._built_on_from.setdefault(index.base_version, found.position)
        return index

    def file_size(self, version: int, name: str) -> int:
        return self._read(version, lambda s: s.file_size(version, name))

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        return self._read(version, lambda s: s.read_range(version, name, start, end))

    def read_shard_header(self, version: int, name: str) -> SafetensorsHeader:
        return self._read(version, lambda s: s.read_shard_header(version, name))

    def list_files(self, version: int) -> list[str]:
        return self._read(version, lambda s: s.list_files(version))

    def download(self, version: int, name: str, dst: str, sink: DownloadSink | None = None) -> int:
        return self._read(version, lambda s: s.download(version, name, dst, sink))

    @contextlib.contextmanager
    def open_read(self, version: int, name: str) -> Iterator[BinaryIO]:
        with self.stores[self._serve(version).position].open_read(version, name) as fh:
            yield fh

    def begin(self, version: int, *, token: str | None = None) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.url} is a read-only view of several stores; publish to one")
