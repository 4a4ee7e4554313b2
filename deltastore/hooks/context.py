"""The publisher's rank within its publishing group, for the post-write hook it runs: the
reference signature carries no group, and a hook that acts on one rank only (the mirror hooks
upload once) must know it when that group is not the whole world."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_publishing_rank: ContextVar[int | None] = ContextVar("deltastore_publishing_rank", default=None)


@contextlib.contextmanager
def publishing_rank(rank: int) -> Iterator[None]:
    """Within the block, hooks see ``rank`` as the caller's rank in the publishing group."""
    token = _publishing_rank.set(rank)
    try:
        yield
    finally:
        _publishing_rank.reset(token)


def current_publishing_rank() -> int | None:
    """None outside a publish."""
    return _publishing_rank.get()
