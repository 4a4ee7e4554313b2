"""What the publisher tells hooks about the call in progress.

The reference hook signature ``hook(args, version_dir, rollout_engines)`` carries no group: a
hook that must act on one rank only (the mirror hooks upload once) cannot tell which rank of a
*publishing* group it runs on when that group is not the whole world. The publisher sets its
rank within the publishing group here while it runs the post-write hook.
"""

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
    """The publishing group rank set by the publisher, or None outside a publish."""
    return _publishing_rank.get()
