"""Engine side: the local checkpoint, applying versions, repair, fan-out, the HTTP server.

Modules: ``pull`` (``pull_weights``, group pulls), ``source`` (stores, nearest first),
``chain`` (resolving, planning, per-tensor history), ``apply`` (deltas in place), ``full``
(staged full versions), ``verify`` (digests, signatures first), ``repair``, ``local`` (lock,
state, maps, durability after the reply), ``result``, ``server`` and ``client`` (HTTP).
"""

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
