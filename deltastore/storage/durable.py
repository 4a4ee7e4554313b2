"""Durability on local filesystems: fsync by path (files and directories alike)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import BinaryIO


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path (a rename or link is durable only once its
    directory is fsynced too; fsspec never does either)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new_file(path: str, data: bytes) -> None:
    """Create ``path`` holding ``data`` only if it does not exist, atomically and durably: a
    fsynced sibling temp file is linked into place (``os.link`` fails if the target exists), so
    of racing writers exactly one wins (the others get ``FileExistsError``). fsspec's local
    create mode checks, then writes: it races."""
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


@contextlib.contextmanager
def atomic_writer(path: str, *, sync_dir: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` only once complete, atomically and durably.

    Writes go to a sibling ``<name>.<token>.tmp`` (the one temp-then-replace scheme, so a crash's
    leftover is recognisable), fsynced and moved over ``path`` on a clean exit (then the
    directory is fsynced, unless the caller does that later, once for many files: ``sync_dir``
    False). On an exception ``path`` is untouched. A symbolic link at ``path`` is replaced.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "xb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_path(directory)


def atomic_replace(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see :func:`atomic_writer`)."""
    with atomic_writer(path, sync_dir=sync_dir) as fh:
        fh.write(data)
