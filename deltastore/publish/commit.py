"""Rank 0's side of the store protocol for one version: claim it, let ranks write it, commit
its index, or abort it. The publisher only ever talks to a :class:`VersionSlot`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from deltastore.errors import PublishError, VersionConflictError
from deltastore.format.index import VersionIndex
from deltastore.publish.stream import StreamState
from deltastore.storage import VersionStore, new_token

log = logging.getLogger("deltastore.publish")

_MAX_STALE_CLAIMS = 1000


class VersionSlot:
    """One version being written: its number, the claim's token and the store's protocol."""

    def __init__(self, store: VersionStore, version: int, token: str) -> None:
        self.store = store
        self.version = version
        self.token = token

    @contextmanager
    def open_write(self, name: str) -> Iterator[BinaryIO]:
        """A writable stream for one shard of this version."""
        with self.store.open_write(self.version, name) as fh:
            yield fh

    def commit(self, index: VersionIndex) -> None:
        """Create the index (the commit). Raises :class:`VersionConflictError` if another
        writer holds the version, and the store's errors when the outcome is not known."""
        try:
            self.store.commit(self.version, index)
        except VersionConflictError:
            raise
        except Exception as exc:
            # The index may have landed before the failure (a check after it failed): if
            # readers see it with this writer's token, the commit stands.
            if index_landed(self.store, self.version, self.token) is not True:
                raise
            log.warning(
                "committing weight_v%06d reported %s, but its index with this writer's token is "
                "published: the commit stands",
                self.version,
                exc,
            )

    def abort(self) -> None:
        """Remove the version's files and claim (never a committed version's)."""
        self.store.abort(self.version)


def claim(store: VersionStore, stream: StreamState) -> VersionSlot:
    """Rank 0: claim the stream's next version before any rank writes.

    Right after a resume (or a new stream) claims left by a crashed writer are skipped: the
    version numbers they hold are never reused, so a zombie writer cannot mix its shards with
    ours. Raises :class:`VersionConflictError` when another writer holds the version.
    """
    token = new_token()
    version = stream.next_version
    for _ in range(_MAX_STALE_CLAIMS):
        try:
            store.claim(version, token)
            return VersionSlot(store, version, token)
        except VersionConflictError:
            if not stream.resumed or version <= store.latest():
                raise
            log.warning(
                "weight_v%06d of %s is claimed but was never committed (a crashed writer); "
                "skipping to the next version",
                version,
                store.url,
            )
            version += 1
    raise PublishError(f"{_MAX_STALE_CLAIMS} stale claims in a row in {store.url}")


def join(store: VersionStore, version: int, token: str) -> VersionSlot:
    """Another rank: write files of the version rank 0 claimed."""
    return VersionSlot(store, version, token)


def index_landed(store: VersionStore, version: int, token: str) -> bool | None:
    """Whether readers see ``version`` committed with ``token``: True, False, or None when the
    store cannot tell right now."""
    try:
        store.refresh()
        if version not in store.versions():
            return False
        return store.index(version).commit_token == token
    except Exception:
        return None
