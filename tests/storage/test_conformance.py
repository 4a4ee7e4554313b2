"""The shipped store conformance class, run against a local directory, ``memory://``, S3
(moto's HTTP server, via s3fs) and GCS (fake-gcs-server, via gcsfs)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltastore.format.names import INDEX_NAME
from deltastore.storage import RetryPolicy, VersionStore
from deltastore.testing.faults import Fault, FaultProxy, s3_error
from deltastore.testing.servers import GCSServer, S3Server
from deltastore.testing.store_tests import StoreConformance

MiB = 1024**2


def recording_retry(waits: list[float]) -> RetryPolicy:
    """Retries whose waits are recorded instead of slept."""
    return RetryPolicy(attempts=4, deadline_s=60.0, sleep=waits.append)


class TestLocalStore(StoreConformance):
    block_size = MiB

    @pytest.fixture
    def store_url(self, tmp_path: Path) -> str:
        return str(tmp_path / "store")


class TestMemoryStore(StoreConformance):
    supports_processes = False
    block_size = MiB

    @pytest.fixture
    def store_url(self) -> str:
        return f"memory://deltastore-{uuid.uuid4().hex}"


class TestS3Store(StoreConformance):
    block_size = 5 * MiB  # S3's minimum part size: a 10 MiB file is a real multipart upload

    @pytest.fixture
    def store_url(self, s3_url: str) -> str:
        return s3_url

    @pytest.fixture
    def storage_options(self, s3_server: S3Server) -> dict[str, Any]:
        return s3_server.storage_options

    @pytest.fixture
    def faulty(
        self, s3_server: S3Server, store_url: str, storage_options: dict[str, Any]
    ) -> Iterator[tuple[VersionStore, FaultProxy, list[float]]]:
        waits: list[float] = []
        with FaultProxy(s3_server.endpoint_url) as proxy:
            options = proxy.storage_options(storage_options)
            store = VersionStore(
                store_url, options, retry=recording_retry(waits), block_size=self.block_size
            )
            yield store, proxy, waits

    def index_write_fault(self, action: str, **kwargs: Any) -> Fault:
        return Fault(action, method="PUT", path_contains=INDEX_NAME, **kwargs)

    def transient_fault(self) -> Fault:
        # Neither botocore nor s3fs retries a 409 ConditionalRequestConflict.
        return self.index_write_fault(
            "status", status=409, body=s3_error("ConditionalRequestConflict"), times=2
        )


class TestGCSStore(StoreConformance):
    block_size = 256 * 1024

    @pytest.fixture
    def store_url(self, gcs_url: str) -> str:
        return gcs_url

    @pytest.fixture
    def storage_options(self, gcs_server: GCSServer) -> dict[str, Any]:
        return gcs_server.storage_options

    @pytest.fixture
    def faulty(
        self, gcs_server: GCSServer, store_url: str, storage_options: dict[str, Any]
    ) -> Iterator[tuple[VersionStore, FaultProxy, list[float]]]:
        waits: list[float] = []
        with FaultProxy(gcs_server.endpoint_url) as proxy:
            options = proxy.storage_options(storage_options)
            options["requests_timeout"] = 1.0
            store = VersionStore(
                store_url, options, retry=recording_retry(waits), block_size=self.block_size
            )
            yield store, proxy, waits

    def index_write_fault(self, action: str, **kwargs: Any) -> Fault:
        # gcsfs uploads small objects as one POST naming the object in its body.
        return Fault(
            action,
            method="POST",
            path_contains="/upload/",
            body_contains=INDEX_NAME.encode(),
            **kwargs,
        )

    def transient_fault(self) -> Fault:
        # gcsfs retries 5xx itself (sleeping 1-2 s); a request timeout reaches our layer.
        return self.index_write_fault("stall", stall_s=1.5)
