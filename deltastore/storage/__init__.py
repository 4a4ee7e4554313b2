"""Versions on fsspec filesystems: the version-writing transaction, listing, ranged reads,
retries, prune."""

from deltastore.storage.backends import RetryPolicy, is_transient
from deltastore.storage.prune import PruneReport
from deltastore.storage.store import (
    PostWriteHook,
    PreReadHook,
    StoreListing,
    VersionStore,
    new_token,
    store_objects,
)
from deltastore.storage.streams import DownloadSink
from deltastore.storage.writer import VersionWriter

__all__ = [
    "DownloadSink",
    "PostWriteHook",
    "PreReadHook",
    "PruneReport",
    "RetryPolicy",
    "StoreListing",
    "VersionStore",
    "VersionWriter",
    "is_transient",
    "new_token",
    "store_objects",
]
