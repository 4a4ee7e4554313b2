"""Compressed delta payloads of one publish, held between the diff and the shard writes, and
the :class:`Encoded` record that addresses each one."""

from __future__ import annotations

import os
import tempfile
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, BinaryIO

from deltastore.codecs import ByteArray, Encoding, XorChanges, decompress

COPY_CHUNK = 64 * 1024**2
"""Bytes copied per write call when streaming a payload or tensor into a shard."""
JOIN_BYTES = 4 * 1024**2
"""Small in-memory payloads are joined into writes of about this many bytes."""


class PayloadSpool(AbstractContextManager["PayloadSpool"]):
    """Compressed payloads as they are produced, addressed by a virtual offset: each its own
    ``bytes`` object in memory (no growing buffer to reallocate and copy) until
    ``memory_bytes`` are held, then in an anonymous temp file. Encode workers append directly."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.size = 0
        self._memory: dict[int, bytes] = {}
        self._in_memory = 0
        self._file: Any = None
        self._on_disk: dict[int, int] = {}
        self._lock = threading.Lock()

    def append(self, frame: bytes) -> tuple[int, int]:
        with self._lock:
            offset = self.size
            self.size += len(frame)
            if self._in_memory + len(frame) <= self.memory_bytes:
                self._memory[offset] = frame
                self._in_memory += len(frame)
            else:
                if self._file is None:
                    self._file = tempfile.TemporaryFile(prefix="deltastore-spool-")  # noqa: SIM115
                self._file.seek(0, os.SEEK_END)
                self._on_disk[offset] = self._file.tell()
                self._file.write(frame)
            return offset, len(frame)

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            frame = self._memory.get(offset)
            if frame is not None:
                return frame
            self._file.seek(self._on_disk[offset])
            return bytes(self._file.read(length))

    def copy_many_to(self, out: BinaryIO, spans: list[tuple[int, int]]) -> None:
        """Write the frames at ``spans`` ((offset, length), in order) to ``out`` back to back:
        small in-memory frames joined into writes of up to :data:`JOIN_BYTES` (a shard of
        thousands of payloads takes a few large writes), the others in chunks."""
        pending: list[bytes] = []
        pending_bytes = 0
        for offset, length in spans:
            with self._lock:
                frame = self._memory.get(offset)
                position = self._on_disk.get(offset)
            if frame is not None and length < JOIN_BYTES:
                pending.append(frame)
                pending_bytes += length
                if pending_bytes < JOIN_BYTES:
                    continue
            if pending:
                out.write(pending[0] if len(pending) == 1 else b"".join(pending))
                pending, pending_bytes = [], 0
            if frame is not None and length >= JOIN_BYTES:
                view = memoryview(frame)
                for lo in range(0, length, COPY_CHUNK):
                    out.write(view[lo : lo + COPY_CHUNK])
            elif frame is None:
                assert position is not None
                for lo in range(0, length, COPY_CHUNK):
                    with self._lock:
                        self._file.seek(position + lo)
                        chunk = self._file.read(min(length - lo, COPY_CHUNK))
                    out.write(chunk)
        if pending:
            out.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._memory.clear()
        if self._file is not None:
            self._file.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Encoded:
    """One diffed tensor: its new digest and where its compressed payload sits in the spool."""

    name: str
    changed_bytes: int
    digest: str
    offset: int
    length: int
    changes: XorChanges | None = None
    """The change in element form where there is one (applied instead of the payload when
    the snapshot advances: no second decode)."""


def apply_frame(
    encoding: Encoding, name: str, target: ByteArray, frame: bytes, where: str = ""
) -> None:
    """Apply a compressed payload to ``target`` in place (size-checked before decompressing);
    ``where`` follows the tensor's name in an error."""
    payload = decompress(
        frame,
        max_size=encoding.max_payload_size(target.size),
        what=f"payload of tensor {name!r}{where}",
    )
    encoding.apply(target, payload, tensor=name)
