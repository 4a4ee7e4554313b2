"""What is specific to the object-store backends: configuration errors that fail at once,
the create-only probe, listing caches, the standard environment, exhausted retries."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
import warnings
from typing import Any

import pytest

from deltastore.errors import ConfigError, StoreError, TransientStoreError
from deltastore.format.names import INDEX_NAME
from deltastore.storage import RetryPolicy, VersionStore, VersionWriter, new_token, store_objects
from deltastore.testing.faults import Fault, FaultProxy, s3_error
from deltastore.testing.servers import free_port, gcs_env, s3_env
from deltastore.testing.store_tests import write_version

BACKENDS = ["s3", "gcs"]


def backend(request: pytest.FixtureRequest, name: str) -> tuple[Any, str]:
    return request.getfixturevalue(f"{name}_server"), request.getfixturevalue(f"{name}_url")


@pytest.mark.parametrize("name", BACKENDS)
def test_missing_bucket_is_a_configuration_error(name: str, request: pytest.FixtureRequest) -> None:
    server, _ = backend(request, name)
    scheme = "s3" if name == "s3" else "gs"
    store = VersionStore(
        f"{scheme}://no-such-bucket-{uuid.uuid4().hex[:8]}/run", server.storage_options
    )
    with pytest.raises(ConfigError, match=r"bucket 'no-such-bucket-.*' .* does not exist"):
        store.versions()
    with pytest.raises(ConfigError, match="create it, or check the URL"):
        store.begin(1, token=new_token())


def test_probe_detects_a_backend_without_exclusive_create(s3_server: Any, s3_url: str) -> None:
    with FaultProxy(s3_server.endpoint_url) as proxy:
        # A gateway that drops If-None-Match: create-only writes silently overwrite.
        proxy.add(Fault("forward", method="PUT", drop_headers=("If-None-Match",), times=100))
        store = VersionStore(s3_url, proxy.storage_options(s3_server.storage_options))
        with pytest.warns(RuntimeWarning, match="NOT exclusive"):
            assert store_objects(store).check_exclusive_create() is False
        assert store.supports_exclusive_create is False
    honest = VersionStore(s3_url, s3_server.storage_options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store_objects(honest).check_exclusive_create() is True
    assert honest.listing().other == {}  # the probe object is removed


@pytest.mark.parametrize("name", BACKENDS)
def test_refresh_with_listing_cache_turned_on(name: str, request: pytest.FixtureRequest) -> None:
    server, url = backend(request, name)
    reader = VersionStore(url, {**server.storage_options, "use_listings_cache": True})
    writer = VersionStore(url, server.storage_options)
    write_version(writer, 1)
    assert reader.versions() == [1]
    assert reader.list_files(1)
    write_version(writer, 2, base=1)
    reader.refresh()
    assert reader.versions() == [1, 2]
    assert reader.index(2).base_version == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_store_reached_through_the_standard_environment(
    name: str, request: pytest.FixtureRequest
) -> None:
    server, url = backend(request, name)
    write_version(VersionStore(url, server.storage_options), 1)
    env = {**os.environ, **(s3_env(server) if name == "s3" else gcs_env(server))}
    code = (
        "import sys; from deltastore.storage import VersionStore; "
        f"sys.stdout.write(repr(VersionStore({url!r}).versions()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout == "[1]"


def test_exhausted_retries_name_the_url(s3_server: Any, s3_url: str) -> None:
    waits: list[float] = []
    with FaultProxy(s3_server.endpoint_url) as proxy:
        store = VersionStore(
            s3_url,
            proxy.storage_options(s3_server.storage_options),
            retry=RetryPolicy(attempts=3, sleep=waits.append),
        )
        proxy.add(
            Fault(
                "status",
                method="PUT",
                path_contains="_claims/weight_v",
                status=409,
                body=s3_error("ConditionalRequestConflict"),
                times=100,
            )
        )
        with pytest.raises(TransientStoreError, match="3 attempts") as info:
            store.begin(1, token=new_token())
    assert store.url in str(info.value)
    assert len(waits) == 2


def test_abort_never_deletes_a_version_it_cannot_prove_uncommitted(
    s3_server: Any, s3_url: str
) -> None:
    """``abort`` runs after a failed publish, when the commit's outcome may be unknown (a lost
    acknowledgement, then errors): if it cannot check the index, it must leave the version
    alone, for a committed version may already be in engines' hands."""
    honest = VersionStore(s3_url, s3_server.storage_options)
    index = write_version(honest, 1)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        store = VersionStore(
            s3_url, proxy.storage_options(s3_server.storage_options), retry=RetryPolicy(1)
        )
        proxy.add(Fault("status", method="HEAD", path_contains=INDEX_NAME, status=403, times=9))
        VersionWriter(store_objects(store), 1, "").abort()
        assert proxy.injected, "the fault proxy saw no existence check"
    assert honest.versions() == [1]
    assert honest.index(1) == index
    assert set(index.shards()) <= set(honest.list_files(1))


def test_a_commit_whose_last_check_fails_after_the_index_landed_stands(
    s3_server: Any, s3_url: str, tmp_path: Any
) -> None:
    """The index is written, then the re-check for a tombstone fails once: readers see the
    version with the writer's token, so it is reported committed (and the snapshot advances)
    rather than "nothing was committed"."""
    import torch
    from safetensors.torch import save_file

    import deltastore as ds

    base = tmp_path / "base"
    base.mkdir()
    weights = {"w": torch.zeros(256, dtype=torch.bfloat16)}
    save_file(weights, str(base / "model.safetensors"))
    with FaultProxy(s3_server.endpoint_url) as proxy:
        store = VersionStore(
            s3_url, proxy.storage_options(s3_server.storage_options), retry=RetryPolicy(1)
        )
        publisher = ds.DeltaPublisher(store, str(base))
        publisher.seed()
        claim_denied = Fault("status", path_contains="weight_v000001.abort", status=403, times=1)
        proxy.add(
            Fault(
                "forward",
                method="PUT",
                path_contains=f"weight_v000001/{INDEX_NAME}",
                before=lambda: proxy.add(claim_denied),
            )
        )
        weights["w"][:8] = 1.0
        result = publisher.publish(weights.items())
        assert proxy.injected, "the claim read after the index was never denied"
        assert result.version == 1
        weights["w"][8:16] = 2.0
        assert publisher.publish(weights.items()).version == 2
    honest = VersionStore(s3_url, s3_server.storage_options)
    assert honest.versions() == [1, 2]
    host = tmp_path / "host"
    ds.pull_weights(host, honest, 2, base_dir=base)
    assert ds.verify_local(host, honest, 2, base_dir=base) == 2


def test_a_refused_endpoint_fails_fast_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that never answered and refuses connections is misconfigured, not flaky."""
    port = free_port()  # bound then released: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    store = VersionStore("s3://bucket/run1")
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port} refused the connection"):
        store.versions()
    assert time.monotonic() - started < 10  # retrying it took ~40 s


def test_creating_a_store_sends_nothing_and_bad_credentials_fail_at_first_use(
    tmp_path: Any,
) -> None:
    missing = str(tmp_path / "no-such-key.json")
    store = VersionStore("gs://bucket/run1", {"token": missing})  # no request, no traceback
    assert store.url == "gs://bucket/run1"
    with pytest.raises(ConfigError, match="gs://bucket/run1"):
        store.versions()


def test_gcs_emulator_prints_no_bucket_type_warning(gcs_server: Any, gcs_url: str) -> None:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING);"
        "from deltastore.storage import VersionStore;"
        f"print(VersionStore({gcs_url!r}).versions())"
    )
    env = {**os.environ, **gcs_env(gcs_server), "PYTHONPATH": os.getcwd()}
    env.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Could not determine bucket type" not in done.stderr
