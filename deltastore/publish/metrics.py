"""What a publish reports: :class:`PublishResult` and the keys of ``pop_metrics()``."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from deltastore.publish.messages import Outcome, Plan

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

log = logging.getLogger("deltastore.publish")


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


def record(
    metrics: dict[str, float], result: PublishResult, *, tensors: int, world: int
) -> dict[str, float]:
    """``metrics`` (the phase timings) completed with the result's figures."""
    metrics.update(
        version=result.version,
        full=1.0 if result.kind == "full" else 0.0,
        density=result.density,
        changed_bytes=result.changed_bytes,
        total_bytes=result.total_bytes,
        wire_bytes=result.wire_bytes,
        tensors_changed=result.tensors_changed,
        tensors=tensors,
        world_size=world,
    )
    return metrics


def warn_if_dense(result: PublishResult) -> bool:
    """Log and warn (``RuntimeWarning``) when a version is far denser than an RL step makes,
    saying why that usually is; returns whether it warned (callers warn once)."""
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
