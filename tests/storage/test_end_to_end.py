"""publish → pull through each object store: DeltaPublisher on one client, pull_weights on
fresh hosts that reach the bucket by URL and storage options only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import deltastore as ds
from tests.storage.models import assert_model, model_at, write_base


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_publish_then_pull_through_object_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(f"{backend}_server")
    url: str = request.getfixturevalue(f"{backend}_url")
    options: dict[str, Any] = server.storage_options
    base = write_base(tmp_path / "base")

    publisher = ds.DeltaPublisher(ds.VersionStore(url, options), base)
    publisher.seed()
    kinds = {1: "delta", 2: "full", 3: "delta", 4: "delta"}
    for step, kind in kinds.items():
        result = publisher.publish(model_at(step).items(), full=kind == "full")
        assert (result.version, result.kind) == (step, kind)

    reader = ds.VersionStore(url, options)
    assert reader.versions() == [1, 2, 3, 4]
    assert reader.index(3).base_version == 2

    host_a, host_b = tmp_path / "host_a", tmp_path / "host_b"
    first = ds.pull_weights(host_a, url, 1, base, storage_options=options)
    assert first.version == 1
    assert_model(host_a, 1)
    # v1 is not on v4's chain (v2 is full): host A reseeds from v2, then applies v3 and v4.
    later = ds.pull_weights(host_a, url, 4, base, storage_options=options)
    assert later.version == 4 and later.bytes_read > 0
    assert_model(host_a, 4)
    # A late host goes straight to the target, reading only the chain from the full version.
    fresh = ds.pull_weights(host_b, ds.VersionStore(url, options), 4, base)
    assert fresh.version == 4
    assert_model(host_b, 4)
    assert ds.verify_local(host_b, url, base_dir=base, storage_options=options) == 4
