"""What one rank holds of the published model: its snapshot, and which tensors another rank
has moved on since (their bytes are re-read from the store's chain before use).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from dataclasses import dataclass, replace

from deltastore.codecs import ByteArray, Encoding, XorChanges, apply_changes, decompress
from deltastore.errors import PublishError
from deltastore.publish.lineage import apply_lineage, rebuild_lineage
from deltastore.publish.messages import Layout, Placement
from deltastore.publish.snapshot import Snapshot, TensorSource
from deltastore.publish.spool import PayloadSpool
from deltastore.publish.stream import StreamState
from deltastore.storage import VersionStore

PARALLEL_BYTES = 64 * 1024**2
"""Below this many bytes of changed tensors the snapshot advances on the calling thread: there
the hand-offs to the pool cost more than the second thread saves."""
PARALLEL_TENSOR_BYTES = 1024**2
"""Nor is it split when the changed tensors average less than this: a small tensor's advance is
a few short numpy calls, and two threads trading the GIL between them took longer than one
(8,000 tensors of 64 KB: 0.12-0.23 s on two threads against 0.09 s on one)."""


@dataclass(frozen=True)
class Encoded:
    """One diffed tensor: its new digest and where its compressed payload sits in the spool."""

    name: str
    changed_bytes: int
    digest: str
    offset: int
    length: int
    changes: XorChanges | None = None
    """The change in element form where the encoding gave it (applied instead of the payload
    when the snapshot advances: no second decode)."""


def apply_payload(
    encoding: Encoding, name: str, target: ByteArray, entry: Encoded, spool: PayloadSpool
) -> None:
    """Apply a spooled payload to ``target`` in place (size-checked before decompressing)."""
    payload = decompress(
        spool.read(entry.offset, entry.length),
        max_size=encoding.max_payload_size(target.size),
        what=f"payload of tensor {name!r}",
    )
    encoding.apply(target, payload, tensor=name)


class RankSnapshot:
    """A rank's snapshot plus the bookkeeping that keeps it true across ranks.

    ``base_sources`` describe the base checkpoint (version 0); ``store`` is where the chain
    is re-read from when a tensor another rank published is needed here.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        base_sources: dict[str, TensorSource],
        store: VersionStore,
        *,
        workers: int = 1,
    ) -> None:
        self.snapshot = snapshot
        self.base_sources = base_sources
        self.store = store
        self.workers = workers
        """Threads that encode a publish's tensors and advance the snapshot after it."""
        self.moved: set[str] = set()
        """Tensors changed by another rank since this rank's snapshot of them."""
        self._pool: tuple[int, cf.ThreadPoolExecutor] | None = None

    def pool(self) -> cf.ThreadPoolExecutor:
        """The rank's ``workers`` threads, all started at once (by ``seed()``) and kept for
        every publish: started per publish, each start waited for the GIL while the first
        thread encoded (docs/benchmarks.md, *The publish pipeline around the codec*). A
        process forked since gets its own."""
        if self._pool is None or self._pool[0] != os.getpid():
            pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-publish")
            started = threading.Barrier(self.workers + 1)
            for _ in range(self.workers):  # each waits for the others: every thread starts
                pool.submit(started.wait)
            started.wait()
            self._pool = (os.getpid(), pool)
        return self._pool[1]

    def old_bytes(self, name: str, stream: StreamState, *, keep: bool = True) -> ByteArray:
        """The snapshot's bytes of ``name`` (kept loaded unless ``keep=False``)."""
        self.refresh(name, stream)
        return self.snapshot.load(name) if keep else self.snapshot.peek(name)

    def refresh(self, name: str, stream: StreamState) -> None:
        """Point a tensor another rank changed since this rank held it at the store's chain.

        Raises :class:`PublishError` when the stream cannot be walked from its base.
        """
        if name not in self.moved or self.snapshot.is_loaded(name):
            return
        if not stream.walk_from_base:
            raise PublishError(
                f"tensor {name!r} was published by another rank since this rank last held "
                "it, and this stream continues a checkpoint (continue_latest) rather than "
                "its base: pass each tensor on the same rank, or publish a full version"
            )
        lineage = rebuild_lineage(self.store, stream.base_version, self.base_sources, names=[name])
        apply_lineage(self.snapshot, lineage, self.base_sources)
        self.moved.discard(name)

    def advance(
        self,
        layout: Layout,
        entries: dict[str, Placement],
        encoded: dict[str, Encoded],
        spool: PayloadSpool,
        *,
        encoding: Encoding,
        version: int,
        checksum: str,
    ) -> None:
        """Move the snapshot to the committed ``version`` (call only after the commit).

        Replicas this rank diffed but did not write advance too: their state is the committed
        one. Tensors another rank changed are forgotten; after a full version every tensor is
        read back from it.
        """
        self._apply_all(list(encoded.values()), encoding, spool)
        for name in layout.changed:
            if name not in encoded:
                self.snapshot.evict(name)
                self.moved.add(name)
        if not layout.full:
            return
        for name, placement in entries.items():
            source = replace(
                self.base_sources[name],
                file=None,
                full_version=version,
                shard=placement.shard,
                offset=placement.start,
                deltas=(),
                checksum=checksum,
                digest=placement.digest,
            )
            self.snapshot.set_source(name, source, keep_loaded=True)
        self.moved.clear()

    def _apply_all(self, entries: list[Encoded], encoding: Encoding, spool: PayloadSpool) -> None:
        """Apply every change to the snapshot, split over ``workers`` threads (decompression
        and the XOR of large tensors release the GIL, so the threads share the work)."""

        def apply(batch: list[Encoded]) -> None:
            for entry in batch:
                target = self.snapshot.load(entry.name)
                if entry.changes is not None:
                    apply_changes(target, entry.changes)
                else:
                    apply_payload(encoding, entry.name, target, entry, spool)

        sources = self.snapshot.sources
        total = sum(sources[e.name].nbytes for e in entries)
        if self.workers < 2 or total < max(PARALLEL_BYTES, PARALLEL_TENSOR_BYTES * len(entries)):
            apply(entries)
            return
        # Several batches per thread, so one large tensor does not leave the others idle.
        count = min(len(entries), 4 * self.workers)
        batches = [entries[i::count] for i in range(count)]
        list(self.pool().map(apply, batches))
