"""Versions on fsspec filesystems: commit, listing, ranged reads, retries."""

from deltastore.storage.retry import RetryPolicy, is_transient
from deltastore.storage.store import PostWriteHook, PreReadHook, VersionStore, new_token

__all__ = [
    "PostWriteHook",
    "PreReadHook",
    "RetryPolicy",
    "VersionStore",
    "is_transient",
    "new_token",
]
