"""Replication between real object-store servers (moto, fake-gcs-server), with a share of the
requests on both sides failed, stalled or left unanswered by a fault proxy."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

import deltastore as ds
from deltastore.replicate import ReplicationPolicy
from deltastore.storage import RetryPolicy, VersionStore
from deltastore.testing.servers import start_moto_s3
from tests.conftest import STORE_BUCKET
from tests.replicate.faults import RandomFaults
from tests.replicate.helpers import assert_pulls, assert_replica, publish_run
from tests.storage.models import write_base

KINDS = {1: "delta", 2: "full", 3: "delta", 4: "delta"}
# Small chunks: every shard is copied as many ranged reads, so faults land mid-file.
POLICY = ReplicationPolicy(chunk_bytes=1024, attempts=8)
PATIENT = RetryPolicy(attempts=8, deadline_s=60.0, initial_wait_s=0.05, max_wait_s=0.5)


def _faulty(server: Any, seed: int, share: float) -> RandomFaults:
    return RandomFaults(server.endpoint_url, share=share, seed=seed).start()


def _store(url: str, options: dict[str, Any]) -> VersionStore:
    return VersionStore(url, options, retry=PATIENT)


@pytest.mark.parametrize("dst_kind", ["gcs", "s3-other-endpoint"])
def test_s3_source_with_faults_on_both_sides(
    dst_kind: str, s3_server: Any, s3_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    base = write_base(tmp_path / "base")
    publish_run(VersionStore(s3_url, s3_server.storage_options), base, KINDS)
    if dst_kind == "gcs":
        dst_server = request.getfixturevalue("gcs_server")
        dst_url = request.getfixturevalue("gcs_url")
    else:
        # A second moto server: another endpoint (moto shares its buckets inside a process).
        dst_server = start_moto_s3()
        request.addfinalizer(dst_server.stop)
        dst_url = f"s3://{STORE_BUCKET}/replica-{uuid.uuid4().hex[:8]}"
    src_proxy = _faulty(s3_server, seed=1, share=0.08)
    dst_proxy = _faulty(dst_server, seed=2, share=0.08)
    request.addfinalizer(src_proxy.stop)
    request.addfinalizer(dst_proxy.stop)
    src = _store(s3_url, src_proxy.storage_options(s3_server.storage_options))
    dst = _store(dst_url, dst_proxy.storage_options(dst_server.storage_options))

    report = ds.replicate(src, dst, verify=True, jobs=3, policy=POLICY)

    assert report.copied == (1, 2, 3, 4)
    assert src_proxy.injected and dst_proxy.injected, "the faults must have hit both sides"
    clean_src = VersionStore(s3_url, s3_server.storage_options)
    clean_dst = VersionStore(dst_url, dst_server.storage_options)
    assert_replica(clean_src, clean_dst, [1, 2, 3, 4])
    assert_pulls(clean_dst, base, tmp_path / "host", [1, 4])


def test_local_to_s3_with_a_lost_index_acknowledgement(
    s3_server: Any, s3_url: str, tmp_path: Path
) -> None:
    from deltastore.testing.faults import Fault

    base = write_base(tmp_path / "base")
    src = VersionStore(tmp_path / "trainer")
    publish_run(src, base, KINDS)
    proxy = RandomFaults(s3_server.endpoint_url, share=0.0, seed=0).start()
    try:
        # The index of v2 lands, but its acknowledgement is lost: the commit must stand.
        proxy.add(Fault("drop-response", method="PUT", path_contains="weight_v000002/model."))
        dst = _store(s3_url, proxy.storage_options(s3_server.storage_options))
        report = ds.replicate(src, dst, jobs=2)
    finally:
        proxy.stop()
    assert report.copied == (1, 2, 3, 4)
    assert_replica(src, VersionStore(s3_url, s3_server.storage_options), [1, 2, 3, 4])
