"""Writable maps of the local safetensors files, each given its own regular file first.

In-place writes go through ``mmap``; a file that is a symbolic link or shares its inode with
another path (a dir cloned with ``cp -as`` or ``cp -al``, links into the base) is first
replaced by a verified private copy, so a write never reaches another host's dir or the base.
:func:`msync` is the one place mapped pages are flushed (tests wrap it to see the order of
flushes and state writes).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import sys
import threading
from collections.abc import Sequence

import numpy as np

from deltastore.codecs import ByteArray
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.pull.local import copy_verified
from deltastore.storage.durable import fsync_path

log = logging.getLogger("deltastore.pull")


_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23) if sys.platform == "linux" else None
"""madvise option that maps a range's pages writable in one call (Linux ≥ 5.14)."""
_populate = {"works": _POPULATE_WRITE is not None}


def prefault(mm: mmap.mmap, start: int, end: int) -> None:
    """Map bytes ``[start, end)`` of ``mm`` writable in one call, where the OS allows it.

    A write into a shared map otherwise takes two page faults per 4 KiB page (read, then
    write). Only pages about to be written are populated: a page made writable is dirty and
    is written back by the next msync.
    """
    if _POPULATE_WRITE is None or not _populate["works"] or end <= start:
        return
    begin = start - start % mmap.PAGESIZE
    try:
        mm.madvise(_POPULATE_WRITE, begin, end - begin)
    except (OSError, ValueError):
        _populate["works"] = False  # an older kernel: plain faults from now on


def msync(mm: mmap.mmap, path: str) -> None:
    """Flush a map's dirty pages to ``path`` (msync); an ``os.fsync`` of the file follows."""
    del path  # named for the callers' logs and the durability-order test
    mm.flush()


def own_regular_file(path: str) -> None:
    """Make ``path`` a regular file with one link (see the module docstring), replaced by a
    verified copy that is durable (file and directory fsynced) before this returns."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        log.warning("%s is a symbolic link; copying its target before writing it in place", path)
    elif info.st_nlink > 1:
        log.warning("%s has other hard links; copying it before writing it in place", path)
    else:
        return
    copy_verified(path, path)
    fsync_path(os.path.dirname(path))


class MappedFiles:
    """Writable mmaps of the local safetensors files, opened lazily and flushed together; as
    a context manager, closed on exit (flushing is the caller's explicit step)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> MappedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _map(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                own_regular_file(path)
                # O_NOFOLLOW: never write through a link, even one that appeared since.
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                self._maps[path] = (fd, mmap.mmap(fd, 0))
            return self._maps[path][1]

    def view(self, tensor: CheckpointTensor) -> ByteArray:
        """A writable view of ``tensor``'s bytes in its file (made private first)."""
        return np.frombuffer(
            self._map(tensor.file),
            dtype=np.uint8,
            count=tensor.entry.nbytes,
            offset=tensor.entry.start,
        )

    def array(self, path: str) -> ByteArray:
        """A writable view of the whole file (codecs applying a batch take offsets into it)."""
        return np.frombuffer(self._map(path), dtype=np.uint8)

    def prepare_writes(self, tensors: Sequence[CheckpointTensor]) -> None:
        """Map the pages of ``tensors`` (about to be written whole) writable, one call per run
        of adjacent tensors in a file (see :func:`prefault`)."""
        runs: list[tuple[str, int, int]] = []
        for tensor in sorted(tensors, key=lambda t: (t.file, t.entry.start)):
            start, end = tensor.entry.start, tensor.entry.end
            if runs and runs[-1][0] == tensor.file and start - runs[-1][2] < mmap.PAGESIZE:
                runs[-1] = (tensor.file, runs[-1][1], max(end, runs[-1][2]))
            else:
                runs.append((tensor.file, start, end))
        for path, start, end in runs:
            prefault(self._map(path), start, end)

    def flush(self) -> None:
        """msync, then fsync, every mapped file: the data is durable before any state names it."""
        for path, (fd, mm) in self._maps.items():
            msync(mm, path)
            os.fsync(fd)

    def close(self) -> None:
        """Unmap and close every file (without flushing)."""
        for fd, mm in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
            os.close(fd)
        self._maps.clear()
