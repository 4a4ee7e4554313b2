"""The named messages ranks exchange during one publish (pickled by torch's object
collectives): small, plain and frozen. docs/publishing.md shows where each one travels.

In a single process the same messages pass through the identity coordinator, so one code
path (and one error contract) serves every world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deltastore.errors import (
    DeltastoreError,
    HookError,
    PublishError,
    SnapshotError,
    VersionConflictError,
)
from deltastore.trust.manifest import ShardFact


@dataclass(frozen=True)
class Failure:
    """Why a phase failed; every rank raises it (as the class its ``kind`` names)."""

    message: str
    kind: str = "publish"
    """``publish``: nothing was committed (``PublishError``); ``conflict``: another writer
    holds the version (``VersionConflictError``); ``uncertain``: the commit may have landed
    (``SnapshotError``)."""

    def error(self) -> DeltastoreError:
        """The exception every rank raises for this failure."""
        if self.kind == "conflict":
            return VersionConflictError(self.message)
        if self.kind == "uncertain":
            return SnapshotError(
                f"{self.message}; check store.latest() and restart every rank with resume=True"
            )
        return PublishError(self.message)


@dataclass(frozen=True)
class TensorChange:
    """One changed tensor as its rank diffed it."""

    digest: str
    """Digest of the tensor's new bytes."""
    payload_bytes: int
    """Compressed payload bytes (what the tensor adds to the wire)."""
    changed_bytes: int
    """Bytes of the tensor that differ from the snapshot."""


@dataclass(frozen=True)
class DiffReport:
    """Rank → rank 0 after the diff: what the rank was passed and what changed."""

    rank: int
    error: str | None
    passed: dict[str, TensorChange | None]
    """Every name the rank was passed; None where the tensor is unchanged."""
    full: bool
    """The rank's caller asked for a full version."""


@dataclass(frozen=True)
class ShardJob:
    """One shard file to write and the tensors it holds, in order."""

    shard: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """Rank 0's decision before the claim: the kind of version and who writes what."""

    full: bool
    shards: tuple[tuple[ShardJob, ...], ...]
    """Per rank, the shards that rank writes."""
    changed: dict[str, int]
    """Name → changed bytes of every changed tensor (one copy of each replica)."""
    owner: dict[str, int]
    """Name → the rank whose copy is published (the lowest rank passing it)."""


@dataclass(frozen=True)
class Plan:
    """Rank 0 → every rank: the claimed version and its layout, or why there is none."""

    failure: Failure | None
    version: int = 0
    token: str = ""
    """The claim's token; the index carries it as its commit token."""
    layout: Layout | None = None

    def shards_of(self, rank: int) -> tuple[ShardJob, ...]:
        """The shards ``rank`` writes."""
        assert self.layout is not None
        return self.layout.shards[rank]


@dataclass(frozen=True)
class Placement:
    """Where one tensor landed: its shard, absolute byte range and new digest."""

    shard: str
    start: int
    end: int
    digest: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Written:
    """Rank → rank 0 after writing its shards."""

    rank: int
    error: str | None
    entries: dict[str, Placement] = field(default_factory=dict)
    wire: int = 0
    """Bytes of the shard files this rank wrote."""
    shards: dict[str, ShardFact] = field(default_factory=dict)
    """Each shard this rank wrote: its size and whole-file BLAKE3 (what a signature covers)."""


@dataclass(frozen=True)
class Totals:
    """Global totals of a committed version."""

    total_bytes: int
    changed_bytes: int
    wire_bytes: int
    tensors_changed: int
    base_version: int | None
    """What a delta builds on; None for a full version."""


@dataclass(frozen=True)
class Outcome:
    """Rank 0 → every rank: committed (with where each tensor landed) or not."""

    failure: Failure | None
    entries: dict[str, Placement] = field(default_factory=dict)
    totals: Totals | None = None


@dataclass(frozen=True)
class Final:
    """Every rank → every rank after the commit: post-commit failures and timings."""

    rank: int
    advance_error: str | None
    hook_error: str | None
    seconds: dict[str, float]


def describe(exc: BaseException | None) -> str | None:
    """``Type: message`` of an exception, for a message to other ranks."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def after_commit_error(where: str, finals: Sequence[Final]) -> DeltastoreError | None:
    """The error every rank raises after a commit (``where`` names the committed version):
    :class:`SnapshotError` if a snapshot could not advance, :class:`HookError` if a hook
    failed, else None."""
    broken = [f"rank {f.rank}: {f.advance_error}" for f in finals if f.advance_error]
    if broken:
        return SnapshotError(
            f"{where}, but advancing the snapshot failed on {'; '.join(broken)}; restart "
            "every rank with resume=True"
        )
    hooks = [f"rank {f.rank}: {f.hook_error}" for f in finals if f.hook_error]
    if hooks:
        return HookError(
            f"{where} but the post-write hook failed on {'; '.join(hooks)}; fix the hook "
            "and run it again on those ranks before engines pull"
        )
    return None
