"""Rank coordination for a collective publish: small Python objects over a process group.

A :class:`Coordinator` is what :class:`~deltastore.publish.DeltaPublisher` uses to agree across
trainer ranks: ``gather`` to rank 0, ``broadcast`` from rank 0, ``all_gather``. Every decision
travels through the process group, never through the store's filesystem (a shared filesystem
or object store is neither ordered nor fast enough to be a lock).

:class:`LocalCoordinator` is the single-process case (every collective is the identity), so the
publisher runs one code path whether or not ``torch.distributed`` is up. :class:`TorchCoordinator`
uses torch's object collectives (pickled objects) on a gloo group: when the trainer's group is
NCCL, a gloo group over the same ranks is created once, so coordination never touches a GPU
stream.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeVar

from deltastore.errors import ConfigError, PublishError

log = logging.getLogger("deltastore.publish")

T = TypeVar("T")


class Coordinator(Protocol):
    """The collectives a publisher needs. Every rank of the group must call each one, in order."""

    rank: int
    world_size: int

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the other ranks."""
        ...

    def broadcast(self, obj: T | None, *, what: str) -> T:
        """Rank 0's ``obj`` on every rank (the argument is ignored on the other ranks)."""
        ...

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        """Every rank's ``obj`` on every rank, in rank order."""
        ...


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
    """Object collectives over a ``torch.distributed`` process group (gloo).

    ``group`` is the trainer's group (None: the default group). If its backend is not gloo, a
    gloo group over the same ranks is created here: ``torch.distributed.new_group`` is itself a
    collective of the default group, so every rank must construct the publisher together.
    Collective failures (a peer died, a timeout) raise :class:`PublishError` naming the step.
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

    def _fail(self, what: str, exc: BaseException) -> PublishError:
        return PublishError(
            f"rank {self.rank}: the collective step '{what}' failed ({type(exc).__name__}: "
            f"{exc}); a peer rank died or timed out. Check store.latest() and restart every "
            "rank with resume=True"
        )

    def gather(self, obj: T, *, what: str) -> list[T] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            self._dist.gather_object(obj, out, dst=self._root, group=self.group)
        except RuntimeError as exc:
            raise self._fail(what, exc) from exc
        return out

    def broadcast(self, obj: T | None, *, what: str) -> T:
        box: list[Any] = [obj if self.rank == 0 else None]
        try:
            self._dist.broadcast_object_list(box, src=self._root, group=self.group)
        except RuntimeError as exc:
            raise self._fail(what, exc) from exc
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T, *, what: str) -> list[T]:
        out: list[Any] = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise self._fail(what, exc) from exc
        return out


def make_coordinator(process_group: Any = None, *, collective: bool | None = None) -> Coordinator:
    """The coordinator for a publisher.

    ``collective=None`` (the default) means: collective when a ``process_group`` is given or
    ``torch.distributed`` is initialised with more than one rank; ``False`` forces the
    single-process behaviour (e.g. one rank that publishes alone); ``True`` requires a group.
    """
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
