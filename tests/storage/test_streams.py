"""Whole-file streamed reads (``deltastore.storage.streams``) against moto: blocks in order,
an early close that releases the response, a missing object, and which filesystems stream."""

from __future__ import annotations

import fsspec
import pytest

from deltastore.storage.streams import streamed_blocks, streams_async

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
