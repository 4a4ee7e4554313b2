"""Durability on local filesystems: fsync by path (files and directories alike)."""

from __future__ import annotations

import os


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
