"""Whole-file streamed reads (``deltastore.storage.streams``) against moto: blocks in order,
an early close that releases the response, a missing object, and which filesystems stream."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest

from deltastore.storage.streams import PartUploads, streamed_blocks, streams_async

MiB = 1024**2


@pytest.fixture
def s3(s3_server, s3_url: str):
    fs, root = fsspec.core.url_to_fs(s3_url, **s3_server.storage_options)
    data = bytes(range(256)) * (5 * MiB // 256) + b"end"
    fs.pipe_file(f"{root}/obj", data)
    return fs, f"{root}/obj", data


def test_blocks_come_in_order_and_full_sized(s3) -> None:
    fs, path, data = s3
    blocks = list(streamed_blocks(fs, path, MiB))
    assert b"".join(blocks) == data
    assert [len(b) for b in blocks[:-1]] == [MiB] * 5 and blocks[-1] == b"end"


@pytest.mark.timeout(60)  # a leaked connection per stream: the pool runs dry and it hangs
def test_an_early_close_releases_the_stream(s3) -> None:
    fs, path, data = s3
    for _ in range(12):  # more than the client's connection pool, were each one kept
        blocks = streamed_blocks(fs, path, MiB)
        assert next(blocks) == data[:MiB]
        blocks.close()
    assert fs.cat_file(path, start=0, end=4) == data[:4]


def test_a_missing_object_raises_file_not_found(s3) -> None:
    fs, path, _ = s3
    with pytest.raises(FileNotFoundError):
        list(streamed_blocks(fs, path + "-missing", MiB))


def test_which_filesystems_stream(s3_server) -> None:
    options = s3_server.storage_options
    plain = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    payer = fsspec.filesystem("s3", skip_instance_cache=True, requester_pays=True, **options)
    assert streams_async(plain)
    assert not streams_async(payer)  # its streamed read would drop RequestPayer
    assert not streams_async(fsspec.filesystem("file"))
    assert not streams_async(fsspec.filesystem("memory"))


# ------------------------------------------------------------------ PartUploads (S3 writes)
class _Calls:
    """Wraps an s3fs's ``_call_s3``: counts the calls by method and the most ``upload_part``
    calls in flight at once; each part takes ``part_delay`` s (so parts overlap whenever the
    writer lets them); ``fail_part``: that part number raises."""

    def __init__(self, fs, part_delay: float = 0.0, fail_part: int | None = None) -> None:
        self.fs, self.real = fs, fs._call_s3
        self.part_delay, self.fail_part = part_delay, fail_part
        self.methods: list[str] = []
        self.in_flight = self.most_in_flight = 0

    async def __call__(self, method: str, *args, **kwargs):
        import asyncio

        self.methods.append(method)
        if method != "upload_part":
            return await self.real(method, *args, **kwargs)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.part_delay)
            if kwargs["PartNumber"] == self.fail_part:
                raise OSError(f"part {self.fail_part} refused")
            return await self.real(method, *args, **kwargs)
        finally:
            self.in_flight -= 1


@pytest.fixture
def s3_fs(s3_server, s3_url: str, monkeypatch: pytest.MonkeyPatch):
    fs, root = fsspec.core.url_to_fs(s3_url, **s3_server.storage_options)

    def wrap(**kwargs) -> _Calls:
        calls = _Calls(fs, **kwargs)
        monkeypatch.setattr(fs, "_call_s3", calls)
        return calls

    return fs, root, wrap


def _open_uploads(fs, root: str) -> list:
    bucket, prefix = root.split("/", 1)
    found = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return found.get("Uploads", [])


def test_parts_go_up_two_at_a_time_and_make_the_object(s3_fs) -> None:
    fs, root, wrap = s3_fs
    calls = wrap(part_delay=0.2)
    data = bytes(range(256)) * (23 * MiB // 256) + b"tail"  # 4 whole parts and a short last
    upload = PartUploads(fs, f"{root}/shard", 5 * MiB, inflight=2)
    for at in range(0, len(data), 3 * MiB + 7):  # writes that do not line up with parts
        upload.write(memoryview(data)[at : at + 3 * MiB + 7])
    upload.close()
    assert fs.cat_file(f"{root}/shard") == data
    assert calls.methods.count("upload_part") == 5
    assert calls.most_in_flight == 2  # overlapped, and never more than asked
    assert "complete_multipart_upload" in calls.methods and not _open_uploads(fs, root)


def test_a_file_under_one_part_is_one_put(s3_fs) -> None:
    fs, root, wrap = s3_fs
    calls = wrap()
    for name, data in (("small", b"x" * 1000), ("empty", b"")):
        upload = PartUploads(fs, f"{root}/{name}", 5 * MiB)
        upload.write(data)
        upload.close()
        assert fs.cat_file(f"{root}/{name}") == data
    assert calls.methods.count("put_object") == 2 and "create_multipart_upload" not in calls.methods
    words = np.arange(1000, dtype=np.uint16)  # a view of 2-byte items: counted in bytes
    upload = PartUploads(fs, f"{root}/words", 5 * MiB)
    assert upload.write(memoryview(words)) == 2000
    upload.close()
    assert fs.cat_file(f"{root}/words") == words.tobytes()


def test_a_failed_part_fails_the_upload_and_leaves_nothing(s3_fs) -> None:
    fs, root, wrap = s3_fs
    wrap(fail_part=2)
    upload = PartUploads(fs, f"{root}/shard", 5 * MiB, inflight=2)
    with pytest.raises(OSError, match="part 2 refused"):
        for _ in range(8):  # the failure is seen at a later write, or at close at the latest
            upload.write(b"\0" * (2 * MiB))
        upload.close()
    assert not fs.exists(f"{root}/shard") and not _open_uploads(fs, root)


def test_a_discarded_upload_leaves_no_object_and_no_parts(s3_fs) -> None:
    fs, root, wrap = s3_fs
    wrap()
    upload = PartUploads(fs, f"{root}/shard", 5 * MiB)
    upload.write(b"\1" * (11 * MiB))
    upload.discard()
    assert upload.closed and not fs.exists(f"{root}/shard") and not _open_uploads(fs, root)
