"""Resolving which published versions lead to a target, and planning how to get there.

:func:`resolve_chain` follows ``base_version`` links back from the target to a full version or
the base; :func:`plan_pull` decides, from what the local checkpoint holds, whether to do
nothing, catch up along the chain, or reseed from the chain's start (and how many bytes each
would move).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltastore.errors import VersionNotFoundError
from deltastore.format.index import VersionIndex
from deltastore.format.state import AppliedState
from deltastore.storage import VersionStore
from deltastore.storage.chain import IndexSource, iter_chain, walk_chain


@dataclass(frozen=True)
class Chain:
    """How to build a target version: a start (0, the base, or a full version), then deltas."""

    target: int
    start: int
    start_index: VersionIndex | None
    """The full version's index, None when starting from the base."""
    deltas: list[VersionIndex]
    start_stream: str | None = None
    partial: bool = False
    """True when resolved only back to the host's applied version ``start`` (whose stream is
    ``start_stream``), not to a full version or the base: good for a catch-up, not a reseed."""

    @property
    def stream_id(self) -> str | None:
        """Stream of the target (that of its newest delta, else of the full version)."""
        if self.deltas:
            return self.deltas[-1].stream_id
        return self.start_index.stream_id if self.start_index else None

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
            if self.partial:
                return self.start_stream
            return self.start_index.stream_id if self.start_index else None
        for delta in self.deltas:
            if delta.version == version:
                return delta.stream_id
        return None


def resolve_chain(store: IndexSource, target: int) -> Chain:
    """Walk ``base_version`` links back from ``target`` to a full version or the base.

    Raises :class:`VersionNotFoundError` if the target or a link is not committed (pruned:
    a partial chain must never be replayed onto the wrong start), :class:`FormatError` if the
    chain mixes streams.
    """
    start, deltas = walk_chain(store, target)
    return Chain(target, start.version if start else 0, start, deltas)


def resolve_onto(store: VersionStore, target: int, state: AppliedState | None) -> Chain:
    """The chain to ``target`` as seen from a host holding ``state``: O(versions applied).

    A host that holds a verified version of the target's stream needs only the deltas after
    it: the walk from ``target`` stops at the host's version, and each delta read must be of
    the host's stream and link, base by base, onto the host's version. Anything else (no
    state, the base, a full version or a gap on the way, another stream, a backward target)
    resolves the whole chain with :func:`resolve_chain` (a reseed needs its start). Raises
    what :func:`resolve_chain` raises.
    """
    if state is None or state.version <= 0 or state.version >= target:
        return resolve_chain(store, target)
    held = state.version
    once = _ReadOnce(store)  # the full walk, if it comes to one, reuses what was read

    def read(version: int) -> VersionIndex | None:
        return None if version <= held else once.index(version)

    try:
        deltas = list(iter_chain(target, read))
    except VersionNotFoundError:
        return resolve_chain(once, target)  # the full walk names what is missing
    deltas.reverse()
    if (
        not deltas
        or not all(d.is_delta for d in deltas)
        or deltas[0].base_version != held
        or any(d.stream_id != state.stream_id for d in deltas)
    ):
        return resolve_chain(once, target)
    return Chain(target, held, None, deltas, state.stream_id, partial=True)


class _ReadOnce:
    """A store's indexes for one resolution, each read (two requests on S3) at most once."""

    def __init__(self, store: IndexSource) -> None:
        self.store = store
        self.url = store.url
        self._read: dict[int, VersionIndex] = {}

    def index(self, version: int) -> VersionIndex:
        if version not in self._read:
            self._read[version] = self.store.index(version)
        return self._read[version]


def version_bytes(store: VersionStore, index: VersionIndex) -> int:
    """Bytes a reader moves to fetch a version: its shards (from the index totals if recorded)."""
    recorded = index.totals.get("wire_bytes")
    if recorded is not None:
        return recorded
    return sum(store.file_size(index.version, shard) for shard in index.shards())


@dataclass(frozen=True)
class Plan:
    """How one pull brings the local checkpoint to ``target``."""

    action: str
    """``noop``, ``catchup`` (deltas on top of the local version) or ``reseed``."""
    target: int
    start: int
    """Version the deltas build on: the local version (catch-up) or the chain's start (reseed)."""
    deltas: list[VersionIndex] = field(default_factory=list)
    bytes_to_move: int = 0
    """Bytes read from the store (a reseed from the base also copies the base locally)."""
    reason: str = ""
    alternative_bytes: int | None = None
    """What the other way (reseed vs catch-up) would have moved, when both were possible."""

    @property
    def versions(self) -> list[int]:
        return [d.version for d in self.deltas]

    def describe(self) -> str:
        if self.action == "noop":
            return f"already at v{self.target:06d}"
        source = "the base" if self.start == 0 else f"full version v{self.start:06d}"
        head = (
            f"catch up v{self.start:06d} -> v{self.target:06d}"
            if self.action == "catchup"
            else f"reseed from {source}, then to v{self.target:06d}"
        )
        versions = self.versions
        span = f"v{versions[0]:06d}..v{versions[-1]:06d}" if versions else "none"
        text = f"{head}: {len(versions)} delta(s) ({span}), {self.bytes_to_move} bytes to move"
        if self.alternative_bytes is not None:
            other = "reseeding" if self.action == "catchup" else "catching up"
            text += f" ({other} would move {self.alternative_bytes})"
        return f"{text}; {self.reason}" if self.reason else text


def _reseed_bytes(store: VersionStore, chain: Chain) -> int:
    start = version_bytes(store, chain.start_index) if chain.start_index is not None else 0
    return start + sum(version_bytes(store, d) for d in chain.deltas)


def plan_pull(store: VersionStore, chain: Chain, state: AppliedState | None) -> Plan:
    """Decide how to reach ``chain.target`` from ``state`` (None: nothing verified locally).

    A state on the chain (same stream) catches up with the deltas after it, unless reseeding
    from the chain's start would move fewer bytes. Anything else (no state, a version of
    another stream, a backward target) reseeds from the base or the newest full version on
    the chain and replays: never a silent no-op.
    """
    target = chain.target
    if state is None:
        reason = "no verified local state"
    else:
        todo = chain.suffix_after(state.version)
        expected_stream = chain.stream_at(state.version)
        # Streams must agree both ways: a version of stream X is not the same-numbered version
        # of a store republished by a publisher that records no stream (the reference trainer).
        foreign = state.version != 0 and state.stream_id != expected_stream
        if todo is None:
            reason = f"local v{state.version:06d} is not on the chain of v{target:06d} " + (
                "(backward target)" if state.version > target else "(another chain or stream)"
            )
        elif foreign:
            reason = (
                f"local v{state.version:06d} is of stream {state.stream_id}, the target's chain "
                f"is stream {expected_stream}"
            )
        elif not todo:
            return Plan("noop", target, state.version)
        else:
            catchup = sum(version_bytes(store, d) for d in todo)
            if chain.partial:
                # A partial chain never includes a full version between the host and the
                # target, so reseeding would move every byte of this catch-up and more.
                return Plan("catchup", target, state.version, todo, catchup)
            reseed_bytes = _reseed_bytes(store, chain)
            if chain.start_index is not None and reseed_bytes < catchup:
                why = f"full version v{chain.start:06d} moves fewer bytes than the chain"
                return Plan("reseed", target, chain.start, chain.deltas, reseed_bytes, why, catchup)
            return Plan("catchup", target, state.version, todo, catchup, "", reseed_bytes)
    return Plan(
        "reseed", target, chain.start, list(chain.deltas), _reseed_bytes(store, chain), reason
    )
