"""Rank coordination for a collective publish: small Python objects over a process group.

Every decision travels through the process group, never through the store's filesystem (a
shared filesystem or object store is neither ordered nor fast enough to be a lock).
:class:`LocalCoordinator` is the single process (every collective is the identity), so the
publisher runs one code path whether or not ``torch.distributed`` is up; :class:`TorchCoordinator`
uses torch's object collectives on a gloo group, so coordination never touches a GPU stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from deltastore.errors import ConfigError, PublishError

log = logging.getLogger("deltastore.publish")

T = TypeVar("T")


class Coordinator(Protocol):
    """The collectives a publisher needs; every rank of the group calls each one, in order.
    ``gather`` returns every rank's ``obj`` (in rank order) on rank 0 and None elsewhere,
    ``broadcast`` rank 0's on every rank, ``all_gather`` every rank's on every rank."""

    rank: int
    world_size: int

    def gather(self, obj: T, *, what: str) -> list[T] | None: ...

    def broadcast(self, obj: T | None, *, what: str) -> T: ...

    def all_gather(self, obj: T, *, what: str) -> list[T]: ...


class LocalCoordinator:
    """One process, no group: every collective returns its own argument."""

    rank = 0
    world_size = 1

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        return [obj]

    def broadcast(self, obj: T | None, *, what: str) -> T:
        assert obj is not None
        return obj

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        return [obj]


class TorchCoordinator:
    """Object collectives over the trainer's ``group`` (None: the default group).

    If its backend is not gloo, a gloo group over the same ranks is created here:
    ``torch.distributed.new_group`` is itself a collective of the default group, so every rank
    must construct the publisher together. Collective failures (a peer died, a timeout) raise
    :class:`PublishError` naming the step.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                "a process group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first"
            )
        self._dist = dist
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo":
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            log.info("creating a gloo group for publish coordination (trainer group: %s)", backend)
            group = dist.new_group(ranks=ranks, backend="gloo")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Object collectives take the *global* rank of the source/destination.
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def _call(self, what: str, collective: Callable[..., Any], *args: Any, **kw: Any) -> None:
        try:
            collective(*args, group=self.group, **kw)
        except RuntimeError as exc:
            raise PublishError(
                f"rank {self.rank}: the collective step '{what}' failed ({type(exc).__name__}: "
                f"{exc}); a peer rank died or timed out. Check store.latest() and restart every "
                "rank with resume=True"
            ) from exc

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._call(what, self._dist.gather_object, obj, out, dst=self._root)
        return out

    def broadcast(self, obj: T | None, *, what: str) -> T:
        box: list[Any] = [obj if self.rank == 0 else None]
        self._call(what, self._dist.broadcast_object_list, box, src=self._root)
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._call(what, self._dist.all_gather_object, out, obj)
        return out


def make_coordinator(process_group: Any = None, *, collective: bool | None = None) -> Coordinator:
    """``collective=None``: collective when a ``process_group`` is given or
    ``torch.distributed`` is initialised with more than one rank; ``False``: alone (e.g. one
    rank that publishes alone); ``True``: a group is required."""
    if collective is False:
        return LocalCoordinator()
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        dist = None  # type: ignore[assignment]
    available = dist is not None and dist.is_available() and dist.is_initialized()
    if process_group is not None or collective:
        if not available:
            raise ConfigError(
                "a collective publish (process_group or collective=True) needs torch.distributed, "
                "which is not initialised; call torch.distributed.init_process_group first"
            )
        return TorchCoordinator(process_group)
    if available and dist.get_world_size() > 1:
        return TorchCoordinator(None)
    return LocalCoordinator()
