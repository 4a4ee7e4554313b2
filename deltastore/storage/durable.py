"""Durability on local filesystems: fsync by path (files and directories alike)."""

from __future__ import annotations

import contextlib
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


def atomic_replace(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (the file may exist or not).

    ``data`` goes to a sibling temp file ``<name>.<token>.tmp``, which is fsynced, moved over
    ``path`` with ``os.replace`` and made durable with an fsync of the directory. Readers see
    the old content or the new, never a mix; ``path`` itself is never written through (a
    symbolic link at ``path`` is replaced, not followed).
    """
    directory = os.path.dirname(path) or "."
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(directory)
