"""Requests a pull sends do not grow with the chain's length (counted through a real proxy).

A host that holds a verified version of the stream reads only what is new: a one-step pull
near the start of a long chain of deltas and one far along it send the same number of HTTP
requests to the S3 server (moto), and a catch-up of k versions costs the same wherever it is.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

import deltastore as ds
from deltastore.testing.faults import FaultProxy
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes

LAST = 40


@pytest.fixture
def long_chain(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], s3_server, s3_url
):
    """LAST deltas published locally, then uploaded as they are to the S3 server."""
    local = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(local, base_dir)
    publisher.seed()
    model, states = small_model, {}
    for version in range(1, LAST + 1):
        model = perturb(model, version)
        publisher.publish(model.items())
        states[version] = {n: raw_bytes(t) for n, t in model.items()}
    fs, root = fsspec.core.url_to_fs(s3_url, **s3_server.storage_options)
    fs.put(str(tmp_path / "store") + "/", root, recursive=True)
    return states


def _counted_pull(host: Path, base_dir: Path, s3_server, s3_url: str, version: int) -> int:
    with FaultProxy(s3_server.endpoint_url) as proxy:
        options = proxy.storage_options(s3_server.storage_options)
        result = ds.pull_weights(host, s3_url, version, base_dir, storage_options=options)
        assert result.version == version
        return proxy.requests


def test_one_step_pull_costs_the_same_at_v5_and_v40(
    tmp_path: Path, base_dir: Path, long_chain, s3_server, s3_url
) -> None:
    options = s3_server.storage_options
    counts = {}
    for at in (4, LAST - 1):
        host = tmp_path / f"host{at}"
        ds.pull_weights(host, s3_url, at, base_dir, storage_options=options)
        counts[at + 1] = _counted_pull(host, base_dir, s3_server, s3_url, at + 1)
        assert checkpoint_bytes(host) == long_chain[at + 1]
    assert counts[5] == counts[LAST], counts


def test_catch_up_costs_the_versions_applied_not_the_chain(
    tmp_path: Path, base_dir: Path, long_chain, s3_server, s3_url
) -> None:
    options = s3_server.storage_options
    counts = {}
    for at in (2, LAST - 3):
        host = tmp_path / f"host{at}"
        ds.pull_weights(host, s3_url, at, base_dir, storage_options=options)
        counts[at] = _counted_pull(host, base_dir, s3_server, s3_url, at + 3)
        assert checkpoint_bytes(host) == long_chain[at + 3]
    assert counts[2] == counts[LAST - 3], counts


def _many_tensor_step(tmp_path: Path, s3_server, s3_url: str, count: int) -> tuple[Path, dict]:
    """A model of ``count`` tensors published to S3 (seed, then one step changing every
    tensor); returns the base and the bytes at v1."""
    generator = torch.Generator().manual_seed(count)
    model = {f"experts.{i:04d}.weight": torch.randn(256, generator=generator) for i in range(count)}
    base = make_checkpoint(tmp_path / f"base{count}", model)
    url = f"{s3_url}/many{count}"
    publisher = ds.DeltaPublisher(url, base, storage_options=s3_server.storage_options)
    publisher.seed()
    step = {n: t + 1.0 for n, t in model.items()}
    publisher.publish(step.items())
    return base, {n: raw_bytes(t) for n, t in step.items()}


def test_one_step_pull_requests_do_not_grow_with_the_tensor_count(
    tmp_path: Path, s3_server, s3_url
) -> None:
    # Payloads are read a window at a time (one ranged read per run of nearby payloads), not
    # one request per changed tensor: 16 and 400 changed tensors cost the same requests.
    counts = {}
    for count in (16, 400):
        base, expected = _many_tensor_step(tmp_path, s3_server, s3_url, count)
        host = tmp_path / f"host{count}"
        url = f"{s3_url}/many{count}"
        ds.pull_weights(host, url, 0, base, storage_options=s3_server.storage_options)
        counts[count] = _counted_pull(host, base, s3_server, url, 1)
        assert checkpoint_bytes(host) == expected
    assert counts[16] == counts[400], counts
