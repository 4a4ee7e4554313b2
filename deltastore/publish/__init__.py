"""Trainer side: the snapshot, the diff pipeline and ``DeltaPublisher``."""

from deltastore.errors import SnapshotError
from deltastore.publish.config import PublisherConfig
from deltastore.publish.messages import METRIC_KEYS, PublishResult
from deltastore.publish.publisher import DeltaPublisher
from deltastore.publish.snapshot import Snapshot

__all__ = [
    "METRIC_KEYS",
    "DeltaPublisher",
    "PublishResult",
    "PublisherConfig",
    "Snapshot",
    "SnapshotError",
]
