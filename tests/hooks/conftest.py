"""Object-store servers for the hook tests (one of each per session, a fresh prefix per test)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from deltastore.testing.servers import GCSServer, S3Server, start_fake_gcs, start_moto_s3

BUCKET = "deltastore-hook-tests"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with start_moto_s3() as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    with start_fake_gcs() as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def gcs_url(gcs_server: GCSServer) -> str:
    return f"gs://{BUCKET}/{uuid.uuid4().hex[:12]}"
