"""Writing a rank's shards of a version: delta shards from spooled payloads, full shards from
the snapshot plus this publish's payloads. Files are opened through ``open_write(shard)``
(the version's writer), so this module never decides where or how a version is committed.
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
from deltastore.progress import ProgressCallback, ProgressMeter
from deltastore.publish.config import Settings
from deltastore.publish.messages import Placement, ShardJob, StreamState
from deltastore.publish.rank_state import RankSnapshot
from deltastore.publish.spool import COPY_CHUNK, Encoded, PayloadSpool, apply_payload
from deltastore.trust.manifest import ShardFact, ShardHasher

OpenWrite = Callable[[str], AbstractContextManager[BinaryIO]]  # one file of the version


class _HashingWriter:
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

    def as_binary(self) -> BinaryIO:
        return cast(BinaryIO, self)

    def __enter__(self) -> _HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ShardWriter:
    """Writes one rank's shards of one version, from ``held`` (its snapshot) as of ``stream``
    plus this publish's ``encoded`` payloads in ``spool``."""

    open_write: OpenWrite
    encoded: dict[str, Encoded]
    spool: PayloadSpool
    settings: Settings
    held: RankSnapshot
    stream: StreamState
    meter: ProgressMeter | None = None  # payload (delta) or tensor (full) bytes, not headers

    def write_all(
        self, jobs: Sequence[ShardJob], *, full: bool, progress: ProgressCallback | None
    ) -> tuple[dict[str, Placement], int, dict[str, ShardFact]]:
        """Write every job; returns each tensor's placement, the bytes written and each
        shard's size and whole-file BLAKE3 (hashed as streamed, for the signature)."""
        if progress is not None:
            names = [name for job in jobs for name in job.names]
            sources = self.held.snapshot.sources
            if full:
                total = sum(sources[name].nbytes for name in names)
            else:
                total = sum(self.encoded[name].length for name in names)
            self.meter = ProgressMeter.start(progress, "write", total)
        entries: dict[str, Placement] = {}
        facts: dict[str, ShardFact] = {}
        wire = 0
        for job in jobs:
            placed, size, fact = self.write_full(job) if full else self.write_delta(job)
            entries.update(placed)
            facts[job.shard] = fact
            wire += size
        return entries, wire, facts

    def write_delta(self, job: ShardJob) -> tuple[dict[str, Placement], int, ShardFact]:
        """One delta shard: every tensor's compressed payload as a ``U8`` entry, or, for an
        encoding reference readers do not know, all of them under one packed entry."""
        encoded = self.encoded
        if self.settings.encoding.reference_format:
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
        with self.open_write(job.shard) as sink, _HashingWriter(sink) as out:
            out.write(header)
            self.spool.copy_many_to(out.as_binary(), spans)
        if self.meter is not None:
            self.meter.advance(sum(length for _, length in spans))
        for n in job.names:
            end = offset + encoded[n].length
            entries[n] = Placement(job.shard, offset, end, encoded[n].digest)
            offset = end
        return entries, offset, out.fact()

    def write_full(self, job: ShardJob) -> tuple[dict[str, Placement], int, ShardFact]:
        """One shard of a complete HF checkpoint: every tensor's new bytes and digest."""
        sources = self.held.snapshot.sources
        for name in job.names:
            self.held.refresh(name, self.stream)
        workers = self.settings.config.threads
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="deltastore-digest") as pool:
            digests = dict(zip(job.names, pool.map(self._digest, job.names)))
        layouts = [TensorLayout(n, sources[n].dtype, sources[n].shape) for n in job.names]
        header = build_header(layouts, {"format": "pt", **digests})
        entries = {}
        offset = len(header)
        with self.open_write(job.shard) as sink, _HashingWriter(sink) as out:
            out.write(header)
            for n in job.names:
                data = self._new_bytes(n)
                for lo in range(0, data.size, COPY_CHUNK):
                    out.write(memoryview(data[lo : lo + COPY_CHUNK]))
                    if self.meter is not None:
                        self.meter.advance(min(COPY_CHUNK, data.size - lo))
                end = offset + int(data.size)
                entries[n] = Placement(job.shard, offset, end, digests[n])
                offset = end
                del data
        return entries, offset, out.fact()

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
        apply_payload(self.settings.encoding, name, result, entry, self.spool)
        return result
