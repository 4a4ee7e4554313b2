"""Writing a rank's shards of a version (delta shards from spooled payloads, full shards from
the snapshot plus them) through the version's writer, which decides where and how it commits.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from deltastore.codecs import ByteArray
from deltastore.format.packed import build_packed_header
from deltastore.format.safetensors_io import TensorLayout, build_header
from deltastore.progress import ProgressMeter
from deltastore.publish.config import Settings
from deltastore.publish.diff import Step
from deltastore.publish.messages import Placement, ShardJob
from deltastore.publish.spool import COPY_CHUNK, apply_frame
from deltastore.trust.manifest import ShardFact, ShardHasher

OpenWrite = Callable[[str], AbstractContextManager[BinaryIO]]  # one file of the version


class _HashingWriter(AbstractContextManager["_HashingWriter"]):
    """Passes writes through to ``out`` and hashes them (size and whole-file BLAKE3), so a
    signing publisher never reads a shard back. Each piece is hashed on a thread of its own
    while the next is written (an upload blocks without the GIL), one piece behind at most, so
    pieces must not change once written."""

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

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ShardWriter:
    """Writes one rank's shards of one version: the step's snapshot (as of its stream) plus
    this publish's payloads in its spool."""

    open_write: OpenWrite
    step: Step
    settings: Settings
    meter: ProgressMeter | None = None  # payload (delta) or tensor (full) bytes, not headers

    def __post_init__(self) -> None:
        self.held, self.stream, self.spool = self.step.held, self.step.stream, self.step.spool
        self.encoded = self.step.diff.encoded

    def write_all(
        self, jobs: Sequence[ShardJob], *, full: bool
    ) -> tuple[dict[str, Placement], int, dict[str, ShardFact]]:
        """Write every job: each tensor's placement, the bytes written, each shard's fact."""
        if self.step.progress is not None:
            names = [name for job in jobs for name in job.names]
            if full:
                total = sum(self.held.snapshot.sources[name].nbytes for name in names)
            else:
                total = sum(self.encoded[name].length for name in names)
            self.meter = ProgressMeter.start(self.step.progress, "write", total)
        entries: dict[str, Placement] = {}
        facts: dict[str, ShardFact] = {}
        wire = 0
        write = self.write_full if full else self.write_delta
        for job in jobs:
            start, lengths, digests, facts[job.shard] = write(job)
            # Each tensor lands back to back from the header's end.
            for name, length, digest in zip(job.names, lengths, digests, strict=True):
                entries[name] = Placement(job.shard, start, start + length, digest)
                start += length
            wire += start
        return entries, wire, facts

    def write_delta(self, job: ShardJob) -> tuple[int, list[int], list[str], ShardFact]:
        """One delta shard: every tensor's compressed payload as a ``U8`` entry, or, for an
        encoding reference readers do not know, all of them under one packed entry; returns
        the header's size, each tensor's length and digest, and the shard's fact."""
        payloads = [self.encoded[n] for n in job.names]
        lengths, digests = [e.length for e in payloads], [e.digest for e in payloads]
        if self.settings.encoding.reference_format:
            layouts = [TensorLayout(e.name, "U8", (e.length,)) for e in payloads]
            header = build_header(layouts, dict(zip(job.names, digests, strict=True)))
        else:
            header = build_packed_header(job.names, lengths, digests)
        with self.open_write(job.shard) as sink, _HashingWriter(sink) as out:
            out.write(header)
            self.spool.copy_many_to(cast(BinaryIO, out), [(e.offset, e.length) for e in payloads])
        if self.meter is not None:
            self.meter.advance(sum(lengths))
        return len(header), lengths, digests, out.fact()

    def write_full(self, job: ShardJob) -> tuple[int, list[int], list[str], ShardFact]:
        """One shard of a complete HF checkpoint: every tensor's new bytes and digest (the
        rank's kept threads hash them)."""
        sources = self.held.snapshot.sources
        for name in job.names:
            self.held.refresh(name, self.stream)
        digests = dict(zip(job.names, self.held.pool().map(self._digest, job.names)))
        layouts = [TensorLayout(n, sources[n].dtype, sources[n].shape) for n in job.names]
        header = build_header(layouts, {"format": "pt", **digests})
        lengths = []
        with self.open_write(job.shard) as sink, _HashingWriter(sink) as out:
            out.write(header)
            for n in job.names:
                data = self._new_bytes(n)
                for lo in range(0, data.size, COPY_CHUNK):
                    out.write(memoryview(data[lo : lo + COPY_CHUNK]))
                    if self.meter is not None:
                        self.meter.advance(min(COPY_CHUNK, data.size - lo))
                lengths.append(int(data.size))
                del data
        return len(header), lengths, [digests[n] for n in job.names], out.fact()

    def _digest(self, name: str) -> str:
        """A tensor's digest after this publish, reusing a verified one where it can."""
        if name in self.encoded:
            return self.encoded[name].digest
        source, checksum = self.held.snapshot.sources[name], self.settings.checksum
        if (
            source.digest is not None
            and source.checksum == checksum.name
            and not self.held.snapshot.is_loaded(name)
        ):
            return source.digest
        return checksum.hexdigest(self.held.old_bytes(name, self.stream, keep=False))

    def _new_bytes(self, name: str) -> ByteArray:
        """A tensor's bytes after this publish: snapshot + payload, snapshot untouched."""
        current = self.held.old_bytes(name, self.stream, keep=False)
        entry = self.encoded.get(name)
        if entry is None:
            return current
        result = current.copy()
        frame = self.spool.read(entry.offset, entry.length)
        apply_frame(self.settings.encoding, name, result, frame)
        return result
