"""The post-write phase of a publish: the hook that makes a written version visible."""

from __future__ import annotations

import time
from collections.abc import Callable

from deltastore.hooks.context import publishing_rank
from deltastore.storage import VersionWriter


def run_post_write(
    writer: VersionWriter,
    post_write: Callable[[str], None] | None,
    rank: int,
    metrics: dict[str, float],
) -> BaseException | None:
    """Run ``post_write`` (else the store's own hook) for ``writer``'s version; returns its
    error.

    The error is returned, not raised, so every rank reports it through the finish
    collective instead of leaving its peers waiting there. Adds ``hook_s`` to ``metrics``.
    """
    begun = time.perf_counter()
    try:
        with publishing_rank(rank):
            if post_write is not None:
                post_write(writer.url)
            else:
                writer.after_write()
    except Exception as exc:
        return exc
    finally:
        metrics["hook_s"] = time.perf_counter() - begun
    return None
