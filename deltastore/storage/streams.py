"""Reading a whole file front to back in blocks (one streamed GET on an object store), and
the sink a download feeds each byte to as it is written, so the disk flush and the digests run
while the transfer goes on. s3fs's ``get_file`` does neither: it fetches 50 MiB ranges
concurrently and writes each batch whole, so nothing reaches the file until the end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Coroutine, Generator, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

T = TypeVar("T")


class _AsyncStream(Protocol):
    async def read(self, length: int = -1) -> bytes: ...

    async def close(self) -> None: ...


def file_blocks(fs: AbstractFileSystem, path: str, block: int) -> Generator[bytes, None, None]:
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(block):
            yield chunk


def streams_async(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` reads a whole file as one stream (``open_async``: s3fs, not gcsfs); not
    an s3fs with per-request options (``requester_pays``), which its streamed read leaves out."""
    from fsspec.asyn import AsyncFileSystem

    return (
        isinstance(fs, AsyncFileSystem)
        and type(fs).open_async is not AsyncFileSystem.open_async
        and not getattr(fs, "req_kw", None)
    )


def streamed_blocks(fs: AbstractFileSystem, path: str, block: int) -> Generator[bytes, None, None]:
    """The file's bytes in order, about ``block`` bytes at a time, from one GET of the whole
    object; the next block is read on fsspec's IO loop while the caller handles this one (at
    most two are held). Closing the iterator early closes the response."""
    loop: asyncio.AbstractEventLoop = fs.loop  # type: ignore[attr-defined]

    def on_loop(coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, loop)

    stream: _AsyncStream = on_loop(fs.open_async(path, "rb")).result()  # type: ignore[attr-defined]
    ahead = on_loop(_fill(stream, block))
    try:
        while True:
            data = ahead.result()
            if not data:
                return
            ahead = on_loop(_fill(stream, block))
            yield data
    finally:
        ahead.cancel()
        on_loop(_close(stream)).result()


async def _fill(stream: _AsyncStream, block: int) -> bytes:
    """Up to ``block`` bytes (fewer only at the end; a read returns what the socket had)."""
    pieces: list[bytes] = []
    got = 0
    while got < block:
        piece = await stream.read(block - got)
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def _close(stream: _AsyncStream) -> None:
    # s3fs's streamed file leaves its response open on close (it holds it as ``r``): a stream
    # abandoned midway must release its connection now, not when it is collected.
    body = getattr(stream, "r", None)
    if body is not None:
        body.close()
    await stream.close()


class DownloadSink(Protocol):
    """What :meth:`VersionStore.download` feeds a file's bytes to as they arrive; ``restart``:
    the file comes again from its first byte (a retry)."""

    def restart(self) -> None: ...

    def update(self, data: bytes) -> None: ...


def feed(sink: DownloadSink | None, blocks: Iterable[bytes], out: BinaryIO | None = None) -> int:
    """Pass ``blocks`` in order to ``sink`` and to ``out`` (each when given); their size."""
    size = 0
    for data in blocks:
        if out is not None:
            out.write(data)
        if sink is not None:
            sink.update(data)
        size += len(data)
    return size
