"""Engine side: the local checkpoint, applying versions, verification."""

from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.pull import PullResult, pull_weights, verify_local

__all__ = ["LocalCheckpoint", "PullResult", "pull_weights", "verify_local"]
