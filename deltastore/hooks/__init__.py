"""Built-in post-write and pre-read hooks, and loading a hook by import path.

Reference signatures: a post-write (commit) hook is ``hook(args, version_dir,
rollout_engines)``, called on the trainer after a version's files are written and before
engines are told to read it; a pre-read (refresh) hook is ``hook(delta_dir, target_version)``,
called on each engine host before it reads the version. Point the reference flags at them::

    --custom-update-weight-post-write-path deltastore.hooks.s3_commit
    --custom-pull-weights-pre-read-hook deltastore.hooks.s3_refresh

* :func:`posix_commit` / :func:`posix_refresh`: fsync, and revalidate NFS-style caches.
* :func:`s3_commit` / :func:`s3_refresh`, :func:`gcs_commit` / :func:`gcs_refresh` (and
  :func:`mirror_commit` / :func:`mirror_refresh` for any fsspec URL): mirror versions between
  local directories and the store named by ``DELTASTORE_REMOTE_URL``.
* :func:`load`: import a hook from ``"package.module.function"`` with clear errors.
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
