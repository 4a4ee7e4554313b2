"""Built-in post-write and pre-read hooks, and loading a hook by import path (docs/hooks.md).

A post-write (commit) hook is ``hook(args, version_dir, rollout_engines)``, called on the
trainer after a version's files are written; a pre-read (refresh) hook is ``hook(delta_dir,
target_version)``, called on each engine host before it reads the version. Built-ins:
``posix_*`` (fsync; revalidate NFS-style caches) and ``s3_*`` / ``gcs_*`` / ``mirror_*`` (mirror
versions between local directories and the store named by ``DELTASTORE_REMOTE_URL``).
"""

from deltastore.hooks.loader import POST_WRITE, PRE_READ, check_arity, load
from deltastore.hooks.mirror import (
    gcs_commit,
    gcs_refresh,
    mirror_commit,
    mirror_from_store,
    mirror_refresh,
    mirror_to_store,
    s3_commit,
    s3_refresh,
)
from deltastore.hooks.posix import posix_commit, posix_refresh

__all__ = [
    "POST_WRITE",
    "PRE_READ",
    "check_arity",
    "gcs_commit",
    "gcs_refresh",
    "load",
    "mirror_commit",
    "mirror_from_store",
    "mirror_refresh",
    "mirror_to_store",
    "posix_commit",
    "posix_refresh",
    "s3_commit",
    "s3_refresh",
]
