"""Pulling on every rank of an engine's torch.distributed group.

Every rank calls :func:`~deltastore.pull.pull_weights` with its own host's local checkpoint dir.
Ranks on one host share that dir, so the per-host ``flock`` collapses them to one apply (the
others find the state at the target: a no-op). Each rank's outcome is then gathered over the
group (``all_gather_object``): the pull succeeds on every rank only if every host verified its
checkpoint, and otherwise raises :class:`GroupPullError` on every rank, naming each failed
rank, its host and its dir.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

from deltastore.errors import ConfigError, GroupPullError
from deltastore.pull.result import HostOutcome, PullResult

log = logging.getLogger("deltastore.pull")


def resolve_group(process_group: Any) -> Any | None:
    """The process group to gather over, or None: ``None``/``False`` none, ``"auto"`` the
    default group when torch.distributed is initialised, ``True``/``"world"`` the default group
    (must be initialised), anything else a ``ProcessGroup``. Opt-in, because a collective
    called from only some ranks of an initialised group would wait forever."""
    if process_group is None or process_group is False:
        return None
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if isinstance(process_group, str) or process_group is True:
        if process_group not in ("auto", "world", True):
            raise ConfigError(
                f"process_group={process_group!r}: pass a ProcessGroup, 'world', 'auto' or None"
            )
        if not initialised:
            if process_group == "auto":
                return None
            raise ConfigError(
                "process_group='world' but torch.distributed is not initialised; call "
                "init_process_group first or pass process_group=None"
            )
        return dist.group.WORLD
    if not initialised:
        raise ConfigError("a process group was given but torch.distributed is not initialised")
    return process_group


def pull_in_group(
    group: Any, pull: Callable[[], PullResult], *, local_dir: str, target_version: int
) -> PullResult:
    """Run ``pull`` on this rank, gather every rank's outcome (one rank's exception never
    skips the collective), and raise :class:`GroupPullError` on every rank when any failed
    (chained to the local error on the failing rank)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    host = socket.gethostname()
    result: PullResult | None = None
    error: Exception | None = None
    try:
        result = pull()
        mine = HostOutcome(
            rank, host, local_dir, True, result.message, result.version, result.action
        )
    except Exception as exc:  # every rank must reach the gather below
        error = exc
        mine = HostOutcome(rank, host, local_dir, False, f"{type(exc).__name__}: {exc}")
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dataclasses.asdict(mine), group=group)
    outcomes = [HostOutcome(**o) for o in gathered]
    failed = [o for o in outcomes if not o.success]
    if failed:
        message = (
            f"pull of v{target_version:06d} failed on {len(failed)} of {len(outcomes)} rank(s): "
            + "; ".join(o.describe() for o in failed)
        )
        raise GroupPullError(message, outcomes) from error
    assert result is not None
    hosts = {(o.host, o.local_dir) for o in outcomes}
    log.info(
        "v%06d verified on all %d rank(s) (%d host dir(s))",
        target_version,
        len(outcomes),
        len(hosts),
    )
    return dataclasses.replace(result, group=tuple(outcomes))
