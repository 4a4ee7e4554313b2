"""Trainer side: the snapshot, the diff pipeline and ``DeltaPublisher``."""

from deltastore.publish.publisher import METRIC_KEYS, DeltaPublisher, PublishResult
from deltastore.publish.snapshot import Snapshot

__all__ = ["METRIC_KEYS", "DeltaPublisher", "PublishResult", "Snapshot"]
