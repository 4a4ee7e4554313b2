"""What a replication run did: one record per version, a summary, and the settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicationPolicy:
    """Timings of a replicator. The defaults suit object stores across datacenters."""

    poll_min_s: float = 1.0
    """``follow``: first wait after a round that found nothing new (jittered, doubling)."""
    poll_max_s: float = 30.0
    """``follow``: longest wait between two looks at the source."""
    stale_claim_s: float = 60.0
    """A destination claim with no activity for this long belongs to a replicator that died:
    this one resumes it with its token. Taking a live but slow writer (an object store shows
    an upload only once it completes) for dead costs a duplicate transfer of the same bytes,
    never a wrong version."""
    prune_grace_s: float = 3600.0
    """``prune_like_source``: how long an unpublished destination version keeps its data, so a
    reader in the middle of a pull is not cut off (as ``deltastore prune --grace``)."""
    attempts: int = 5
    """Tries of one version (a failed try is aborted, leaving nothing visible) before a
    one-shot run gives up; ``follow`` keeps trying after a backoff."""
    chunk_bytes: int | None = None
    """Bytes per ranged read and write; None: the destination store's block size."""


@dataclass(frozen=True)
class VersionCopy:
    """One version handled by a replicator (a line of ``deltastore replicate --json``)."""

    version: int
    kind: str  # full or delta
    outcome: str
    """``copied`` (this replicator committed it) or ``present`` (another writer committed the
    same index first)."""
    bytes: int
    files: int
    seconds: float
    retries: int
    """Shard or version tries that failed and were repeated."""
    verified_tensors: int = 0
    """Tensors whose digest ``verify`` recomputed from their bytes (full versions)."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "kind": self.kind,
            "outcome": self.outcome,
            "bytes": self.bytes,
            "files": self.files,
            "seconds": round(self.seconds, 4),
            "mb_per_s": round(self.mb_per_s, 2),
            "retries": self.retries,
            "verified_tensors": self.verified_tensors,
        }


@dataclass(frozen=True)
class ReplicationReport:
    """The outcome of :func:`deltastore.replicate` (of every round, with ``follow``)."""

    src: str
    dst: str
    versions: tuple[VersionCopy, ...]
    skipped: tuple[int, ...]
    """Source versions not copied: below the start (``from_version``), older than the newest
    destination version (never inserted behind it), or whose chain the destination cannot
    hold."""
    pruned: tuple[int, ...]
    """Destination versions unpublished because the source no longer lists them."""
    seconds: float
    latest: int  # the destination's newest committed version at the end

    @property
    def copied(self) -> tuple[int, ...]:
        return tuple(v.version for v in self.versions if v.outcome == "copied")

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.versions if v.outcome == "copied")

    @property
    def retries(self) -> int:
        return sum(v.retries for v in self.versions)

    def as_dict(self) -> dict[str, object]:
        """The summary line of ``--json``."""
        return {
            "summary": True,
            "src": self.src,
            "dst": self.dst,
            "copied": list(self.copied),
            "present": [v.version for v in self.versions if v.outcome == "present"],
            "skipped": list(self.skipped),
            "pruned": list(self.pruned),
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "mb_per_s": round(self.bytes / 1e6 / self.seconds, 2) if self.seconds > 0 else 0.0,
            "retries": self.retries,
            "latest": self.latest,
        }


class Observer:
    """Hooks a caller (the CLI's progress bar, ``--json``) overrides; each does nothing here.

    Called from the replicator's threads; ``advanced`` from several at once.
    """

    def version_started(self, version: int, total_bytes: int) -> None:
        """``total_bytes``: the sum of its files."""

    def advanced(self, version: int, nbytes: int) -> None:
        """``nbytes`` more bytes of ``version`` landed (negative: a failed try rolled back)."""

    def version_done(self, record: VersionCopy) -> None:
        """Committed at the destination (by this replicator or another)."""

    def idle(self, latest: int) -> None:
        """``follow``: a round found nothing new; the destination is at ``latest``."""
