"""The store a pull reads: opened once, its hook bound without touching the caller's store,
the target resolved ("latest"), and kept apart from the local checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import ConfigError, StoreError, VersionNotFoundError
from deltastore.pull.nearest import NearestStores
from deltastore.storage import VersionStore
from deltastore.storage.listing import require_store

PreRead = Callable[[str, int], None]
StoreSpec = VersionStore | str | os.PathLike[str]
"""One store: a :class:`VersionStore` or its URL."""


def open_store(
    source: StoreSpec | Sequence[StoreSpec], storage_options: dict[str, Any] | None = None
) -> VersionStore:
    """``source`` itself when it is a store (never modified), else a new store at that URL;
    a list (or tuple) of them reads each version from the first that has it
    (:class:`~deltastore.pull.nearest.NearestStores`; one item is that store alone)."""
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
    anything a publisher wrote (see :func:`~deltastore.storage.listing.require_store`).

    A store that cannot be listed right now is not taken for absent: its own error shows
    where it is read.
    """
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
    if target > latest:
        raise VersionNotFoundError(
            f"weight_v{target:06d} is not published in {store.url}; the latest "
            f"version is v{latest:06d}"
        ) from None
    if lost is None:
        raise VersionNotFoundError(
            f"weight_v{target:06d} is no longer in {store.url} (pruned); the latest "
            f"version is v{latest:06d}: pull that instead"
        )
    raise VersionNotFoundError(
        f"weight_v{target:06d} is no longer in {store.url}: it was pruned while this "
        f"pull read it; the latest version is v{latest:06d}: pull that instead"
    ) from lost


def source_of(store: VersionStore, version: int) -> str:
    """URL of the store ``version`` was read from."""
    return store.source_of(version) if isinstance(store, NearestStores) else store.url


@dataclass(frozen=True)
class PullSource:
    """A store and the pre-read hook this pull runs before reading a version.

    The hook is this pull's own: it runs beside the store's own ``pre_read`` (if any), and the
    store the caller passed in is not modified.
    """

    store: VersionStore
    pre_read: PreRead | None = None

    def refresh(self, version: int | None = None) -> None:
        """Make other hosts' commits visible and run the pre-read hooks for ``version``."""
        self.store.refresh(version)
        if self.pre_read is not None and version is not None and version > 0:
            for store in each_store(self.store):
                self.pre_read(store.url, version)

    def resolve_target(self, target: int | str) -> int:
        """``target`` as a version number: ``"latest"`` is the newest committed version.

        Raises :class:`ConfigError` for anything else that is not a non-negative int, and for
        ``"latest"`` where no store is (:func:`require_stores`: a mistyped URL must not read as
        an empty store and reset the host to the base).
        """
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

    def check_roots(self, *, list_remote: bool) -> None:
        """Raise the no-store :class:`ConfigError` before a pull touches the host: when every
        store is a local path that does not exist (free), and with ``list_remote`` (a host dir
        the pull would create) when no store holds anything a publisher wrote (one listing
        each, so a mistyped bucket prefix leaves no host dir, lock or state behind). Other
        absent stores are found when the pull reads them. Skipped where a pre-read hook runs:
        the hook may be what fills the root (a mirror of a bucket, say)."""
        if self._hooked():
            return
        stores = each_store(self.store)
        if list_remote or all(s.is_local and not os.path.isdir(s.root) for s in stores):
            require_stores(self.store)

    def _hooked(self) -> bool:
        """Whether a pre-read hook runs before reads (this pull's or a store's own)."""
        return self.pre_read is not None or any(
            s.pre_read is not None for s in each_store(self.store)
        )

    def check_published(self, target: int) -> None:
        """Raise :class:`VersionNotFoundError` when no store has ``target`` committed
        (:func:`require_committed`): asked before a pull creates a host dir, so a version not
        (or no longer) published leaves no dir or lock behind. Skipped where a pre-read hook
        runs (it may bring the version)."""
        if not self._hooked():
            require_committed(self.store, target)

    def check_apart_from(self, local_dir: str) -> None:
        """Refuse a local checkpoint dir that is, is inside, or contains a local store's root.

        Pulling into such a dir would overwrite published versions (every host pulling them
        afterwards would get other bytes). Real paths are compared, so links do not hide it.
        """
        for store in each_store(self.store):
            if not store.is_local:
                continue
            root = os.path.realpath(store.root)
            local = os.path.realpath(local_dir)
            if _within(local, root) or _within(root, local):
                raise ConfigError(
                    f"local checkpoint dir {local_dir} ({local}) overlaps the store {store.url} "
                    f"({root}); pulling there would overwrite published versions. Pass a "
                    "host-local dir outside the store"
                )


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def make_source(
    source: StoreSpec | Sequence[StoreSpec],
    storage_options: dict[str, Any] | None,
    pre_read: PreRead | None,
) -> PullSource:
    """The :class:`PullSource` of one ``pull_weights`` call."""
    return PullSource(open_store(source, storage_options), pre_read)
