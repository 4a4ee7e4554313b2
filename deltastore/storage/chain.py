"""Following ``base_version`` links from a version back to where its chain starts."""

from __future__ import annotations

from deltastore.errors import FormatError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.storage.store import VersionStore


def walk_chain(store: VersionStore, target: int) -> tuple[VersionIndex | None, list[VersionIndex]]:
    """The full version ``target`` builds on (None: the base) and the deltas after it, in order.

    Raises :class:`VersionNotFoundError` when the target or a link is not committed (pruned: a
    partial chain must never be replayed onto the wrong start) and :class:`FormatError` when the
    chain mixes streams.
    """
    deltas: list[VersionIndex] = []
    start: VersionIndex | None = None
    version = target
    while version > 0:
        try:
            index = store.index(version)
        except VersionNotFoundError:
            if version == target:
                raise
            raise VersionNotFoundError(
                f"weight_v{target:06d} builds on weight_v{version:06d}, which is not in "
                f"{store.url} (pruned?); the chain is broken. Publish a full version "
                "(publish(..., full=True)) so hosts can reseed, or start a new stream"
            ) from None
        if not index.is_delta:
            start = index
            break
        deltas.append(index)
        assert index.base_version is not None
        version = index.base_version
    deltas.reverse()
    streams = {d.stream_id for d in deltas if d.stream_id is not None}
    if start is not None and start.stream_id is not None:
        streams.add(start.stream_id)
    if len(streams) > 1:
        raise FormatError(
            f"the chain to weight_v{target:06d} in {store.url} mixes streams {sorted(streams)}; "
            "the store is inconsistent"
        )
    return start, deltas
