"""Copying one version through the destination's version-writing transaction.

All files of the version (its shards, then any other file of the source's version directory)
are copied concurrently inside one ``dst.begin(version)`` transaction, which then commits the
source's index (stamped with this writer's token), create-only.

* A failure while files are copied aborts the transaction and the version is tried again. A
  failure inside ``commit`` is not aborted (after the delta took its base's successor, an abort
  would leave a permanent tombstone): the claim is kept and the next try resumes it by token.
* When another writer holds the version, this one waits: once that writer commits, its index
  must equal the source's (``present``); if its claim shows no activity for ``stale_claim_s``
  (a replicator that was killed), this one resumes it with its token. A writer wrongly taken
  for dead writes the same bytes under the same token, so the outcome is the same.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from deltastore.codecs import CHECKSUMS, Hasher, get_checksum
from deltastore.errors import (
    FormatError,
    IntegrityError,
    StoreError,
    StreamError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltastore.format.index import VersionIndex
from deltastore.format.names import INDEX_NAME, version_dir_name
from deltastore.format.safetensors_io import SafetensorsHeader
from deltastore.format.shard_stream import StreamedShardCheck
from deltastore.replicate.report import Observer, ReplicationPolicy, VersionCopy
from deltastore.storage import VersionStore, new_token, store_objects
from deltastore.storage.copy import CopyJob, FileCopier, wait_before_retry
from deltastore.storage.writer import VersionWriter

log = logging.getLogger("deltastore.replicate")

_HEX = frozenset("0123456789abcdef")


def same_content(a: VersionIndex, b: VersionIndex) -> bool:
    """Whether two indexes publish the same version: equal in everything but the token of the
    writer that committed each copy (:meth:`VersionIndex.content_digest`)."""
    return a.content_digest() == b.content_digest()


def new_file_hasher() -> Hasher:
    """The whole-file digest that compares a copy with what was read from its source."""
    return get_checksum("xxh3-128").hasher()


def shard_checker(
    source: str, size: int, checksum: str | None, *, check_digests: bool, hash_tensors: bool
) -> StreamedShardCheck:
    """A check of one shard of ``size`` bytes fed in file order. With ``check_digests`` (and a
    registered ``checksum``) every tensor must carry a well-formed digest in its metadata; with
    ``hash_tensors`` (a full version: a delta's digests describe the tensor after applying)
    each tensor's bytes are hashed and compared (:class:`IntegrityError` at the first that
    differs)."""
    algorithm = get_checksum(checksum) if checksum in CHECKSUMS else None

    def expected(header: SafetensorsHeader) -> dict[str, str]:
        if not check_digests or algorithm is None:
            return {}
        for name in header.tensors:
            digest = header.metadata.get(name, "")
            if len(digest) != algorithm.hex_length or not set(digest) <= _HEX:
                raise FormatError(
                    f"{source}: tensor {name!r} has no valid {algorithm.name} digest in its "
                    "shard metadata; the source's copy is corrupt or foreign"
                )
        return {name: header.metadata[name] for name in header.tensors} if hash_tensors else {}

    def mismatch(name: str, recorded: str, read: str) -> None:
        assert algorithm is not None
        raise IntegrityError(
            f"{source}: tensor {name!r} does not match its {algorithm.name} digest (recorded "
            f"{recorded}, read {read}); the source's copy is corrupt, republish that version "
            "before replicating it"
        )

    new_hasher = algorithm.hasher if algorithm is not None else new_file_hasher
    return StreamedShardCheck(source, new_hasher, expected, size=size, on_mismatch=mismatch)


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
        """Make ``version`` committed at the destination with ``index``'s content; its record,
        or None when it cannot be (pruned at the source meanwhile, or fenced at the
        destination). Raises :class:`StreamError` when the destination committed other content
        under this number, and the last store error once ``policy.attempts`` tries failed."""
        started = time.monotonic()
        retries = 0
        token = new_token()
        while True:
            try:
                return self._copy_once(version, index, token, started, retries)
            except VersionConflictError as exc:
                settled = self._settle(version, index, token, started, retries, exc)
                if not isinstance(settled, str):
                    return settled
                token = settled
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
                # retries): the try left nothing visible; try the version again.
                if isinstance(exc, PermissionError) or retries + 1 >= self.policy.attempts:
                    raise
                retries += 1
                wait_before_retry(version_dir_name(version), retries, exc, 0.5, 10)

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
        jobs = []
        for name in [*shards, *extra]:
            size = self.src.file_size(version, name)
            check = None
            if name in shards:  # a shard the index maps tensors to: its header is checked
                check = functools.partial(
                    shard_checker,
                    f"{self.src.url}/{version_dir_name(version)}/{name}",
                    size,
                    index.checksum,
                    check_digests=self.verify,
                    hash_tensors=self.verify and not index.is_delta,
                )
            jobs.append(CopyJob(version, name, size, check))
        return jobs

    def _copy_once(
        self, version: int, index: VersionIndex, token: str, started: float, retries: int
    ) -> VersionCopy:
        jobs = self._jobs(version, index)
        self.observer.version_started(version, sum(j.size for j in jobs))
        writer = self.dst.begin(version, token=token)
        try:
            results = self._write_files(writer, version, jobs)
        except BaseException:
            writer.abort()  # before commit(): no successor taken, so no tombstone either
            raise
        writer.after_write()
        writer.commit(index)
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

    def _write_files(self, writer: VersionWriter, version: int, jobs: list[CopyJob]) -> list[Any]:
        """Copy every file concurrently; on a failure the others stop at their next chunk,
        and every upload has ended before this returns or raises."""
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
            read_back=new_file_hasher if self.verify else None,
        )
        cancel = threading.Event()
        futures = [self.files.submit(copier.copy, writer, job, cancel) for job in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            if not all(f.done() for f in futures):
                cancel.set()  # one failed, or Ctrl-C: stop the others before the abort
            wait(futures)
        return [f.result() for f in futures]

    def _settle(
        self,
        version: int,
        index: VersionIndex,
        token: str,
        started: float,
        retries: int,
        conflict: VersionConflictError,
    ) -> VersionCopy | str | None:
        """The version was refused: wait for the writer holding it to commit (then compare),
        or for its claim to go stale. Returns the record (``present``), the token to claim
        with next, or None when the destination fenced the version for good."""
        delay = self.policy.poll_min_s / 4
        while True:
            self.dst.refresh()
            with contextlib.suppress(VersionNotFoundError):  # not committed (yet)
                theirs = self.dst.index(version)
                if not same_content(theirs, index):
                    raise StreamError(
                        f"{version_dir_name(version)} in {self.dst.url} was committed with "
                        f"other content than in {self.src.url} (stream {theirs.stream_id} vs "
                        f"{index.stream_id}); the destination replicates another run: point "
                        "the replicator at an empty destination"
                    )
                seconds = time.monotonic() - started
                return VersionCopy(version, index.kind, "present", 0, 0, seconds, retries)
            objects = store_objects(self.dst)  # another writer's claim: the protocol's view
            if objects.is_fenced(version):
                log.error(
                    "%s is fenced (a tombstone) in %s: the replica can never hold it; its "
                    "chain resumes at the next full version",
                    version_dir_name(version),
                    self.dst.url,
                )
                return None
            holder = objects.claim_token(version)
            if not isinstance(holder, str):
                return token  # the claim is gone (its writer aborted): claim it again
            if holder == token:
                raise conflict  # refused at commit, not at the claim: nothing to wait for
            idle = self.dst.listing().idle_s(version, time.time())
            if idle >= self.policy.stale_claim_s:
                log.warning(
                    "%s: resuming a claim idle for %.0f s at %s (a replicator that died)",
                    version_dir_name(version),
                    idle,
                    self.dst.url,
                )
                return holder
            time.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, self.policy.poll_max_s)
