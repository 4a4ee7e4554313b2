"""Hooks for POSIX shared filesystems (NFS, Lustre, FUSE mounts of object stores)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from deltastore.errors import HookError
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, parse_version_dir, version_dir_name
from deltastore.storage.durable import fsync_path

log = logging.getLogger("deltastore.hooks")

REFRESH_WAIT_ENV = "DELTASTORE_REFRESH_WAIT_S"


def posix_commit(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """Post-write hook: fsync every file of ``version_dir``, the directory and its parent (on
    a mount that uploads at close/fsync, the version is then visible before engines read it)."""
    del args, rollout_engines  # the reference signature; unused here
    version_dir = os.fspath(version_dir)
    if not os.path.isdir(version_dir):
        raise HookError(f"posix_commit: {version_dir} is not a directory")
    synced = 0
    try:
        for root, dirs, files in os.walk(version_dir):
            for name in sorted(files):
                fsync_path(os.path.join(root, name))
                synced += 1
            for name in dirs:
                fsync_path(os.path.join(root, name))
            fsync_path(root)
        fsync_path(os.path.dirname(os.path.abspath(version_dir)))
    except OSError as exc:
        raise HookError(f"posix_commit: syncing {version_dir} failed: {exc}") from exc
    log.info("posix_commit: synced %d files of %s", synced, version_dir)


def posix_refresh(delta_dir: str, target_version: int) -> bool:
    """Pre-read hook: revalidate ``delta_dir`` so attribute caches see new versions.

    Lists ``delta_dir``, reads the target's index (close-to-open consistency revalidates it),
    and only then lists the version directory and stats its shards: a mount that caches "not
    found" (s3fs-fuse, gcsfuse) caches nothing wrong. Waits up to ``DELTASTORE_REFRESH_WAIT_S``
    for the index; returns whether it is visible.
    """
    delta_dir = os.fspath(delta_dir)
    if target_version <= 0:
        return True
    wait_s = env_seconds(REFRESH_WAIT_ENV, 0.0)
    version_dir = os.path.join(delta_dir, version_dir_name(target_version))
    deadline = time.monotonic() + wait_s
    while True:
        data = None
        with contextlib.suppress(FileNotFoundError):  # no delta_dir, or no index yet
            if version_dir_name(target_version) in os.listdir(delta_dir):
                with open(os.path.join(version_dir, INDEX_NAME), "rb") as fh:
                    data = fh.read()
        if data is not None:
            _revalidate_shards(version_dir, data, target_version)
            return True
        if time.monotonic() >= deadline:
            log.info(
                "posix_refresh: %s has no committed weight_v%06d yet", delta_dir, target_version
            )
            return False
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _revalidate_shards(version_dir: str, index_bytes: bytes, version: int) -> None:
    os.listdir(version_dir)
    try:
        index = VersionIndex.from_json(index_bytes, version=version, source=version_dir)
    except Exception:
        return  # the pull that follows reports a malformed index with context
    for shard in index.shards():
        try:
            os.stat(os.path.join(version_dir, shard))
        except FileNotFoundError:
            log.warning("posix_refresh: %s/%s is not visible yet", version_dir, shard)


def env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment variable ``name`` (unset or empty: default)."""
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise HookError(f"{name}={raw!r} is not a number of seconds") from None


def version_of(version_dir: str) -> int:
    """The version number of a ``.../weight_vNNNNNN`` directory; HookError otherwise."""
    version = parse_version_dir(os.path.basename(os.path.normpath(os.fspath(version_dir))))
    if version is None or version < 1:
        raise HookError(f"{version_dir} is not a weight_vNNNNNN version directory")
    return version
