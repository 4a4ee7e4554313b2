"""Store-to-store replication of committed versions, in order, through the destination's
version-writing transaction (``deltastore replicate``)."""

from deltastore.replicate.replicator import replicate
from deltastore.replicate.report import (
    Observer,
    ReplicationPolicy,
    ReplicationReport,
    VersionCopy,
)

__all__ = ["Observer", "ReplicationPolicy", "ReplicationReport", "VersionCopy", "replicate"]
