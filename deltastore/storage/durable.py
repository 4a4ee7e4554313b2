"""Durability on local filesystems: fsync by path (files and directories alike)."""

from __future__ import annotations

import os
import uuid


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path.

    A rename or link is durable only once its directory is fsynced too; fsspec never does
    either, so every local writer of deltastore calls this.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new_file(path: str, data: bytes) -> None:
    """Create ``path`` holding ``data`` only if it does not exist, atomically and durably.

    A finished, fsynced sibling temp file is linked into place (``os.link`` fails if the target
    exists), so readers never see a partial file and of racing writers exactly one wins (the
    others get ``FileExistsError``). fsspec's local create mode checks, then writes: it races.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    with open(tmp, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    fsync_path(directory)
