"""Copying one version through the destination's version-writing transaction.

All files of the version (its shards, then any other file the source's version directory
holds) are copied concurrently inside one ``dst.begin(version)`` transaction, which then
commits the source's index, create-only. A failure aborts the transaction (nothing becomes
visible) and the version is tried again. When another writer holds or wins the version, its
committed index must equal the source's (then it counts as ``present``), and a claim left by a
replicator that died is removed once it has been idle for ``stale_claim_s``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

from deltastore.errors import (
    StoreError,
    StreamError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.replicate.copy import CopyJob, FileCopier
from deltastore.replicate.plan import same_content
from deltastore.replicate.report import Observer, ReplicationPolicy, VersionCopy
from deltastore.storage import VersionStore

log = logging.getLogger("deltastore.replicate")


def is_temporary(name: str) -> bool:
    """A writer's in-progress file (never part of a version), or a hidden one."""
    return name.endswith((".partial", ".tmp")) or name.startswith((".", "_"))


class VersionCopier:
    """Copies single versions from ``src`` into ``dst`` (see the module docstring)."""

    def __init__(
        self,
        src: VersionStore,
        dst: VersionStore,
        *,
        verify: bool,
        jobs: int,
        policy: ReplicationPolicy,
        observer: Observer,
    ) -> None:
        self.src, self.dst, self.verify, self.jobs = src, dst, verify, jobs
        self.policy, self.observer = policy, observer
        self.files = ThreadPoolExecutor(jobs, thread_name_prefix="replicate-file")
        self.reads = ThreadPoolExecutor(jobs, thread_name_prefix="replicate-read")
        self.chunk = policy.chunk_bytes or dst.block_size

    def close(self) -> None:
        self.files.shutdown(cancel_futures=True)
        self.reads.shutdown(cancel_futures=True)

    def copy(self, version: int, index: VersionIndex) -> VersionCopy | None:
        """Make ``version`` committed at the destination with ``index``'s content.

        Returns its record, or None when the source pruned it meanwhile. Raises
        :class:`StreamError` when the destination committed other content under this number,
        the source's errors for a corrupt version, and the last store error once
        ``policy.attempts`` tries failed.
        """
        started = time.monotonic()
        retries = 0
        while True:
            try:
                return self._copy_once(version, index, started, retries)
            except VersionConflictError:
                record = self._settle(version, index, started, retries)
                if record is not None:
                    return record
            except VersionNotFoundError:
                self.src.refresh()
                if version not in self.src.versions():
                    log.info("%s was pruned at the source while copied", version_dir_name(version))
                    return None
                if retries + 1 >= self.policy.attempts:
                    raise
                retries += 1
            except (StoreError, OSError) as exc:
                # Any store error (an upload whose ack was lost, a 5xx that outlasted the
                # retries): the try was aborted, nothing is visible; try the version again.
                if isinstance(exc, PermissionError) or retries + 1 >= self.policy.attempts:
                    raise
                retries += 1
                wait_s = random.uniform(0, min(10.0, 0.5 * 2**retries))
                log.warning(
                    "%s: try %d failed and was aborted (%s); again in %.1f s",
                    version_dir_name(version),
                    retries,
                    exc,
                    wait_s,
                )
                time.sleep(wait_s)

    def _jobs(self, version: int, index: VersionIndex) -> list[CopyJob]:
        shards = index.shards()
        names = set(self.src.list_files(version))
        missing = sorted(set(shards) - names)
        if missing:
            raise VersionNotFoundError(
                f"{version_dir_name(version)} in {self.src.url} lacks shard {missing[0]} that "
                "its index names (pruned meanwhile, or corrupt)"
            )
        extra = sorted(n for n in names - set(shards) if n != INDEX_NAME and not is_temporary(n))
        return [
            CopyJob(
                version=version,
                name=name,
                size=self.src.file_size(version, name),
                checksum=index.checksum,
                is_shard=name in shards,
                hash_tensors=self.verify and not index.is_delta,
                verify=self.verify,
            )
            for name in [*shards, *extra]
        ]

    def _copy_once(
        self, version: int, index: VersionIndex, started: float, retries: int
    ) -> VersionCopy:
        jobs = self._jobs(version, index)
        self.observer.version_started(version, sum(j.size for j in jobs))
        # A file's window of chunks in flight: about 2 x jobs chunks held in all.
        window = max(2, 2 * self.jobs // max(1, min(self.jobs, len(jobs))))
        copier = FileCopier(
            self.src,
            self.dst,
            self.reads,
            chunk=self.chunk,
            window=window,
            attempts=self.policy.attempts,
            on_bytes=lambda n: self.observer.advanced(version, n),
        )
        cancel = threading.Event()
        with begin(self.dst, version) as writer:
            futures = [self.files.submit(copier.copy, writer, job, cancel) for job in jobs]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            if any(f.exception() for f in done):
                cancel.set()
            wait(futures)  # every upload has ended before the transaction aborts
            results = [f.result() for f in futures]
            token = getattr(writer, "token", None)
            writer.commit(replace(index, commit_token=token or index.commit_token))
        return VersionCopy(
            version=version,
            kind=index.kind,
            outcome="copied",
            bytes=sum(r.size for r in results),
            files=len(results),
            seconds=time.monotonic() - started,
            retries=retries + sum(r.retries for r in results),
            verified_tensors=sum(r.verified_tensors for r in results),
        )

    def _settle(
        self, version: int, index: VersionIndex, started: float, retries: int
    ) -> VersionCopy | None:
        """Another writer holds ``version``: wait for its commit (then compare) or for its
        claim to go stale (then remove it). None: try the version again."""
        delay = self.policy.poll_min_s / 4
        while True:
            self.dst.refresh()
            try:
                theirs = self.dst.index(version)
            except VersionNotFoundError:
                theirs = None
            if theirs is not None:
                if not same_content(theirs, index):
                    raise StreamError(
                        f"{version_dir_name(version)} in {self.dst.url} was committed with "
                        f"other content than in {self.src.url} (stream {theirs.stream_id} vs "
                        f"{index.stream_id}); the destination replicates another run: point "
                        "the replicator at an empty destination"
                    )
                return VersionCopy(
                    version, index.kind, "present", 0, 0, time.monotonic() - started, retries
                )
            idle = self._claim_idle_s(version)
            if idle is None:
                return None  # the claim is gone (its writer aborted): try again
            if idle >= self.policy.stale_claim_s:
                log.warning(
                    "%s: removing a claim idle for %.0f s at %s (a replicator that died)",
                    version_dir_name(version),
                    idle,
                    self.dst.url,
                )
                self.dst.abort(version)
                return None
            time.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, self.policy.poll_max_s)

    def _claim_idle_s(self, version: int) -> float | None:
        """Seconds since the last sign of life of ``version``'s writer at the destination
        (its claim or any of its files); None when nothing of it is left."""
        listing = self.dst.listing()
        entries = list(listing.files.get(version, {}).values())
        if version in listing.claims:
            entries.append(listing.claims[version])
        if not entries:
            return None
        times = [e.mtime for e in entries if e.mtime is not None]
        return time.time() - max(times) if times else float("inf")


class _ClaimWriter:
    """The transaction over ``claim`` / ``open_write`` / ``commit`` for a store that has no
    ``begin`` yet (before storage's VersionWriter)."""

    def __init__(self, store: VersionStore, version: int) -> None:
        from deltastore.storage import new_token

        self.store, self.version, self.token = store, version, new_token()
        self.committed = False

    def __enter__(self) -> _ClaimWriter:
        self.store.claim(self.version, self.token)
        return self

    def open_write(self, name: str) -> Any:
        return self.store.open_write(self.version, name)

    def commit(self, index: VersionIndex) -> None:
        self.store.after_write(self.version)
        self.store.commit(self.version, index)
        self.committed = True

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            self.store.abort(self.version)


def begin(store: VersionStore, version: int) -> Any:
    """``store.begin(version)``: the destination's version-writing transaction."""
    if hasattr(store, "begin"):
        return store.begin(version)
    return _ClaimWriter(store, version)
