"""Engine side: the local checkpoint, applying versions, repair, fan-out, the HTTP server."""

from deltastore.pull.client import EndpointReply, fetch_state, pull_all
from deltastore.pull.fanout import GroupPullError
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.protocol import PullReply, PullRequest
from deltastore.pull.pull import pull_weights, verify_local
from deltastore.pull.repair import RepairSummary
from deltastore.pull.result import HostOutcome, PullResult

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
]
