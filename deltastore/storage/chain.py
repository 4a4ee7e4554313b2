"""Following ``base_version`` links from a version back to where its chain starts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from deltastore.errors import FormatError, VersionNotFoundError
from deltastore.format.index import VersionIndex


class IndexSource(Protocol):
    """What a chain walk needs of a store."""

    @property
    def url(self) -> str: ...

    def index(self, version: int) -> VersionIndex: ...


def iter_chain(
    target: int, read_index: Callable[[int], VersionIndex | None]
) -> Iterator[VersionIndex]:
    """The one ``base_version`` walk: ``target``'s index, then its base's, back to a full
    version or the base (version 0). ``read_index`` returning None ends the walk there."""
    version = target
    while version > 0:
        index = read_index(version)
        if index is None:
            return
        yield index
        if not index.is_delta or not index.base_version:
            return
        version = index.base_version


def walk_chain(store: IndexSource, target: int) -> tuple[VersionIndex | None, list[VersionIndex]]:
    """The full version ``target`` builds on (None: the base) and the deltas after it, in order;
    :class:`VersionNotFoundError` when the target or a link is not committed (a partial chain
    must never be replayed onto the wrong start), :class:`FormatError` when it mixes streams."""

    def read(version: int) -> VersionIndex:
        try:
            return store.index(version)
        except VersionNotFoundError:
            if version == target:
                raise
            raise VersionNotFoundError(
                f"weight_v{target:06d} builds on weight_v{version:06d}, which is not in "
                f"{store.url} (pruned?); the chain is broken. Publish a full version "
                "(publish(..., full=True)) so hosts can reseed, or start a new stream"
            ) from None

    chain = list(iter_chain(target, read))  # newest first; a full version only at the end
    start = chain[-1] if chain and not chain[-1].is_delta else None
    deltas = [index for index in reversed(chain) if index.is_delta]
    streams = {index.stream_id for index in chain if index.stream_id is not None}
    if len(streams) > 1:
        raise FormatError(
            f"the chain to weight_v{target:06d} in {store.url} mixes streams {sorted(streams)}; "
            "the store is inconsistent"
        )
    return start, deltas
