"""Reading a whole file front to back in blocks (one streamed GET on an object store), and
the sink a download feeds each byte to as it is written, so the disk flush and the digests run
while the transfer goes on. s3fs's ``get_file`` does neither: it fetches 50 MiB ranges
concurrently and writes each batch whole, so nothing reaches the file until the end. And the
other way, :class:`PartUploads`: an S3 object written with its parts overlapping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
from collections.abc import Callable, Coroutine, Generator, Iterable
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


class PartUploads:
    """An S3 object written as a multipart upload with up to ``inflight`` parts of ``part_size``
    going up at once, the next filling meanwhile (s3fs's own file waits for each part before it
    takes another byte, so a shard's upload is as slow as its round trips in a row). A file
    under one part is one PUT. Holds at most ``inflight + 1`` parts; the file-like subset a
    shard writer uses: ``write``, ``close`` (completes), ``discard`` (aborts; a failed part or
    completion aborts by itself)."""

    def __init__(self, fs: Any, path: str, part_size: int, inflight: int = 2) -> None:
        self.fs, self.path, self.part_size, self.inflight = fs, path, part_size, inflight
        self.bucket, self.key, _ = fs.split_path(path)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[cf.Future[dict[str, Any]]] = []
        self.pending: set[cf.Future[dict[str, Any]]] = set()
        self.closed = False

    def _call(self, method: str, **kwargs: Any) -> cf.Future[dict[str, Any]]:
        coro = self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        while view:  # a large write is taken a part at a time, never held whole
            room = self.part_size - len(self.buffer)
            self.buffer += view[:room]
            view = view[room:]
            if len(self.buffer) == self.part_size:
                part, self.buffer = self.buffer, bytearray()
                self._or_discard(self._send, part)
        return size

    def close(self) -> None:
        if self.closed:
            return
        if self.upload_id is None:
            self._call("put_object", Body=bytes(self.buffer)).result()
        else:
            part, self.buffer = self.buffer, bytearray()
            self._or_discard(self._complete, part)
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abandon the upload: no object is made; the parts sent are deleted."""
        self.buffer = bytearray()
        cf.wait(self.parts)
        if self.upload_id is not None:
            self._call("abort_multipart_upload", UploadId=self.upload_id).result()
            self.upload_id = None
        self.closed = True

    def _or_discard(self, step: Callable[[bytearray], None], part: bytearray) -> None:
        try:
            step(part)
        except BaseException:
            # The error that ended the upload is the one to see, not a failed clean-up's.
            with contextlib.suppress(Exception):
                self.discard()
            raise

    def _send(self, part: bytearray) -> None:
        if self.upload_id is None:
            self.upload_id = self._call("create_multipart_upload").result()["UploadId"]
        self._settle()
        while len(self.pending) >= self.inflight:
            cf.wait(self.pending, return_when=cf.FIRST_COMPLETED)
            self._settle()
        number = len(self.parts) + 1
        body = bytes(part)  # (the caller's bytearray goes when this returns)
        future = self._call("upload_part", UploadId=self.upload_id, PartNumber=number, Body=body)
        self.parts.append(future)
        self.pending.add(future)

    def _settle(self) -> None:
        """Forget the parts that went up; one that failed fails the upload now, not at the end."""
        for future in [f for f in self.pending if f.done()]:
            self.pending.discard(future)
            future.result()

    def _complete(self, last: bytearray) -> None:
        if last:
            self._send(last)
        tags = [{"PartNumber": i, "ETag": f.result()["ETag"]} for i, f in enumerate(self.parts, 1)]
        done = {"Parts": tags}
        self._call(
            "complete_multipart_upload", UploadId=self.upload_id, MultipartUpload=done
        ).result()
