"""Durability on local filesystems: fsync by path (files and directories alike)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import BinaryIO


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


def temp_path(path: str) -> str:
    """A fresh sibling temp name for ``path``: ``<name>.<token>.tmp``.

    Every temp-then-replace writer of deltastore uses this one scheme, so a leftover from a
    crash is recognisable by its suffix. (:func:`create_new_file`'s create-only temp file keeps
    its own ``.partial`` name: it is opened exclusively and never replaces anything.)
    """
    return f"{path}.{uuid.uuid4().hex[:12]}.tmp"


@contextlib.contextmanager
def atomic_writer(path: str, *, sync_dir: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at ``path`` only once complete, atomically and durably.

    Writes go to :func:`temp_path`; on a clean exit the temp file is fsynced and moved over
    ``path`` with ``os.replace`` (then the directory is fsynced, unless ``sync_dir`` is False
    because the caller makes the directory durable later, once for many files). On an
    exception the temp file is removed and ``path`` is untouched. A symbolic link at ``path``
    is replaced, not followed.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = temp_path(path)
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
    """Replace ``path`` with ``data`` atomically and durably (the file may exist or not).

    See :func:`atomic_writer`: readers see the old content or the new, never a mix;
    ``sync_dir=False`` leaves the directory fsync to the caller.
    """
    with atomic_writer(path, sync_dir=sync_dir) as fh:
        fh.write(data)
