"""Mirror hooks: copy committed versions between a local directory and an object store.

Trainer side, ``s3_commit`` / ``gcs_commit`` / ``mirror_commit`` (post-write) upload the
version just written locally into the remote :class:`VersionStore` through its version-writing
transaction (claim, shards, index last, create-only). Engine side, ``s3_refresh`` /
``gcs_refresh`` / ``mirror_refresh`` (pre-read) download the target's chain of committed
versions into the engine's local ``delta_dir``: each version's remote index is read before any
of its files, and its local index is written last, create-only. Both directions copy files with
the copier replication uses (:class:`~deltastore.storage.copy.FileCopier`).

Configuration, the same on both sides (see docs/hooks.md): ``DELTASTORE_REMOTE_URL`` (the
trainer's ``args.update_weight_remote_url`` takes precedence), ``DELTASTORE_STORAGE_OPTIONS``
(a JSON object of fsspec options) and ``DELTASTORE_HOOK_TIMEOUT_S`` (how long the other ranks
wait for the uploading rank's commit; default 600). Only one rank uploads (rank 0 of the
publishing group, else of ``args.rank``, ``torch.distributed`` or ``$RANK``). A version is
identified by its commit token, so re-running a hook resumes or is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from deltastore.errors import (
    DeltastoreError,
    HookError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.hooks.context import current_publishing_rank
from deltastore.hooks.posix import env_seconds, version_of
from deltastore.storage import VersionStore
from deltastore.storage.chain import iter_chain
from deltastore.storage.copy import CopyJob, FileCopier, RangeSource
from deltastore.storage.durable import atomic_writer, create_new_file, fsync_path

log = logging.getLogger("deltastore.hooks")

REMOTE_URL_ENV = "DELTASTORE_REMOTE_URL"
STORAGE_OPTIONS_ENV = "DELTASTORE_STORAGE_OPTIONS"
TIMEOUT_ENV = "DELTASTORE_HOOK_TIMEOUT_S"
ARGS_URL_ATTR = "update_weight_remote_url"
_COPY_CHUNK = 8 * 1024**2
_READS = 4  # ranged reads in flight per copied file (two chunks each in the copier's window)
_COPY_ATTEMPTS = 5
_S3_SCHEMES = ("s3://", "s3a://")
_GCS_SCHEMES = ("gs://", "gcs://")


def storage_options_from_env() -> dict[str, Any]:
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise HookError(f"{STORAGE_OPTIONS_ENV} is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise HookError(
            f"{STORAGE_OPTIONS_ENV} must be a JSON object, not {type(options).__name__}"
        )
    return options


def remote_url(args: Any = None, *, hook: str, schemes: tuple[str, ...] | None) -> str:
    url = getattr(args, ARGS_URL_ATTR, None) or os.environ.get(REMOTE_URL_ENV, "")
    if not url:
        raise HookError(
            f"{hook}: no remote store configured; set {REMOTE_URL_ENV} (e.g. s3://bucket/run) "
            f"on both trainer and engine hosts"
        )
    if schemes is not None and not url.startswith(schemes):
        raise HookError(
            f"{hook}: remote store {url!r} is not a {schemes[0]} URL; use the hook matching its "
            "scheme (deltastore.hooks.s3_* or gcs_*, or mirror_* for any fsspec URL)"
        )
    return str(url)


def _open_remote(url: str) -> VersionStore:
    return VersionStore(url, storage_options_from_env())


def _caller_rank(args: Any) -> int:
    # The publisher knows its rank within the publishing group, which may exclude rank 0.
    published = current_publishing_rank()
    if published is not None:
        return published
    rank = getattr(args, "rank", None)
    if isinstance(rank, int):
        return rank
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        with contextlib.suppress(Exception):
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
    with contextlib.suppress(ValueError):
        return int(os.environ.get("RANK", "0"))
    return 0


def _local_version(version_dir: str) -> tuple[VersionIndex, dict[str, int]]:
    """The index (with a commit token) and shard sizes of the version in ``version_dir``."""
    version = version_of(version_dir)
    index_path = os.path.join(version_dir, INDEX_NAME)
    try:
        with open(index_path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise HookError(
            f"{index_path} does not exist: the post-write hook must run after the version's "
            "index is written"
        ) from None
    index = VersionIndex.from_json(raw, version=version, source=index_path)
    sizes: dict[str, int] = {}
    for shard in index.shards():
        path = os.path.join(version_dir, shard)
        try:
            sizes[shard] = os.path.getsize(path)
        except FileNotFoundError:
            raise HookError(f"{path}, named by its index, does not exist") from None
    if not index.commit_token:
        # A foreign publisher: a token derived from the content keeps re-runs idempotent.
        digest = hashlib.sha256(raw + json.dumps(sorted(sizes.items())).encode()).hexdigest()
        index = dataclasses.replace(index, commit_token=f"mirror-{digest[:32]}")
    return index, sizes


def _remote_index(remote: VersionStore, version: int) -> VersionIndex | None:
    try:
        return remote.index(version)
    except VersionNotFoundError:
        return None


def _verify_remote(remote: VersionStore, ours: VersionIndex, sizes: dict[str, int]) -> None:
    version = ours.version
    theirs = remote.index(version)
    if theirs.commit_token != ours.commit_token:
        raise HookError(
            f"weight_v{version:06d} in {remote.url} was committed by another writer (token "
            f"{theirs.commit_token}, ours {ours.commit_token}); two trainers publish to one "
            "remote store"
        )
    for shard, size in sizes.items():
        remote_size = remote.file_size(version, shard)
        if remote_size != size:
            raise HookError(
                f"{remote.url}/{version_dir_name(version)}/{shard} holds {remote_size} bytes, "
                f"the local file {size}"
            )


def _wait_for_commit(remote: VersionStore, version: int) -> None:
    """Wait (``DELTASTORE_HOOK_TIMEOUT_S``) for the uploading rank's commit of ``version``."""
    timeout_s = env_seconds(TIMEOUT_ENV, 600.0)
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while _remote_index(remote, version) is None:
        if time.monotonic() >= deadline:
            raise HookError(
                f"weight_v{version:06d} did not appear in {remote.url} within "
                f"{timeout_s:g} s; is the uploading rank (rank 0) running the hook?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


class _LocalVersion:
    """The trainer's local version directory as a copy's source (read as it is named)."""

    def __init__(self, version_dir: str) -> None:
        self.version_dir = version_dir
        self.url = os.path.dirname(os.path.normpath(version_dir))

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        with open(os.path.join(self.version_dir, name), "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        if len(data) != end - start:
            raise HookError(f"{self.version_dir}/{name} is shorter than {end} bytes")
        return data


def _copier(src: RangeSource, dst: VersionStore, reads: ThreadPoolExecutor) -> FileCopier:
    return FileCopier(
        src, dst, reads, chunk=_COPY_CHUNK, window=2 * _READS, attempts=_COPY_ATTEMPTS
    )


def _upload(
    version_dir: str, remote: VersionStore, index: VersionIndex, sizes: dict[str, int]
) -> None:
    """Write the version through the store's transaction (re-claiming with the same token
    resumes an upload that crashed); a version committed meanwhile with our token is fine."""
    version = index.version
    try:
        writer = remote.begin(version, token=index.commit_token)
    except VersionConflictError:
        if _remote_index(remote, version) is not None:
            return  # committed meanwhile: _verify_remote checks whose it is
        raise HookError(
            f"weight_v{version:06d} in {remote.url} is claimed by another writer; two "
            "trainers publish to one remote store"
        ) from None
    with writer, ThreadPoolExecutor(_READS, thread_name_prefix="mirror-read") as reads:
        copier = _copier(_LocalVersion(version_dir), remote, reads)
        for shard, size in sizes.items():
            copier.copy(writer, CopyJob(version, shard, size), threading.Event())
        writer.commit(index)


def mirror_to_store(version_dir: str, remote: VersionStore, *, upload: bool = True) -> int:
    """Copy the committed local version in ``version_dir`` into ``remote``, index last (with
    ``upload=False`` only wait for another caller's upload); the version. :class:`HookError`
    on a conflict, a size mismatch or a timeout."""
    version_dir = os.fspath(version_dir)
    remote.refresh()
    if not upload:
        # The uploading rank may still be writing the local index: wait for its commit.
        _wait_for_commit(remote, version_of(version_dir))
    index, sizes = _local_version(version_dir)
    if upload and _remote_index(remote, index.version) is None:
        _upload(version_dir, remote, index, sizes)
    _verify_remote(remote, index, sizes)
    if upload:
        log.info("mirrored %s to %s/%s", version_dir, remote.url, version_dir_name(index.version))
    return index.version


@contextlib.contextmanager
def _as_hook_error(what: str) -> Iterator[None]:
    try:
        yield
    except HookError:
        raise
    except DeltastoreError as exc:
        raise HookError(f"{what} failed: {exc}") from exc


def _commit_hook(name: str, schemes: tuple[str, ...] | None) -> Callable[[Any, str, Any], None]:
    def hook(args: Any, version_dir: str, rollout_engines: Any) -> None:
        """Post-write hook: mirror the local ``version_dir`` to the store named by
        ``DELTASTORE_REMOTE_URL`` (or ``args.update_weight_remote_url``), index last."""
        url = remote_url(args, hook=name, schemes=schemes)
        with _as_hook_error(f"{name}: mirroring {version_dir} to {url}"):
            mirror_to_store(version_dir, _open_remote(url), upload=_caller_rank(args) == 0)

    hook.__name__ = hook.__qualname__ = name
    return hook


s3_commit = _commit_hook("s3_commit", _S3_SCHEMES)
gcs_commit = _commit_hook("gcs_commit", _GCS_SCHEMES)
mirror_commit = _commit_hook("mirror_commit", None)


@contextlib.contextmanager
def _local_lock(delta_dir: str) -> Iterator[None]:
    """Serialise mirrors into one local directory (ranks on one host call the hook at once)."""
    lock_dir = os.path.join(delta_dir, "_claims")
    os.makedirs(lock_dir, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, "mirror.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _LocalFiles:
    """Where the engine-side mirror writes a version's files: each lands whole by rename (the
    directory is made durable once, after every shard of the version is in place)."""

    def __init__(self, version_dir: str) -> None:
        self.version_dir = version_dir

    def open_write(self, name: str) -> AbstractContextManager[BinaryIO]:
        return atomic_writer(os.path.join(self.version_dir, name), sync_dir=False)


def _download(
    remote: VersionStore, copier: FileCopier, index: VersionIndex, version_dir: str
) -> None:
    """Copy the shards of ``index``'s version whose local file is not whole yet (files land by
    rename only, so one of the remote's size landed by an earlier, interrupted mirror)."""
    local = _LocalFiles(version_dir)
    for shard in index.shards():
        size = remote.file_size(index.version, shard)
        dst = os.path.join(version_dir, shard)
        if not (os.path.exists(dst) and os.path.getsize(dst) == size):
            copier.copy(local, CopyJob(index.version, shard, size), threading.Event())


def _same_index(path: str, raw: bytes, what: str) -> None:
    """Refuse a local index that differs from the remote's (another run's files)."""
    with open(path, "rb") as fh:
        if fh.read() != raw:
            raise HookError(
                f"{path} differs from {what}: this local directory mirrors another store or "
                "stream; point the hook at an empty one"
            )


def _remote_chain(
    remote: VersionStore, delta_dir: str, target: int
) -> list[tuple[VersionIndex, bytes]]:
    """(index, raw bytes) of the chain to ``target`` not yet complete locally, oldest first;
    the walk stops at a version held locally (whose index must match)."""
    todo: list[tuple[VersionIndex, bytes]] = []

    def read(version: int) -> VersionIndex | None:
        where = f"weight_v{version:06d} in {remote.url}"
        local_index = os.path.join(delta_dir, version_dir_name(version), INDEX_NAME)
        if os.path.exists(local_index):
            with contextlib.suppress(VersionNotFoundError):  # pruned remotely: the copy stands
                _same_index(local_index, remote.index_bytes(version), where)
            return None
        try:
            raw = remote.index_bytes(version)
        except VersionNotFoundError as exc:
            what = "is" if version == target else f"(needed by v{target:06d}) is"
            # The store's own message says the same thing again: chained, not pasted in.
            raise HookError(
                f"weight_v{version:06d} {what} not committed in {remote.url}; has the "
                "trainer's commit hook finished?"
            ) from exc
        source = f"{remote.url}/{version_dir_name(version)}"
        todo.append((VersionIndex.from_json(raw, version=version, source=source), raw))
        return todo[-1][0]

    for _ in iter_chain(target, read):
        pass
    return todo[::-1]


def mirror_from_store(remote: VersionStore, delta_dir: str, target_version: int) -> list[int]:
    """Download the chain of committed versions leading to ``target_version`` into
    ``delta_dir``, oldest first, each index last; the versions downloaded. :class:`HookError`
    if a link of the chain is not committed in ``remote``."""
    delta_dir = os.path.abspath(os.fspath(delta_dir))
    if target_version <= 0:
        return []
    os.makedirs(delta_dir, exist_ok=True)
    remote.refresh()
    with _local_lock(delta_dir):
        todo = _remote_chain(remote, delta_dir, target_version)
        with ThreadPoolExecutor(_READS, thread_name_prefix="mirror-read") as reads:
            copier = _copier(remote, VersionStore(delta_dir), reads)
            for index, raw in todo:
                version_dir = os.path.join(delta_dir, version_dir_name(index.version))
                os.makedirs(version_dir, exist_ok=True)
                _download(remote, copier, index, version_dir)
                fsync_path(version_dir)
                index_path = os.path.join(version_dir, INDEX_NAME)
                try:
                    create_new_file(index_path, raw)
                except FileExistsError:
                    _same_index(index_path, raw, f"the index of {remote.url}")
        fsync_path(delta_dir)
    done = [index.version for index, _ in todo]
    if done:
        log.info("mirrored %s from %s into %s", done, remote.url, delta_dir)
    return done


def _refresh_hook(name: str, schemes: tuple[str, ...] | None) -> Callable[[str, int], None]:
    def hook(delta_dir: str, target_version: int) -> None:
        """Pre-read hook: mirror the chain of ``target_version`` from the store named by
        ``DELTASTORE_REMOTE_URL`` into the local ``delta_dir``, index last."""
        if target_version <= 0:
            return
        url = remote_url(None, hook=name, schemes=schemes)
        with _as_hook_error(f"{name}: mirroring {url} into {delta_dir}"):
            mirror_from_store(_open_remote(url), delta_dir, target_version)

    hook.__name__ = hook.__qualname__ = name
    return hook


s3_refresh = _refresh_hook("s3_refresh", _S3_SCHEMES)
gcs_refresh = _refresh_hook("gcs_refresh", _GCS_SCHEMES)
mirror_refresh = _refresh_hook("mirror_refresh", None)
