"""The host-local checkpoint: per-host lock, applied state, pending record, seeding copies,
and a catch-up's durability completed after the pull replies.

A catch-up's tensors are verified in the mapped files (the page cache the engine reloads
from) before :func:`~deltastore.pull.pull_weights` returns. Flushing them, then writing the
new state and clearing the pending record, may run after the reply on one kept thread that
holds the host's lock until all three are done (:func:`complete_behind`): until then the
pending record stays and no state names either version, so a crash in between is repaired by
the next pull, as for a crash mid-apply. In this process the next pull of the dir,
:func:`~deltastore.pull.verify_local` and the state reads wait for the completion first
(another process waits on the lock); a process that exits waits for its completions.

In-place writes go through ``mmap`` (:class:`MappedFiles`); a file that is a symbolic link or
has other hard links (``cp -as``, ``cp -al``, links into the base) is first replaced by a
verified private copy, so a write never reaches another dir. :func:`msync` is the one place
mapped pages are flushed (tests wrap it to see the order of flushes and state writes).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import mmap
import os
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash

from deltastore.codecs import ByteArray
from deltastore.errors import FormatError, IntegrityError, LockTimeoutError
from deltastore.format.checkpoint import CheckpointTensor
from deltastore.format.names import INDEX_NAME, LOCK_NAME, PENDING_NAME, STATE_DIR, STATE_NAME
from deltastore.format.state import AppliedState, PendingTransition
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.pull.result import ApplyStats, kept_pool
from deltastore.storage import VersionStore
from deltastore.storage.durable import atomic_replace, fsync_path

log = logging.getLogger("deltastore.pull")
_Record = TypeVar("_Record", AppliedState, PendingTransition)

COPY_CHUNK = 16 * 1024**2


def _reflink(src: str, dst: str) -> bool:
    """Copy-on-write clone (FICLONE) where the filesystem supports it; False otherwise."""
    ficlone = 0x40049409  # _IOW(0x94, 9, int) on Linux
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), ficlone, s.fileno())
        return True
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        return False


def synced_digest(path: str) -> bytes:
    """fsync ``path``, then hash it as read back (xxh3-128): what a copy must match."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
        while chunk := fh.read(COPY_CHUNK):
            hasher.update(chunk)
    return hasher.digest()


def copy_verified(src: str, dst: str, on_read: Callable[[int], None] | None = None) -> None:
    """Copy a file (never a hard link: the source must stay untouched), hashing the source as
    it is read (``on_read(n)`` told of each chunk) and the copy again after an fsync;
    :class:`IntegrityError` on a mismatch."""
    tmp = f"{dst}.{uuid.uuid4().hex[:12]}.tmp"  # as atomic_replace names its temp files
    source_hash = xxhash.xxh3_128()
    try:
        cloned = _reflink(src, tmp)
        with open(src, "rb") as fin, contextlib.ExitStack() as stack:
            fout = None if cloned else stack.enter_context(open(tmp, "wb"))
            while chunk := fin.read(COPY_CHUNK):
                source_hash.update(chunk)
                if fout is not None:
                    fout.write(chunk)
                if on_read is not None:
                    on_read(len(chunk))
        if synced_digest(tmp) != source_hash.digest():
            raise IntegrityError(
                f"copy of {src} to {dst} does not match its source; check the disk"
            )
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def same_dir(a: str, b: str) -> bool:
    """True when two paths name one directory (through symlinks or bind mounts too)."""
    with contextlib.suppress(OSError):  # (samefile of a path that does not exist)
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    return False


_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""madvise option that maps a range's pages writable in one call (Linux ≥ 5.14)."""
_populate = {"works": sys.platform == "linux"}


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


class MappedFiles(contextlib.AbstractContextManager["MappedFiles"]):
    """Writable mmaps of the local safetensors files, opened lazily and flushed together; as
    a context manager, closed on exit (flushing is the caller's explicit step)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _map(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                own_regular_file(path)
                # O_NOFOLLOW: never write through a link, even one that appeared since.
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    self._maps[path] = (fd, mmap.mmap(fd, 0))
                except BaseException:
                    os.close(fd)
                    raise
            return self._maps[path][1]

    def view(self, tensor: CheckpointTensor) -> ByteArray:
        """A writable view of ``tensor``'s bytes in its file (made private first)."""
        return self.array(tensor.file)[tensor.entry.start : tensor.entry.end]

    def array(self, path: str) -> ByteArray:
        """A writable view of the whole file (codecs applying a batch take offsets into it)."""
        return np.frombuffer(self._map(path), dtype=np.uint8)

    def prepare_writes(self, tensors: Sequence[CheckpointTensor]) -> None:
        """Map the pages of ``tensors`` (about to be written whole: each page is dirtied)
        writable, one madvise per run of adjacent tensors in a file where the OS allows it,
        instead of two page faults per page."""
        runs: list[tuple[str, int, int]] = []
        for tensor in sorted(tensors, key=lambda t: (t.file, t.entry.start)):
            start, end = tensor.entry.start, tensor.entry.end
            if runs and runs[-1][0] == tensor.file and start - runs[-1][2] < mmap.PAGESIZE:
                runs[-1] = (tensor.file, runs[-1][1], max(end, runs[-1][2]))
            else:
                runs.append((tensor.file, start, end))
        for path, start, end in runs:
            if not _populate["works"]:
                return
            begin = start - start % mmap.PAGESIZE
            try:
                self._map(path).madvise(_POPULATE_WRITE, begin, end - begin)
            except (OSError, ValueError):
                _populate["works"] = False  # an older kernel: plain faults from now on

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


@dataclass
class PullContext:
    """What each step of one pull on this host works with: the store it reads, the local
    checkpoint, the base dir (None: not given), its threads and its counters."""

    store: VersionStore
    local: LocalCheckpoint
    base: str | None
    workers: int
    stats: ApplyStats


class LocalCheckpoint:
    """A host-local HF checkpoint kept in step by :func:`pull_weights`; its ``read_state`` and
    ``read_pending`` first wait for this process's pull of the dir to be durable and recorded
    (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = os.path.abspath(os.fspath(directory))
        self.state_dir = os.path.join(self.dir, STATE_DIR)
        self.state_path = os.path.join(self.state_dir, STATE_NAME)
        self.pending_path = os.path.join(self.state_dir, PENDING_NAME)

    @contextlib.contextmanager
    def lock(self, timeout_s: float = 3600.0) -> Iterator[Callable[[], Callable[[], None]]]:
        """Hold the per-host ``flock`` (co-located ranks serialise on it) through one open
        descriptor, released on exit unless ``hand_over()`` (what this yields) gave its release
        to the completion after the reply."""
        os.makedirs(self.state_dir, exist_ok=True)
        fd = os.open(os.path.join(self.state_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        held = [fd]

        def hand_over() -> Callable[[], None]:
            assert held, "the host lock was already handed over"
            held.clear()
            return functools.partial(os.close, fd)  # closing releases the flock

        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise LockTimeoutError(
                            f"{self.dir} is locked by another pull for over {timeout_s:.0f} s"
                        ) from None
                    time.sleep(0.05)
            yield hand_over
        finally:
            if held:
                os.close(fd)

    def read_state(self) -> AppliedState | None:
        """The applied state, or None when there is none (or it is unreadable)."""
        return self._read(self.state_path, AppliedState.from_json, None)

    def read_pending(self) -> PendingTransition | None:
        """The record of a transition in progress or interrupted, or None; an unreadable one
        reads as an interrupted reseed."""
        unreadable = PendingTransition(None, 0)
        return self._read(self.pending_path, PendingTransition.from_json, unreadable)

    def _read(
        self, path: str, parse: Callable[..., _Record], unreadable: _Record | None
    ) -> _Record | None:
        wait_recorded(self.dir)
        try:
            with open(path, "rb") as fh:
                return parse(fh.read(), source=path)
        except FileNotFoundError:
            return None
        except FormatError as exc:
            log.warning("%s; the checkpoint in %s is taken to hold nothing", exc, self.dir)
            return unreadable

    def write_state(self, state: AppliedState, *, sync_dir: bool = True) -> None:
        """Record ``state`` with the weight files' fingerprints as they are now."""
        os.makedirs(self.state_dir, exist_ok=True)
        state = dataclasses.replace(state, files=self.fingerprints())
        atomic_replace(self.state_path, state.to_json(), sync_dir=sync_dir)

    def fingerprints(self) -> dict[str, tuple[int, int]]:
        """Weight file name → (size, mtime_ns), following links (one ``stat`` per file)."""
        infos = {name: os.stat(os.path.join(self.dir, name)) for name in self.weight_files()}
        return {name: (info.st_size, info.st_mtime_ns) for name, info in infos.items()}

    def invalidate_state(self) -> None:
        """Remove the state so a reference reader sees no version (it then reseeds)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.state_path)
            fsync_path(self.state_dir)

    def begin(self, pending: PendingTransition) -> None:
        """Before the first in-place write: rename the pending record in and remove the state
        under one directory fsync (a crash before it leaves the old state alone, or both: a
        record beside a state that does not name its target is repaired from)."""
        os.makedirs(self.state_dir, exist_ok=True)
        atomic_replace(self.pending_path, pending.to_json(), sync_dir=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.state_path)
        fsync_path(self.state_dir)

    def finish(self, state: AppliedState) -> None:
        """After the data is durable: write the new state, then clear the pending record
        (one directory fsync for both: a crash before it that keeps the record beside the
        new state is finished by the next pull)."""
        self.write_state(state, sync_dir=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pending_path)
        fsync_path(self.state_dir)

    def weight_files(self) -> list[str]:
        """Names of the local safetensors files and index (what a reseed replaces)."""
        if not os.path.isdir(self.dir):
            return []
        return sorted(
            n for n in os.listdir(self.dir) if n.endswith(".safetensors") or n == INDEX_NAME
        )

    def clear_weights(self) -> None:
        """Remove the weight files, and copies a crash left half-written (``*.tmp``)."""
        partial = [n for n in os.listdir(self.dir) if n.endswith((".tmp", ".partial"))]
        for name in self.weight_files() + partial:
            os.unlink(os.path.join(self.dir, name))

    def seed_from_base(self, base_dir: str, progress: ProgressCallback | None = None) -> None:
        """Replace the local weights with a verified copy of ``base_dir`` (never modified);
        ``progress`` gets phase ``seed``, the bytes of the base copied."""
        names = [
            n
            for n in sorted(os.listdir(base_dir))
            if n != STATE_DIR and os.path.isfile(os.path.join(base_dir, n))
        ]
        total = sum(os.path.getsize(os.path.join(base_dir, n)) for n in names) if progress else 0
        meter = ProgressMeter.start(progress, "seed", total)
        on_read = meter.advance if meter is not None else None
        self.clear_weights()
        for name in names:
            copy_verified(os.path.join(base_dir, name), os.path.join(self.dir, name), on_read)
        fsync_path(self.dir)

    def copy_missing_extras(self, base_dir: str | None) -> None:
        """Copy non-weight files (config, tokenizer) from the base that the local dir lacks."""
        if base_dir is None or not os.path.isdir(base_dir):
            return
        for name in sorted(os.listdir(base_dir)):
            src, dst = os.path.join(base_dir, name), os.path.join(self.dir, name)
            weights = name.endswith(".safetensors") or name in (INDEX_NAME, STATE_DIR)
            if not weights and os.path.isfile(src) and not os.path.exists(dst):
                copy_verified(src, dst)  # durable once the caller fsyncs the dir


# This process's last completion of each local dir (a forked child waits for none of its
# parent's, whose thread makes those durable).
_completions: dict[str, cf.Future[None]] = {}
_guard = threading.Lock()
_DURABLE = "deltastore-durable"
os.register_at_fork(after_in_child=_completions.clear)


def complete_behind(local_dir: str, steps: Callable[[], None], release: Callable[[], None]) -> None:
    """Run ``steps`` for ``local_dir`` on the completion thread, then ``release`` (the lock)."""
    local_dir = os.path.abspath(local_dir)

    def run() -> None:
        try:
            steps()
        except BaseException as exc:
            log.error(
                "%s: making the pull durable failed (%s); the pending record stays and the "
                "next pull repairs the checkpoint",
                local_dir,
                exc,
            )
            raise
        finally:
            release()

    try:
        completion = kept_pool(_DURABLE, 1).submit(run)
    except RuntimeError:  # the interpreter is shutting down: no new thread; complete here
        run()
        return
    with _guard:
        _completions[local_dir] = completion


def wait_recorded(local_dir: str, timeout_s: float | None = None) -> BaseException | None:
    """Wait until this process's last pull of ``local_dir`` is durable and recorded (at once
    from the completion thread itself); returns the error its completion stopped on, None
    when none did; :class:`LockTimeoutError` when ``timeout_s`` passes first."""
    local_dir = os.path.abspath(local_dir)
    with _guard:
        completion = _completions.get(local_dir)
    if completion is None or threading.current_thread().name.startswith(_DURABLE):
        return None
    try:
        return completion.exception(timeout_s)
    except cf.TimeoutError:
        raise LockTimeoutError(
            f"{local_dir}: the last pull was still being made durable after "
            f"{timeout_s:.0f} s; check the disk"
        ) from None


def wait_durable(
    local_checkpoint_dir: str | os.PathLike[str], timeout_s: float | None = None
) -> None:
    """Block until this process's last pull of ``local_checkpoint_dir`` is durable and its
    state recorded (a no-op when none is in flight). Raises the
    :class:`~deltastore.errors.PutBackError` its completion stopped on (the pending record
    then stays and the next pull repairs), or :class:`LockTimeoutError` after ``timeout_s``."""
    error = wait_recorded(os.fspath(local_checkpoint_dir), timeout_s)
    if error is not None:
        raise error
