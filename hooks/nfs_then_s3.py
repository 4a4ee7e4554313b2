"""Example: chaining built-in hooks for a trainer that writes to NFS and also mirrors to S3.

The trainer's ``--update-weight-disk-dir`` is an NFS export its own datacenter's engines read;
engines in another datacenter read an S3 bucket. One post-write hook does both: fsync on NFS
first (so local engines see complete files), then mirror to the bucket. An engine host in the
remote datacenter uses :func:`refresh`, which mirrors the bucket into its local directory.

    export DELTASTORE_REMOTE_URL=s3://bucket/run1            # both sides
    --custom-update-weight-post-write-path hooks.nfs_then_s3.commit
    --custom-pull-weights-pre-read-hook hooks.nfs_then_s3.refresh

Copy this file and swap in ``gcs_commit`` / ``gcs_refresh`` for a ``gs://`` bucket.
"""

from __future__ import annotations

from typing import Any

from deltastore.hooks import posix_commit, posix_refresh, s3_commit, s3_refresh


def commit(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """Post-write hook: make the version durable on NFS, then mirror it to S3 (index last)."""
    posix_commit(args, version_dir, rollout_engines)
    s3_commit(args, version_dir, rollout_engines)


def refresh(delta_dir: str, target_version: int) -> None:
    """Pre-read hook: mirror the target's chain from S3, then revalidate the local directory."""
    s3_refresh(delta_dir, target_version)
    posix_refresh(delta_dir, target_version)
