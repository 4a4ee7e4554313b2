"""Session-wide object-store servers for the storage tests, and per-test store URLs.

Each server starts once per session (moto S3 in a thread, fake-gcs-server as a child
process, both on 127.0.0.1); every test gets its own prefix, so tests never see each other's
objects. ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set by ``tests/conftest.py`` before
gcsfs is imported.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from deltastore.testing.servers import GCSServer, S3Server, start_fake_gcs, start_moto_s3

S3_BUCKET = "deltastore-store-tests"
GCS_BUCKET = "deltastore-store-tests"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with start_moto_s3() as server:
        server.make_bucket(S3_BUCKET)
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    with start_fake_gcs() as server:
        server.make_bucket(GCS_BUCKET)
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A fresh ``s3://`` store root on the session's moto server."""
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def gcs_url(gcs_server: GCSServer) -> str:
    """A fresh ``gs://`` store root on the session's fake-gcs-server."""
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:12]}"
