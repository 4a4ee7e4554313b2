"""Rank 0's claim of a version and the other ranks' join, through the store's
:class:`~deltastore.storage.VersionWriter` (the one owner of the commit protocol: claim,
fence checks, successor, index, "does the commit stand").
"""

from __future__ import annotations

from deltastore.publish.stream import StreamState
from deltastore.storage import VersionStore
from deltastore.storage.writer import VersionWriter


def claim(store: VersionStore, stream: StreamState) -> VersionWriter:
    """Rank 0: claim the stream's next version before any rank writes.

    Right after a resume (or a new stream) the first claimable version after the base is
    taken (claims left by a crashed writer are skipped by the store, never reused). Raises
    :class:`VersionConflictError` when another writer holds the version.
    """
    if stream.resumed:
        return store.begin_next(stream.next_version - 1)
    return store.begin(stream.next_version)


def join(store: VersionStore, version: int, token: str) -> VersionWriter:
    """Another rank: write files of the version rank 0 claimed."""
    return store.join(version, token)


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
