"""Resolving which published versions lead to a target: follow base_version links back."""

from __future__ import annotations

from dataclasses import dataclass

from deltastore.errors import FormatError, OutOfOrderError, VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.storage import VersionStore


@dataclass(frozen=True)
class Chain:
    """How to build a target version: a starting point, then deltas in order.

    ``start`` is 0 (the base checkpoint) or the version number of a full version.
    """

    target: int
    start: int
    start_index: VersionIndex | None
    """The full version's index, None when starting from the base."""
    deltas: list[VersionIndex]

    @property
    def stream_id(self) -> str | None:
        """Stream of the target (that of its newest delta, else of the full version)."""
        if self.deltas:
            return self.deltas[-1].stream_id
        return self.start_index.stream_id if self.start_index else None

    def versions(self) -> list[int]:
        return [d.version for d in self.deltas]

    def suffix_after(self, version: int) -> list[VersionIndex] | None:
        """The deltas still to apply on a checkpoint at ``version`` of this chain, or None."""
        if version == self.start:
            return list(self.deltas)
        for i, delta in enumerate(self.deltas):
            if delta.version == version:
                return self.deltas[i + 1 :]
        return None

    def stream_at(self, version: int) -> str | None:
        if version == self.start:
            return self.start_index.stream_id if self.start_index else None
        for delta in self.deltas:
            if delta.version == version:
                return delta.stream_id
        return None


def resolve_chain(store: VersionStore, target: int) -> Chain:
    """Walk ``base_version`` links back from ``target`` to a full version or the base.

    Raises :class:`VersionNotFoundError` if the target or a link is not committed (pruned:
    a partial chain must never be replayed onto the wrong start), :class:`FormatError` if the
    chain mixes streams.
    """
    if target == 0:
        return Chain(0, 0, None, [])
    deltas: list[VersionIndex] = []
    version = target
    while True:
        try:
            index = store.index(version)
        except VersionNotFoundError:
            if version == target:
                raise
            raise VersionNotFoundError(
                f"weight_v{target:06d} builds on weight_v{version:06d}, which is not in "
                f"{store.url} (pruned?); the chain is broken. Publish a full version "
                "(publish(..., full=True)) so hosts can reseed"
            ) from None
        if not index.is_delta:
            deltas.reverse()
            chain = Chain(target, version, index, deltas)
            break
        deltas.append(index)
        assert index.base_version is not None
        if index.base_version == 0:
            deltas.reverse()
            chain = Chain(target, 0, None, deltas)
            break
        version = index.base_version
    streams = {d.stream_id for d in chain.deltas}
    if len(streams) > 1:
        raise FormatError(
            f"the chain to weight_v{target:06d} mixes streams {sorted(map(str, streams))}; "
            "the store is inconsistent"
        )
    return chain


def check_builds_on(index: VersionIndex, applied_version: int) -> None:
    if index.base_version != applied_version:
        raise OutOfOrderError(
            f"out-of-order delta: local checkpoint at v{applied_version:06d}, "
            f"weight_v{index.version:06d} builds on v{index.base_version:06d}"
        )
