"""What the local S3 and GCS emulators honour, observed through s3fs and gcsfs.

These pin the behaviour the storage layer relies on (create-only writes, ranged reads,
listing caches) so an emulator or client upgrade that changes it fails here first, and they
check the server helpers in ``deltastore.testing.servers`` themselves. Known emulator gaps
are strict xfails: if an upgrade closes one, the xfail turns into a failure to revisit.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class when first imported; the experimental one probes every
# bucket over gRPC and retries for about a minute against an emulator.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from fsspec import AbstractFileSystem

from deltastore.testing.servers import (
    GCSServer,
    S3Server,
    gcs_env,
    s3_env,
    start_fake_gcs,
    start_moto_s3,
)

MiB = 2**20
BUCKET = "deltastore-emulators"
# s3fs refuses write blocks under 5 MiB, so a multipart S3 upload needs just over 5 MiB.
S3_BLOCK = 5 * MiB
# GCS resumable chunks must be multiples of 256 KiB; small blocks keep the test fast.
GCS_BLOCK = 256 * 1024

Server = S3Server | GCSServer

gcs_ignores_resumable_precondition = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="fake-gcs-server ignores ifGenerationMatch=0 on resumable uploads "
    "(and gcsfs open() always uploads resumably)",
)


@pytest.fixture(scope="module", params=["s3", "gcs"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """One emulator per backend for the whole module, with bucket ``BUCKET`` created."""
    started: Server = start_moto_s3() if request.param == "s3" else start_fake_gcs()
    with started:
        started.make_bucket(BUCKET)
        yield started


def new_fs(server: Server, **options: Any) -> AbstractFileSystem:
    """A fresh filesystem instance, so no cache is shared with any other instance."""
    fs = fsspec.filesystem(
        server.protocol, skip_instance_cache=True, **{**server.storage_options, **options}
    )
    # The experimental class would make every call stall on gRPC probes: fail fast instead.
    assert type(fs).__name__ != "ExtendedGcsFileSystem", "gcsfs was imported too early"
    return fs


@pytest.fixture
def prefix() -> str:
    """A directory no other test uses, as ``bucket/name``."""
    return f"{BUCKET}/{uuid.uuid4().hex}"


def xfail_on_gcs(request: pytest.FixtureRequest, mark: pytest.MarkDecorator) -> None:
    """Apply ``mark`` when the current ``server`` parameter is GCS."""
    if request.node.callspec.params["server"] == "gcs":
        request.applymarker(mark)


def test_round_trip_and_ranged_reads(server: Server, prefix: str) -> None:
    fs = new_fs(server)
    path = f"{prefix}/x.bin"
    fs.pipe_file(path, b"0123456789")

    assert fs.cat_file(path) == b"0123456789"
    assert fs.cat_file(path, start=2, end=5) == b"234"
    assert fs.cat_file(path, start=-3) == b"789"
    assert fs.cat_file(path, start=8, end=100) == b"89"
    assert fs.info(path)["size"] == 10


def test_create_only_second_write_raises(server: Server, prefix: str) -> None:
    fs = new_fs(server)
    path = f"{prefix}/commit"
    fs.pipe_file(path, b"first", mode="create")

    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"


def test_create_only_race_has_exactly_one_winner(server: Server, prefix: str) -> None:
    writers = 8
    path = f"{prefix}/commit"
    # Built before the race so client start-up does not spread the writers out.
    filesystems = [new_fs(server) for _ in range(writers)]
    barrier = threading.Barrier(writers)
    winners: list[int] = []
    errors: list[BaseException] = []

    def write(index: int) -> None:
        barrier.wait()
        try:
            filesystems[index].pipe_file(path, f"writer {index}".encode(), mode="create")
            winners.append(index)
        except FileExistsError:
            pass
        except BaseException as exc:  # surfaced below: a thread cannot fail the test
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert len(winners) == 1
    assert new_fs(server).cat_file(path) == f"writer {winners[0]}".encode()


def test_listing_cache_hides_new_file_until_invalidated(server: Server, prefix: str) -> None:
    reader, writer = new_fs(server), new_fs(server)
    old, new = f"{prefix}/d/old", f"{prefix}/d/new"
    writer.pipe_file(old, b"1")
    assert reader.ls(f"{prefix}/d", detail=False) == [old]

    writer.pipe_file(new, b"2")
    assert reader.ls(f"{prefix}/d", detail=False) == [old]
    assert not reader.exists(new)

    # Invalidating a parent does not clear the cached listing of its child directory.
    reader.invalidate_cache(prefix)
    assert reader.ls(f"{prefix}/d", detail=False) == [old]

    reader.invalidate_cache(f"{prefix}/d")
    assert sorted(reader.ls(f"{prefix}/d", detail=False)) == [new, old]
    assert reader.exists(new)


def test_stale_listing_effect_on_reads_differs(server: Server, prefix: str) -> None:
    """s3fs answers reads from a stale listing; gcsfs reads go to the server but
    ``info(refresh=True)`` still trusts the listing."""
    reader, writer = new_fs(server), new_fs(server)
    writer.pipe_file(f"{prefix}/old", b"1")
    reader.ls(prefix)
    path = f"{prefix}/new"
    writer.pipe_file(path, b"22")

    if server.protocol == "s3":
        with pytest.raises(FileNotFoundError):
            reader.cat_file(path)
        assert reader.info(path, refresh=True)["size"] == 2
    else:
        assert reader.cat_file(path) == b"22"
        with pytest.raises(FileNotFoundError):
            reader.info(path, refresh=True)


def test_without_listing_cache_new_files_are_visible(server: Server, prefix: str) -> None:
    reader, writer = new_fs(server, use_listings_cache=False), new_fs(server)
    writer.pipe_file(f"{prefix}/old", b"1")
    reader.ls(prefix)
    writer.pipe_file(f"{prefix}/new", b"2")

    assert f"{prefix}/new" in reader.ls(prefix, detail=False)
    assert reader.cat_file(f"{prefix}/new") == b"2"


def _large_write_kwargs(server: Server) -> tuple[int, dict[str, Any]]:
    """A payload size and ``open`` kwargs that force a multipart (S3) or multi-chunk
    resumable (GCS) upload."""
    if server.protocol == "s3":
        return S3_BLOCK + MiB, {"block_size": S3_BLOCK}
    return 4 * GCS_BLOCK + 1000, {"block_size": GCS_BLOCK}


def test_large_upload_and_ranged_reads(server: Server, prefix: str) -> None:
    fs = new_fs(server)
    size, kwargs = _large_write_kwargs(server)
    data = os.urandom(size)
    path = f"{prefix}/big"
    with fs.open(path, "wb", **kwargs) as f:
        # Several writes: s3fs sends a part whenever a block fills, so this makes 2 parts.
        for start in range(0, size, 64 * 1024):
            f.write(data[start : start + 64 * 1024])

    if server.protocol == "s3":
        # A multipart ETag ends in "-<number of parts>": proof the upload was multipart.
        assert fs.info(path)["ETag"].strip('"').endswith("-2")
    assert fs.info(path)["size"] == size
    boundary = kwargs["block_size"]
    assert (
        fs.cat_file(path, start=boundary - 10, end=boundary + 10)
        == data[boundary - 10 : boundary + 10]
    )
    assert fs.cat_file(path, start=-5) == data[-5:]
    with fs.open(path, "rb") as f:
        f.seek(size // 2)
        assert f.read(100) == data[size // 2 : size // 2 + 100]
    assert fs.cat_file(path) == data


def test_create_only_large_upload_raises(
    server: Server, prefix: str, request: pytest.FixtureRequest
) -> None:
    xfail_on_gcs(request, gcs_ignores_resumable_precondition)
    fs = new_fs(server)
    size, kwargs = _large_write_kwargs(server)
    path = f"{prefix}/big"
    fs.pipe_file(path, b"first")

    try:
        with fs.open(path, "xb", **kwargs) as f:
            f.write(b"z" * size)
    except FileExistsError:
        pass
    assert fs.cat_file(path) == b"first"


def test_create_only_small_open_xb_raises(
    server: Server, prefix: str, request: pytest.FixtureRequest
) -> None:
    xfail_on_gcs(request, gcs_ignores_resumable_precondition)
    fs = new_fs(server)
    path = f"{prefix}/commit"
    fs.pipe_file(path, b"first")

    try:
        with fs.open(path, "xb") as f:
            f.write(b"second")
    except FileExistsError:
        pass
    assert fs.cat_file(path) == b"first"


def test_rm_file_and_recursive(server: Server, prefix: str) -> None:
    fs = new_fs(server)
    for name in ("a", "sub/b", "sub/deeper/c"):
        fs.pipe_file(f"{prefix}/{name}", b"x")

    fs.rm(f"{prefix}/a")
    assert not fs.exists(f"{prefix}/a")

    fs.rm(f"{prefix}/sub", recursive=True)
    assert not fs.exists(f"{prefix}/sub/deeper/c")
    # Object stores have no empty directories: with its last object gone, the prefix is gone.
    assert new_fs(server).find(prefix) == []
    assert not new_fs(server).exists(f"{prefix}/sub/b")


def test_rm_missing_file(server: Server, prefix: str) -> None:
    """Deleting a missing object is silent on S3 (as on AWS) and raises on gcsfs."""
    fs = new_fs(server)
    if server.protocol == "s3":
        fs.rm(f"{prefix}/missing")
    else:
        with pytest.raises(FileNotFoundError):
            fs.rm(f"{prefix}/missing")


def test_subprocess_reaches_server_by_env_alone(server: Server, prefix: str) -> None:
    path = f"{prefix}/shared"
    new_fs(server).pipe_file(path, b"from parent")
    env = gcs_env(server) if isinstance(server, GCSServer) else s3_env(server)
    # No storage options in the child: the environment alone must lead to the emulator.
    code = (
        "import fsspec, sys;"
        f"fs = fsspec.filesystem({server.protocol!r}, skip_instance_cache=True);"
        f"sys.stdout.write(fs.cat_file({path!r}).decode())"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout == "from parent"


def test_make_bucket_twice(server: Server) -> None:
    """moto's us-east-1 answers 200 for a bucket you already own; fake-gcs-server says 409."""
    if isinstance(server, S3Server):
        server.make_bucket(BUCKET)
    else:
        with pytest.raises(urllib.error.HTTPError) as info:
            server.make_bucket(BUCKET)
        assert info.value.code == 409


def test_fake_gcs_stop_reaps_process() -> None:
    server = start_fake_gcs()
    pid = server.pid
    with server, urllib.request.urlopen(f"{server.endpoint_url}/storage/v1/b") as resp:
        assert resp.status == 200
    server.stop()  # idempotent

    # Reaped: the pid is no longer our child (a zombie would still be waitable).
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.endpoint_url}/storage/v1/b", timeout=2)


def test_moto_stop_releases_port() -> None:
    server = start_moto_s3()
    with server:
        server.make_bucket("deltastore-stop-check")
    server.stop()  # idempotent

    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.endpoint_url}/", timeout=2)


def test_two_fake_gcs_servers_are_independent() -> None:
    with start_fake_gcs() as first, start_fake_gcs() as second:
        assert first.endpoint_url != second.endpoint_url
        first.make_bucket("only-in-first")
        with urllib.request.urlopen(f"{second.endpoint_url}/storage/v1/b", timeout=5) as resp:
            assert b"only-in-first" not in resp.read()
