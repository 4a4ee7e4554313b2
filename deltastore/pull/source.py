"""The store a pull reads: opened once, its hook bound without touching the caller's store,
the target resolved ("latest"), and kept apart from the local checkpoint.

``source_dir=[near, far]`` reads each version from the first store that has it committed (a
replica may lag, be missing or unreachable). The stores must be copies of one run: where a
pull sees one version in two stores (a delta building on a version read from another store,
or a file vanishing from one mid-read), both indexes must publish the same content
(``VersionIndex.content_digest``: each replica stamps its own commit token), else the pull
fails naming both stores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, TypeVar

from deltastore.errors import ConfigError, FormatError, StoreError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.storage import DownloadSink, VersionStore
from deltastore.storage.store import require_store

log = logging.getLogger("deltastore.pull")

T = TypeVar("T")

PreRead = Callable[[str, int], None]
StoreSpec = VersionStore | str | os.PathLike[str]


def open_store(
    source: StoreSpec | Sequence[StoreSpec], storage_options: dict[str, Any] | None = None
) -> VersionStore:
    """``source`` itself when it is a store (never modified), else a new store at that URL;
    a list (or tuple) of them reads each version from the first that has it
    (:class:`NearestStores`; one item is that store alone)."""
    if isinstance(source, VersionStore):
        return source
    if isinstance(source, (str, os.PathLike)):
        return VersionStore(os.fspath(source), storage_options)
    stores = [open_store(item, storage_options) for item in source]
    return stores[0] if len(stores) == 1 else NearestStores(stores)


def each_store(store: VersionStore) -> tuple[VersionStore, ...]:
    """The stores a pull reads: those of a :class:`NearestStores`, else ``store`` itself."""
    return store.stores if isinstance(store, NearestStores) else (store,)


def require_stores(store: VersionStore) -> None:
    """Raise the no-store :class:`ConfigError` when none of the stores a pull reads holds
    anything a publisher wrote (:func:`~deltastore.storage.store.require_store`); one that
    cannot be listed now is not taken for absent (its own error shows where it is read)."""
    errors: list[ConfigError] = []
    for one in each_store(store):
        try:
            require_store(one)
            return
        except ConfigError as exc:
            errors.append(exc)
        except StoreError:
            return
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(
        f"no store at any of {store.url}: nothing was ever published there; check the store URLs"
    )


def require_committed(
    store: VersionStore, target: int, *, lost: VersionNotFoundError | None = None
) -> None:
    """Raise :class:`VersionNotFoundError` unless ``target`` is committed in ``store`` (listed
    afresh): "not published" past the newest version, "no longer in" (pruned) below it, the
    read error ``lost`` chained where a pull met the pruning while it read. A store holding
    nothing at all gets the no-store :class:`ConfigError` (:func:`require_stores`)."""
    store.refresh()
    committed = store.versions()
    if not committed:
        require_stores(store)  # a mistyped URL: say so, not "the latest version is v000000"
    if target in committed:
        return
    latest = committed[-1] if committed else 0
    name, then = f"weight_v{target:06d}", f"the latest version is v{latest:06d}"
    if target > latest:
        raise VersionNotFoundError(f"{name} is not published in {store.url}; {then}") from None
    how = " (pruned)" if lost is None else ": it was pruned while this pull read it"
    message = f"{name} is no longer in {store.url}{how}; {then}: pull that instead"
    raise VersionNotFoundError(message) from lost


def source_of(store: VersionStore, version: int) -> str:
    """URL of the store ``version`` was read from."""
    return store.source_of(version) if isinstance(store, NearestStores) else store.url


@dataclass(frozen=True)
class PullSource:
    """A store and this pull's own pre-read hook (run beside the store's own, so the store the
    caller passed in is not modified)."""

    store: VersionStore
    pre_read: PreRead | None = None

    def refresh(self, version: int | None = None) -> None:
        """Make other hosts' commits visible and run the pre-read hooks for ``version``."""
        self.store.refresh(version)
        if self.pre_read is not None and version is not None and version > 0:
            for store in each_store(self.store):
                self.pre_read(store.url, version)

    def resolve_target(self, target: int | str) -> int:
        """``target`` as a version number (``"latest"``: the newest committed); raises
        :class:`ConfigError` for anything else that is not a non-negative int, and for
        ``"latest"`` where no store is (a mistyped URL must not reset the host to the base)."""
        if target == "latest":
            self.store.refresh()
            latest = self.store.latest()
            if latest == 0:
                require_stores(self.store)
            return latest
        if isinstance(target, bool) or not isinstance(target, int):
            raise ConfigError(f"target version {target!r} is neither a version number nor 'latest'")
        if target < 0:
            raise ConfigError(f"target version {target} is negative")
        return target

    def check_target(self, target: int, *, fresh: bool) -> None:
        """Before a pull touches the host, unless a pre-read hook may fill the root or bring
        the version: the no-store :class:`ConfigError` when every store is a local path that
        does not exist, or when no store holds anything a publisher wrote and the pull would
        create the host dir (``fresh``: a mistyped bucket leaves no host dir behind), and
        then, for a fresh dir, :func:`require_committed`."""
        stores = each_store(self.store)
        if self.pre_read is not None or any(s.pre_read is not None for s in stores):
            return
        if fresh or all(s.is_local and not os.path.isdir(s.root) for s in stores):
            require_stores(self.store)
        if fresh:
            require_committed(self.store, target)

    def check_apart_from(self, local_dir: str) -> None:
        """Refuse a local checkpoint dir that is, is inside, or contains a local store's root
        (it would overwrite published versions); real paths are compared, so links do not
        hide it."""
        local = os.path.realpath(local_dir)
        for store in each_store(self.store):
            root = os.path.realpath(store.root)
            if store.is_local and overlaps(local, root):
                raise ConfigError(
                    f"local checkpoint dir {local_dir} ({local}) overlaps the store {store.url} "
                    f"({root}); pulling there would overwrite published versions. Pass a "
                    "host-local dir outside the store"
                )


def overlaps(a: str, b: str) -> bool:
    """True when real paths ``a`` and ``b`` are one dir or one lies inside the other."""
    return os.path.commonpath([a, b]) in (a, b)


@dataclass(frozen=True)
class _Served:
    """The index of one version as the store at ``position`` holds it."""

    position: int
    data: bytes
    index: VersionIndex
    digest: str
    """:meth:`VersionIndex.content_digest`: what two copies must share to be one version."""


class NearestStores(VersionStore):
    """Read-only view of several copies of one store, nearest first (see the module doc):
    every read of a version goes to the store that served its index (:meth:`source_of`)."""

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

    def refresh(self, version: int | None = None) -> None:
        for store in self.stores:
            store.refresh(version)
        with self._lock:
            self._served.clear()
            self._down.clear()
            self._built_on_from.clear()

    def versions(self) -> list[int]:
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
