"""What a publish reports: :class:`PublishResult` and the keys of ``pop_metrics()``."""

from __future__ import annotations

from dataclasses import dataclass

from deltastore.publish.messages import Outcome, Plan

METRIC_KEYS = (
    "version", "full", "density", "changed_bytes", "total_bytes", "wire_bytes",
    "tensors_changed", "tensors", "world_size", "load_s", "copy_s", "encode_s", "diff_s",
    "write_s", "commit_s", "coord_s", "hook_s", "publish_s",
)  # fmt: skip
"""Keys of ``DeltaPublisher.pop_metrics``; docs/publishing.md gives each one's unit."""
SECONDS_KEYS = tuple(k for k in METRIC_KEYS if k.endswith("_s"))


@dataclass(frozen=True)
class PublishResult:
    """What one ``DeltaPublisher.publish`` call committed (global totals across ranks)."""

    version: int
    kind: str
    """``delta`` or ``full``."""
    base_version: int | None
    tensors_changed: int
    changed_bytes: int
    total_bytes: int
    wire_bytes: int
    """Bytes of shard files written for this version."""

    @property
    def density(self) -> float:
        """Share of the model's bytes that changed (0.0 to 1.0)."""
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


def result_of(plan: Plan, outcome: Outcome) -> PublishResult:
    """The result of a committed version from its plan and outcome."""
    assert plan.layout is not None and outcome.totals is not None
    totals = outcome.totals
    return PublishResult(
        version=plan.version,
        kind="full" if plan.layout.full else "delta",
        base_version=totals.base_version,
        tensors_changed=totals.tensors_changed,
        changed_bytes=totals.changed_bytes,
        total_bytes=totals.total_bytes,
        wire_bytes=totals.wire_bytes,
    )
