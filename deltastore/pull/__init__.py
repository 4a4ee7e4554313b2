"""Engine side: the local checkpoint, applying versions, repair, fan-out, the HTTP server.

Modules: ``pull`` (``pull_weights``), ``source`` (store, hook, target), ``recover``
(interrupted transitions, trusting the state), ``chain`` (resolving and planning), ``apply``
(deltas in place), ``fold`` (payloads in memory, undo), ``history`` (payloads per tensor),
``mapped`` (writable maps, private files), ``full`` (staged full versions), ``verify``
(digests, ``verify_local``), ``repair``, ``local`` (lock, state), ``completion`` (a
catch-up made durable after the reply), ``stats``, ``fanout``,
``result``, ``server``/``client``/``protocol`` (HTTP).
"""

from deltastore.errors import GroupPullError
from deltastore.pull.client import EndpointReply, fetch_state, pull_all
from deltastore.pull.completion import wait_durable
from deltastore.pull.local import LocalCheckpoint
from deltastore.pull.protocol import PullReply, PullRequest
from deltastore.pull.pull import pull_weights
from deltastore.pull.repair import RepairSummary
from deltastore.pull.result import HostOutcome, PullResult
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
