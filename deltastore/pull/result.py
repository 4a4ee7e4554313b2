"""What a pull reports: :class:`PullResult` on one host, :class:`HostOutcome` per group rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltastore.pull.repair import RepairSummary


@dataclass(frozen=True)
class HostOutcome:
    """One rank's outcome in a group pull (plain values: it crosses process boundaries)."""

    rank: int
    host: str
    local_dir: str
    success: bool
    message: str
    version: int | None = None
    action: str | None = None

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, {self.local_dir}): {self.message}"


@dataclass(frozen=True)
class PullResult:
    """What one :func:`~deltastore.pull.pull_weights` call did."""

    version: int
    """The version the local checkpoint now holds (verified)."""
    action: str
    """``noop``, ``applied`` (deltas on top of what was there), ``reseeded`` or ``repaired``
    (an interrupted transition was completed and nothing else was needed)."""
    versions_applied: list[int] = field(default_factory=list)
    tensors_applied: int = 0
    bytes_read: int = 0
    """Bytes read from the store (the wire bytes: compressed payloads, a full version's
    shards, index files are not counted)."""
    seconds: float = 0.0
    plan: str = ""
    """The plan that was followed (versions, bytes to move), as logged."""
    repair: RepairSummary | None = None
    """Set when an interrupted transition was found and repaired."""
    payloads_read: int = 0
    """Delta payloads read: one per changed tensor per version."""
    group: tuple[HostOutcome, ...] = ()
    """Every rank's outcome when the pull ran across a process group."""
    bytes_reconstructed: int = 0
    """Bytes of local tensors written (patched, restored or copied in by a reseed)."""
    tensors_skipped: int = 0
    """Tensors of the local checkpoint this pull left as they were (unchanged by every
    version it applied)."""
    reseeds: int = 0
    """1 when the pull reseeded (from the base or a full version), else 0."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Where the time went: ``prepare`` (repair, checks, plan, preflight), ``reseed`` and
    ``apply`` (the deltas); phases that did not run are absent."""

    @property
    def wire_bytes(self) -> int:
        """``bytes_read`` under the name the publisher's metrics use."""
        return self.bytes_read

    @property
    def message(self) -> str:
        repaired = f"{self.repair.describe()}; " if self.repair is not None else ""
        if self.action == "noop":
            return f"{repaired}already at v{self.version:06d}"
        return (
            f"{repaired}{self.action} to v{self.version:06d} ({len(self.versions_applied)} "
            f"version(s), {self.tensors_applied} tensors, {self.bytes_read} bytes read, "
            f"{self.seconds:.2f} s)"
        )
