"""Where a publisher's stream stands (:class:`StreamState`), and how ``seed()`` decides it.

The state is a frozen value. It is decided once at seed and replaced by
:meth:`StreamState.committed` after each commit, in one place; nothing else changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deltastore.errors import StreamError
from deltastore.publish.lineage import Lineage, rebuild_lineage
from deltastore.publish.snapshot import TensorSource
from deltastore.storage import VersionStore, new_token


@dataclass(frozen=True)
class StreamState:
    """The stream a publisher continues and what its chain holds since the last full version."""

    stream_id: str
    base_version: int
    """Version the next delta builds on (0: the base checkpoint)."""
    next_version: int
    """First version number the next publish tries to claim."""
    walk_from_base: bool = True
    """A tensor can be rebuilt from the base + chain (False after ``continue_latest``)."""
    resumed: bool = False
    """Claims left by a crashed writer (or this one's aborted attempt) may be skipped: seeded
    onto a store with versions, or a claimed version was aborted, and nothing committed
    since."""
    chain_deltas: int = 0
    """Deltas since the last full version (or the stream's start)."""
    chain_wire: int = 0
    """Wire bytes of those deltas."""
    holders: dict[str, int] = field(default_factory=dict)
    """Rank 0: the rank that last published each tensor (it holds the tensor's state)."""

    def aborted(self) -> StreamState:
        """The state after a claimed version was aborted: nothing advanced, but that version
        may now carry a tombstone (it took its base's successor), so the next claim may skip
        it like a resumed stream's."""
        return replace(self, resumed=True)

    def committed(
        self, version: int, *, full: bool, wire_bytes: int, owner: dict[str, int]
    ) -> StreamState:
        """The state after ``version`` was committed."""
        return replace(
            self,
            base_version=version,
            next_version=version + 1,
            walk_from_base=True if full else self.walk_from_base,
            resumed=False,
            chain_deltas=0 if full else self.chain_deltas + 1,
            chain_wire=0 if full else self.chain_wire + wire_bytes,
            holders={**self.holders, **owner},
        )


@dataclass(frozen=True)
class SeedDecision:
    """Rank 0 → every rank at seed: the stream and the chain to rebuild the snapshot from."""

    error: BaseException | None
    stream: StreamState | None = None
    lineage: Lineage | None = None


def decide_seed(
    store: VersionStore,
    sources: dict[str, TensorSource],
    *,
    resume: bool,
    new_stream: bool,
    continue_latest: bool,
) -> SeedDecision:
    """Rank 0: read the store and decide the stream (see ``DeltaPublisher.seed``).

    Raises :class:`StreamError` on a store with versions unless one of the three flags says
    what to do, and the store's errors.
    """
    latest = store.latest()
    explicit = continue_latest or resume or new_stream
    if latest and not explicit:
        raise StreamError(
            f"{store.url} already holds versions up to weight_v{latest:06d}; pass "
            "resume=True to continue that stream or new_stream=True to start a new one"
        )
    if resume and latest and not new_stream:
        lineage = rebuild_lineage(store, latest, sources)
        stream = StreamState(
            stream_id=lineage.stream_id or new_token(),
            base_version=latest,
            next_version=latest + 1,
            resumed=True,
            chain_deltas=lineage.deltas,
            chain_wire=lineage.wire_bytes,
        )
        return SeedDecision(error=None, stream=stream, lineage=lineage)
    if continue_latest and latest:
        stream = StreamState(
            stream_id=store.index(latest).stream_id or new_token(),
            base_version=latest,
            next_version=latest + 1,
            walk_from_base=False,
            resumed=True,
        )
        return SeedDecision(error=None, stream=stream)
    stream = StreamState(
        stream_id=new_token(), base_version=0, next_version=latest + 1, resumed=explicit
    )
    return SeedDecision(error=None, stream=stream)
