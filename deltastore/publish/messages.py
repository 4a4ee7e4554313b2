"""The frozen values of a publish: the messages ranks exchange (docs/publishing.md shows where
each travels; alone, through the identity coordinator), the stream's state, and what a publish
reports (:class:`PublishResult`, the keys of ``pop_metrics()``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from deltastore.errors import (
    DeltastoreError,
    HookError,
    PublishError,
    SnapshotError,
    VersionConflictError,
)
from deltastore.trust.manifest import ShardFact

log = logging.getLogger("deltastore.publish")

METRIC_KEYS = (
    "version",
    "full",
    "density",
    "changed_bytes",
    "total_bytes",
    "wire_bytes",
    "tensors_changed",
    "tensors",
    "world_size",
    "load_s",
    "copy_s",
    "encode_s",
    "diff_s",
    "write_s",
    "commit_s",
    "coord_s",
    "hook_s",
    "publish_s",
)
"""Keys of ``DeltaPublisher.pop_metrics``; docs/publishing.md gives each one's unit."""
SECONDS_KEYS = tuple(k for k in METRIC_KEYS if k.endswith("_s"))
HIGH_DENSITY = 0.20
"""Above this share of changed bytes a version is far denser than an RL step makes."""


@dataclass(frozen=True)
class StreamState:
    """The stream a publisher continues and what its chain holds since the last full version:
    decided at seed, replaced by :meth:`committed` after each commit and changed nowhere else."""

    stream_id: str
    base_version: int  # the next delta builds on it (0: the base checkpoint)
    next_version: int
    walk_from_base: bool = True  # a tensor can be rebuilt from base + chain (not after continue)
    resumed: bool = False  # seeded onto versions, or aborted since: the claim may skip some
    chain_deltas: int = 0  # deltas since the last full version (or the stream's start) ...
    chain_wire: int = 0  # ... and their wire bytes
    holders: dict[str, int] = field(default_factory=dict)  # rank 0: who last published each

    def aborted(self) -> StreamState:
        """The aborted version may carry a tombstone: the next claim may skip it."""
        return replace(self, resumed=True)

    def committed(self, layout: Layout, result: PublishResult) -> StreamState:
        """The stream once ``result``'s version, laid out as ``layout``, is committed."""
        full = layout.full
        return replace(
            self,
            base_version=result.version,
            next_version=result.version + 1,
            walk_from_base=full or self.walk_from_base,
            resumed=False,
            chain_deltas=0 if full else self.chain_deltas + 1,
            chain_wire=0 if full else self.chain_wire + result.wire_bytes,
            holders={**self.holders, **layout.owner},
        )


@dataclass(frozen=True)
class Failure:
    """Why a phase failed; every rank raises it (as the class its ``kind`` names)."""

    message: str
    kind: str = "publish"
    """``publish``: nothing was committed (``PublishError``); ``conflict``: another writer
    holds the version (``VersionConflictError``); ``uncertain``: it may have landed."""

    def error(self) -> DeltastoreError:
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
    payload_bytes: int  # what it adds to the wire
    changed_bytes: int  # bytes that differ from the snapshot


@dataclass(frozen=True)
class DiffReport:
    """Rank → rank 0 after the diff."""

    rank: int
    error: str | None
    passed: dict[str, TensorChange | None]  # every name the rank was passed; None: unchanged
    full: bool  # its caller asked for a full version


@dataclass(frozen=True)
class ShardJob:
    """One shard file to write and the tensors it holds, in order."""

    shard: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """Rank 0's decision before the claim."""

    full: bool
    shards: tuple[tuple[ShardJob, ...], ...]  # per rank, the shards that rank writes
    changed: dict[str, int]  # name -> changed bytes of every changed tensor (one per replica)
    owner: dict[str, int]  # name -> the rank whose copy is published (the lowest passing it)


@dataclass(frozen=True)
class Plan:
    """Rank 0 → every rank: the claimed version, its token and its layout, or why not."""

    failure: Failure | None
    version: int = 0
    token: str = ""
    layout: Layout | None = None


@dataclass(frozen=True)
class Placement:
    """Where one tensor landed (an absolute byte range) and its new digest."""

    shard: str
    start: int
    end: int
    digest: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Written:
    """Rank → rank 0 after writing its shards (``shards``: what a signature covers)."""

    rank: int
    error: str | None
    entries: dict[str, Placement] = field(default_factory=dict)
    wire: int = 0
    shards: dict[str, ShardFact] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """Rank 0 → every rank: committed (with where each tensor landed) or not."""

    failure: Failure | None
    entries: dict[str, Placement] = field(default_factory=dict)
    result: PublishResult | None = None


@dataclass(frozen=True)
class Final:
    """Every rank → every rank after the commit: post-commit failures and timings."""

    rank: int
    advance_error: str | None
    hook_error: str | None
    seconds: dict[str, float]


@dataclass(frozen=True)
class PublishResult:
    """What one ``DeltaPublisher.publish`` call committed (global totals across ranks)."""

    version: int
    kind: str  # "delta" or "full"
    base_version: int | None
    tensors_changed: int
    changed_bytes: int
    total_bytes: int
    wire_bytes: int  # bytes of shard files written for this version

    @property
    def density(self) -> float:
        """Share of the model's bytes that changed (0.0 to 1.0)."""
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


def record(
    metrics: dict[str, float], result: PublishResult, *, tensors: int, world: int
) -> dict[str, float]:
    figures = {**asdict(result), "full": float(result.kind == "full"), "density": result.density}
    metrics.update({k: figures[k] for k in METRIC_KEYS if k in figures}, tensors=tensors)
    metrics["world_size"] = world
    return metrics


def warn_if_dense(result: PublishResult) -> bool:
    """Log and warn (``RuntimeWarning``) for a version far denser than an RL step makes;
    returns whether it warned (callers warn once)."""
    if result.density <= HIGH_DENSITY:
        return False
    message = (
        f"weight_v{result.version:06d} changed {result.density:.0%} of the model's bytes; an "
        "RL step usually changes a few percent at most. Publishing the dtype the engines load "
        "(usually bf16, not fp32 master weights) gives far lower density: cast the tensors "
        "and seed from a base checkpoint in that dtype"
    )
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return True


def describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def rank_errors(items: Sequence[DiffReport | Written | Final], attribute: str = "error") -> str:
    return "; ".join(
        f"rank {item.rank}: {getattr(item, attribute)}"
        for item in items
        if getattr(item, attribute)
    )


def after_commit_error(where: str, finals: Sequence[Final]) -> DeltastoreError | None:
    """The error every rank raises after a commit (``where`` names the version), if any."""
    broken = rank_errors(finals, "advance_error")
    if broken:
        return SnapshotError(
            f"{where}, but advancing the snapshot failed on {broken}; restart every rank with "
            "resume=True"
        )
    hooks = rank_errors(finals, "hook_error")
    if hooks:
        return HookError(
            f"{where} but the post-write hook failed on {hooks}; fix the hook and run it "
            "again on those ranks before engines pull"
        )
    return None
