"""Writing a rank's shards of a version: delta shards from spooled payloads, full shards from
the snapshot plus this publish's payloads. Files are opened through ``open_write(shard)``
(the version's writer), so this module never decides where or how a version is committed.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from deltastore.codecs import ByteArray, Checksum, Encoding
from deltastore.format.packed import build_packed_header
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.messages import Placement, ShardJob, StreamState
from deltastore.publish.rank_state import RankSnapshot
from deltastore.publish.snapshot import TensorSource
from deltastore.publish.spool import COPY_CHUNK, Encoded, PayloadSpool, apply_payload
from deltastore.trust.manifest import ShardFact, ShardHasher

OpenWrite = Callable[[str], AbstractContextManager[BinaryIO]]
"""Opens one file of the version being written, by shard name."""


class _HashingWriter:
    """Passes writes through to ``out`` and hashes them: a shard's size and whole-file BLAKE3
    come from the bytes as streamed, so a signing publisher never reads a shard back.

    Each piece is hashed on a thread of its own while the next is written (an object store's
    file blocks in its part uploads, which need no GIL), one piece behind at most. The pieces
    must not change once written: every caller here passes new bytes, or views of arrays it
    no longer changes.
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._hasher = ShardHasher()
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="deltastore-shard-hash")
        self._hashing: cf.Future[None] | None = None

    def write(self, data: Any) -> int:
        if self._hashing is not None:
            self._hashing.result()
        self._hashing = self._pool.submit(self._hasher.update, data)
        return self._out.write(data)

    def fact(self) -> ShardFact:
        """Size and BLAKE3 of everything written (waits for the last piece's hash)."""
        self.close()
        return self._hasher.fact()

    def close(self) -> None:
        """Wait for the pending hash and end the thread; idempotent."""
        try:
            if self._hashing is not None:
                self._hashing.result()
        finally:
            self._hashing = None
            self._pool.shutdown()

    def as_binary(self) -> BinaryIO:
        return cast(BinaryIO, self)


@contextmanager
def _hashing(sink: BinaryIO) -> Iterator[_HashingWriter]:
    """A :class:`_HashingWriter` over ``sink`` whose thread ends with the block, however it
    ends (its pending hash waited for)."""
    writer = _HashingWriter(sink)
    try:
        yield writer
    finally:
        writer.close()


def write_meter(
    progress: ProgressCallback | None,
    jobs: Sequence[ShardJob],
    full: bool,
    encoded: Mapping[str, Encoded],
    sources: Mapping[str, TensorSource],
) -> ProgressMeter | None:
    """The ``write`` phase's meter: its total is the payload bytes (delta) or tensor bytes
    (full) of this rank's shards, headers not counted."""
    if progress is None:
        return None
    names = [name for job in jobs for name in job.names]
    if full:
        total = sum(sources[name].nbytes for name in names)
    else:
        total = sum(encoded[name].length for name in names)
    return ProgressMeter.start(progress, "write", total)


@dataclass(frozen=True)
class ShardWriter:
    """Writes one rank's shards of one version."""

    open_write: OpenWrite
    encoded: dict[str, Encoded]
    spool: PayloadSpool
    encoding: Encoding
    checksum: Checksum
    workers: int
    meter: ProgressMeter | None = None
    """Counts the payload (delta) or tensor (full) bytes written, if progress is reported."""

    def write_all(
        self, jobs: Sequence[ShardJob], *, full: bool, held: RankSnapshot, stream: StreamState
    ) -> tuple[dict[str, Placement], int, dict[str, ShardFact]]:
        """Write every job; returns each tensor's placement, the bytes written and each
        shard's size and whole-file BLAKE3 (hashed as streamed, for the signature)."""
        entries: dict[str, Placement] = {}
        facts: dict[str, ShardFact] = {}
        wire = 0
        for job in jobs:
            if full:
                placed, size, fact = self.write_full(job, held, stream)
            else:
                placed, size, fact = self.write_delta(job)
            entries.update(placed)
            facts[job.shard] = fact
            wire += size
        return entries, wire, facts

    def write_delta(self, job: ShardJob) -> tuple[dict[str, Placement], int, ShardFact]:
        """One delta shard: every tensor's compressed payload as a ``U8`` entry, or, for an
        encoding reference readers do not know, all of them under one packed entry."""
        encoded = self.encoded
        if self.encoding.reference_format:
            layouts = [TensorLayout(n, "U8", (encoded[n].length,)) for n in job.names]
            header = build_header(layouts, {n: encoded[n].digest for n in job.names})
        else:
            header = build_packed_header(
                job.names,
                [encoded[n].length for n in job.names],
                [encoded[n].digest for n in job.names],
            )
        entries = {}
        offset = len(header)
        spans = [(encoded[n].offset, encoded[n].length) for n in job.names]
        with self.open_write(job.shard) as sink, _hashing(sink) as out:
            out.write(header)
            self.spool.copy_many_to(out.as_binary(), spans)
        if self.meter is not None:
            self.meter.advance(sum(length for _, length in spans))
        for n in job.names:
            end = offset + encoded[n].length
            entries[n] = Placement(job.shard, offset, end, encoded[n].digest)
            offset = end
        return entries, offset, out.fact()

    def write_full(
        self, job: ShardJob, held: RankSnapshot, stream: StreamState
    ) -> tuple[dict[str, Placement], int, ShardFact]:
        """One shard of a complete HF checkpoint: every tensor's new bytes and digest."""
        sources = held.snapshot.sources
        for name in job.names:
            held.refresh(name, stream)
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="deltastore-digest") as pool:
            digests = dict(
                zip(job.names, pool.map(lambda n: self._digest(n, held, stream), job.names))
            )
        layouts = [TensorLayout(n, sources[n].dtype, sources[n].shape) for n in job.names]
        header = build_header(layouts, {"format": "pt", **digests})
        entries = {}
        offset = len(header)
        with self.open_write(job.shard) as sink, _hashing(sink) as out:
            out.write(header)
            for n in job.names:
                data = self._new_bytes(n, held, stream)
                for lo in range(0, data.size, COPY_CHUNK):
                    out.write(memoryview(data[lo : lo + COPY_CHUNK]))
                    if self.meter is not None:
                        self.meter.advance(min(COPY_CHUNK, data.size - lo))
                end = offset + int(data.size)
                entries[n] = Placement(job.shard, offset, end, digests[n])
                offset = end
                del data
        return entries, offset, out.fact()

    def _digest(self, name: str, held: RankSnapshot, stream: StreamState) -> str:
        """A tensor's digest after this publish, reusing a verified one where it can."""
        if name in self.encoded:
            return self.encoded[name].digest
        source = held.snapshot.sources[name]
        if (
            source.digest is not None
            and source.checksum == self.checksum.name
            and not held.snapshot.is_loaded(name)
        ):
            return source.digest
        return self.checksum.hexdigest(held.old_bytes(name, stream, keep=False))

    def _new_bytes(self, name: str, held: RankSnapshot, stream: StreamState) -> ByteArray:
        """A tensor's bytes after this publish: snapshot + payload, snapshot untouched."""
        current = held.old_bytes(name, stream, keep=False)
        entry = self.encoded.get(name)
        if entry is None:
            return current
        result = current.copy()
        apply_payload(self.encoding, name, result, entry, self.spool)
        return result
