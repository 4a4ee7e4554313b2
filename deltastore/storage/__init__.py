"""Versions on fsspec filesystems: commit, listing, ranged reads, retries, prune."""

from deltastore.storage.prune import PruneReport
from deltastore.storage.retry import RetryPolicy, is_transient
from deltastore.storage.store import (
    PostWriteHook,
    PreReadHook,
    StoreListing,
    VersionStore,
    new_token,
)

__all__ = [
    "PostWriteHook",
    "PreReadHook",
    "PruneReport",
    "RetryPolicy",
    "StoreListing",
    "VersionStore",
    "is_transient",
    "new_token",
]
