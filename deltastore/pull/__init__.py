"""Engine side: the local checkpoint, applying versions, repair, fan-out, the HTTP server.

Modules: ``pull`` (``pull_weights``: recover, trust the state, plan, apply or reseed),
``source`` (stores, nearest first, hook, target), ``chain`` (resolving and planning),
``history`` (payloads and digests per tensor), ``apply`` (deltas in place, in read windows),
``fold`` (payloads in memory, undo), ``mapped`` (writable maps, private files), ``full``
(staged full versions), ``trusted`` (signatures before the first write), ``verify``
(digests, ``verify_local``), ``repair``, ``local`` (lock, state, the durability completed
after the reply), ``result`` (counters and results), ``fanout``, ``server``
(``deltastore serve``: rules, metrics), ``client`` and ``protocol`` (HTTP).
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
