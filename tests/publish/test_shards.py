"""A shard's whole-file BLAKE3 (for the signature) is taken from the bytes as they stream out,
on a thread of its own beside the writes, and is the hash of exactly what was written."""

from __future__ import annotations

import io
import threading

import blake3
import pytest

from deltastore.publish import shards
from deltastore.trust.manifest import ShardFact, ShardHasher


class _SlowSink(io.BytesIO):
    """A file whose writes take a while and note their thread, as an upload's would."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def write(self, data: object) -> int:
        self.threads.add(threading.get_ident())
        threading.Event().wait(0.002)
        return super().write(data)  # type: ignore[arg-type]


def test_pieces_are_hashed_beside_their_writes_and_the_fact_is_the_files_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed_on: set[int] = set()
    real = ShardHasher.update

    def noted(self: ShardHasher, data: bytes | bytearray | memoryview) -> None:
        hashed_on.add(threading.get_ident())
        real(self, data)

    monkeypatch.setattr(ShardHasher, "update", noted)
    pieces = [bytes([i]) * (1 << 16) + b"tail" for i in range(16)]
    sink = _SlowSink()
    with shards._HashingWriter(sink) as out:
        for piece in pieces:
            out.write(memoryview(piece))
    whole = b"".join(pieces)
    assert sink.getvalue() == whole
    assert out.fact() == ShardFact(len(whole), blake3.blake3(whole).hexdigest())
    assert hashed_on and not hashed_on & sink.threads, "hashed on the writing thread"
    assert not any(t.name.startswith("deltastore-shard-hash") for t in threading.enumerate())


def test_a_failed_write_ends_the_hash_thread_and_raises_it() -> None:
    class Failing(io.BytesIO):
        def write(self, data: object) -> int:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), shards._HashingWriter(Failing()) as out:
        out.write(b"x" * 1024)
    assert not any(t.name.startswith("deltastore-shard-hash") for t in threading.enumerate())
