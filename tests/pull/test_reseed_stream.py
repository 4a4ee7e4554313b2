"""A reseed from a full version in S3 reads each shard in one streamed GET and checks every
tensor's digest as the bytes arrive (moto, through a counting proxy).

The shard here is 14 MB: past two of the store's 8 MiB streamed blocks, and past the 5 MiB
``default_block_size`` given to s3fs, above which ``fs.get_file`` would first send a GET only
to learn the size and then fetch the file in concurrent ranges (four GETs for this shard).
"""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch

import deltastore as ds
import deltastore.storage.streams as streams
from deltastore.errors import IntegrityError
from deltastore.testing.faults import FaultProxy
from tests.conftest import checkpoint_bytes, make_checkpoint, raw_bytes

MiB = 1024**2
Bytes = dict[str, bytes]


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "a.weight": torch.randn(1 << 20, generator=g),  # 4 MiB
        "b.weight": torch.randn(5 << 19, generator=g),  # 10 MiB: across the 8 MiB block edge
        "c.bias": torch.randn(300, generator=g),
    }


@pytest.fixture
def published(tmp_path: Path, s3_server, s3_url: str):
    """v1 a delta, v2 a full version, in S3; a host at v1; the bytes at v1 and v2."""
    model = _model()
    base = make_checkpoint(tmp_path / "base", model)
    options = s3_server.storage_options
    publisher = ds.DeltaPublisher(s3_url, base, storage_options=options)
    publisher.seed()
    states: dict[int, Bytes] = {}
    for version in (1, 2):
        model = {n: t.clone() for n, t in model.items()}
        for tensor in model.values():
            tensor[version::997] += 1.0
        publisher.publish(model.items(), full=version == 2)
        states[version] = {n: raw_bytes(t) for n, t in model.items()}
    host = tmp_path / "host"
    ds.pull_weights(host, s3_url, 1, base, storage_options=options)
    assert checkpoint_bytes(host) == states[1]
    return host, base, states


def _full_shard(s3_server, s3_url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(s3_url, **s3_server.storage_options)
    (shard,) = [p for p in fs.ls(f"{root}/weight_v000002") if p.endswith(".safetensors")]
    return fs, shard


def test_a_reseed_reads_the_shard_in_one_get(published, s3_server, s3_url: str) -> None:
    host, base, states = published
    _, shard = _full_shard(s3_server, s3_url)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        options["default_block_size"] = 5 * MiB
        result = ds.pull_weights(host, s3_url, 2, base, storage_options=options)
    assert result.action == "reseeded"
    assert checkpoint_bytes(host) == states[2]
    shard_requests = [(m, p) for m, p in proxy.seen if shard.split("/", 1)[1] in p]
    assert shard_requests == [("GET", f"/{shard}")]


def test_a_byte_flipped_past_the_first_block_is_caught_and_the_host_stays(
    published, s3_server, s3_url: str
) -> None:
    host, base, states = published
    fs, shard = _full_shard(s3_server, s3_url)
    data = bytearray(fs.cat_file(shard))
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    start, end = header["b.weight"]["data_offsets"]
    data_start = 8 + int.from_bytes(data[:8], "little")
    flip = data_start + start + 9 * MiB - 4 * MiB  # 9 MiB into the file: the second block
    assert data_start + start < flip < data_start + end and flip > 8 * MiB
    data[flip] ^= 0x10
    fs.pipe_file(shard, bytes(data))

    with pytest.raises(IntegrityError, match=r"weight_v000002.*b\.weight"):
        ds.pull_weights(host, s3_url, 2, base, storage_options=s3_server.storage_options)
    assert checkpoint_bytes(host) == states[1]
    state = json.loads((host / ".weight_sync" / "state.json").read_text())
    assert state["version"] == "000001"
    assert not (host / ".weight_sync" / "staging").exists()
    options = s3_server.storage_options
    assert ds.verify_local(host, s3_url, base_dir=base, storage_options=options) == 1


def test_a_stream_cut_midway_is_downloaded_again_and_verified(
    published, s3_server, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, base, states = published
    real = streams._fill
    calls = []

    async def cut_once(stream, block):  # type: ignore[no-untyped-def]
        calls.append(block)
        if len(calls) == 2:  # the second block of the first try: half the shard was written
            raise ConnectionResetError("injected: connection reset mid-body")
        return await real(stream, block)

    monkeypatch.setattr(streams, "_fill", cut_once)
    result = ds.pull_weights(host, s3_url, 2, base, storage_options=s3_server.storage_options)
    assert result.action == "reseeded"
    assert len(calls) > 3  # the shard was read again from its start
    assert checkpoint_bytes(host) == states[2]
    assert ds.verify_local(host, s3_url, storage_options=s3_server.storage_options) == 2


def test_a_reseed_sends_three_requests(published, s3_server, s3_url: str) -> None:
    """The target's index, read once (the walk from the host's version found a full version
    and the full walk reuses it), its tombstone probe (one ranged GET, not a HEAD and a
    listing), and the shard."""
    host, base, states = published
    _, shard = _full_shard(s3_server, s3_url)
    root = s3_url.removeprefix("s3://")
    with FaultProxy(s3_server.endpoint_url) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        ds.pull_weights(host, s3_url, 2, base, storage_options=options)
    assert proxy.seen == [
        ("GET", f"/{root}/weight_v000002/model.safetensors.index.json"),
        ("GET", f"/{root}/_claims/weight_v000002.abort"),
        ("GET", f"/{shard}"),
    ]
    assert checkpoint_bytes(host) == states[2]
