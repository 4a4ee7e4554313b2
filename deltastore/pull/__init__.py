"""Engine side: the local checkpoint, applying versions, repair, group pulls, the HTTP server
and its client (the modules: docs/architecture.md)."""

from deltastore.errors import GroupPullError
from deltastore.pull.client import EndpointReply, PullReply, PullRequest, fetch_state, pull_all
from deltastore.pull.local import LocalCheckpoint, wait_durable
from deltastore.pull.pull import pull_weights
from deltastore.pull.result import HostOutcome, PullResult, RepairSummary
from deltastore.pull.verify import verify_local

__all__ = [
    "EndpointReply",
    "GroupPullError",
    "HostOutcome",
    "LocalCheckpoint",
    "PullReply",
    "PullRequest",
    "PullResult",
    "RepairSummary",
    "fetch_state",
    "pull_all",
    "pull_weights",
    "verify_local",
    "wait_durable",
]
