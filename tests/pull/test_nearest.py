"""Reading each version from the nearest store that has it (``source_dir=[near, far]``).

``far`` is the trainer's store; ``near`` a copy of it (its version dirs copied as they are,
which is what ``deltastore replicate`` leaves) that lacks the newest version, is missing, is
unreachable, or disagrees with ``far``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltastore as ds
from deltastore.errors import FormatError
from deltastore.format.state import PendingTransition
from deltastore.pull import LocalCheckpoint
from deltastore.testing.servers import free_port
from tests.conftest import checkpoint_bytes, perturb, raw_bytes

Model = dict[str, torch.Tensor]


@pytest.fixture
def run(tmp_path: Path, base_dir: Path, small_model: Model) -> tuple[Path, Path, dict[int, dict]]:
    """``far`` with v1..v3 published; ``near`` a copy holding v1..v2 only."""
    far = tmp_path / "far"
    publisher = ds.DeltaPublisher(ds.VersionStore(far), base_dir)
    publisher.seed()
    model, states = small_model, {}
    for version in (1, 2, 3):
        model = perturb(model, version)
        publisher.publish(model.items())
        states[version] = {n: raw_bytes(t) for n, t in model.items()}
    near = tmp_path / "near"
    shutil.copytree(far, near)
    shutil.rmtree(near / "weight_v000003")
    return near, far, states


def _state(host: Path) -> dict:
    return json.loads((host / ".weight_sync" / "state.json").read_text())


def test_each_version_comes_from_the_nearest_store_that_has_it(
    tmp_path: Path, base_dir: Path, run
) -> None:
    near, far, states = run
    host = tmp_path / "host"
    result = ds.pull_weights(host, [str(near), str(far)], 2, base_dir)
    assert result.version == 2 and checkpoint_bytes(host) == states[2]
    assert _state(host)["sources"] == {"000001": str(near), "000002": str(near)}
    ds.pull_weights(host, [str(near), str(far)], "latest", base_dir)
    assert checkpoint_bytes(host) == states[3]
    state = _state(host)
    assert state["version"] == "000003" and state["source"] == str(far)
    assert state["sources"] == {"000003": str(far)}
    assert ds.verify_local(host, ds.VersionStore(far), base_dir=base_dir) == 3


def test_a_missing_near_store_falls_back_to_the_far_one(
    tmp_path: Path, base_dir: Path, run
) -> None:
    _, far, states = run
    host = tmp_path / "host"
    ds.pull_weights(host, [str(tmp_path / "no-such-store"), str(far)], 3, base_dir)
    assert checkpoint_bytes(host) == states[3]
    assert set(_state(host)["sources"].values()) == {str(far)}


def test_an_unreachable_near_store_falls_back_to_the_far_one(
    tmp_path: Path, base_dir: Path, run, s3_server
) -> None:
    _, far, states = run
    dead = dict(s3_server.storage_options)
    dead["client_kwargs"] = {"endpoint_url": f"http://127.0.0.1:{free_port()}"}
    near = ds.VersionStore("s3://nowhere/run", dead)
    host = tmp_path / "host"
    ds.pull_weights(host, [near, ds.VersionStore(far)], 3, base_dir)
    assert checkpoint_bytes(host) == states[3]
    assert _state(host)["source"] == str(far)


def test_stores_that_disagree_on_a_version_fail_naming_both(
    tmp_path: Path, base_dir: Path, run
) -> None:
    near, far, _ = run
    index = near / "weight_v000002" / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["metadata"]["stream_id"] = "another-run"
    index.write_text(json.dumps(body))
    with pytest.raises(FormatError, match="not copies of one run") as caught:
        ds.pull_weights(tmp_path / "host", [str(near), str(far)], 3, base_dir)
    assert str(near) in str(caught.value) and str(far) in str(caught.value)


def test_cli_pull_with_two_stores(tmp_path: Path, base_dir: Path, run) -> None:
    near, far, states = run
    host = tmp_path / "host"
    args = ["pull", "--store", str(near), "--store", str(far), "--local", str(host)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltastore.cli",
            *args,
            "--base",
            str(base_dir),
            "--version",
            "latest",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == 3
    assert checkpoint_bytes(host) == states[3]
    assert _state(host)["sources"]["000003"] == str(far)


# ------------------------------------------------------------------------------------------
# Replicas made by `deltastore replicate`: each copy of a version is committed by that
# replica's own writer, so the indexes of one version differ byte for byte (commit token).


def _replica(kind: str, tmp_path: Path, name: str, request: pytest.FixtureRequest) -> str:
    if kind == "local":
        return str(tmp_path / name)
    request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_url") + f"-{name}"


def _options(kind: str, request: pytest.FixtureRequest) -> dict | None:
    return request.getfixturevalue("s3_server").storage_options if kind == "s3" else None


def _publish(publisher: ds.DeltaPublisher, model: Model, steps: range, states: dict) -> Model:
    for version in steps:
        model = perturb(model, version)
        assert publisher.publish(model.items()).version == version
        states[version] = {n: raw_bytes(t) for n, t in model.items()}
    return model


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("lag", [1, 3])
def test_replicas_where_the_near_one_lags_pull_together(
    kind: str,
    lag: int,
    tmp_path: Path,
    base_dir: Path,
    small_model: Model,
    request: pytest.FixtureRequest,
) -> None:
    src = tmp_path / "src"
    near, far = (_replica(kind, tmp_path, n, request) for n in ("near", "far"))
    options = _options(kind, request)
    publisher = ds.DeltaPublisher(ds.VersionStore(src), base_dir)
    publisher.seed()
    states: dict[int, dict] = {}
    model = _publish(publisher, small_model, range(1, 3), states)
    ds.replicate(str(src), near, dst_storage_options=options)
    _publish(publisher, model, range(3, 3 + lag), states)
    ds.replicate(str(src), far, dst_storage_options=options)
    latest = 2 + lag
    near_store, far_store = ds.VersionStore(near, options), ds.VersionStore(far, options)
    assert near_store.versions() == [1, 2] and far_store.versions() == list(range(1, latest + 1))
    assert near_store.index_bytes(2) != far_store.index_bytes(2)  # each replica's own token

    host = tmp_path / "host"
    result = ds.pull_weights(host, [near_store, far_store], latest, base_dir)
    assert result.version == latest and checkpoint_bytes(host) == states[latest]
    sources = _state(host)["sources"]
    assert sources["000002"] == near and sources[f"{latest:06d}"] == far
    # A host already at the near replica's newest version catches up from the far one.
    other = tmp_path / "other"
    ds.pull_weights(other, near_store, 2, base_dir)
    ds.pull_weights(other, [near_store, far_store], "latest", base_dir)
    assert checkpoint_bytes(other) == states[latest]
    assert ds.verify_local(other, far_store, base_dir=base_dir) == latest


def test_cli_pull_from_lagging_replicas(tmp_path: Path, base_dir: Path, small_model: Model) -> None:
    src, near, far, host = (str(tmp_path / n) for n in ("src", "near", "far", "host"))
    publisher = ds.DeltaPublisher(ds.VersionStore(src), base_dir)
    publisher.seed()
    states: dict[int, dict] = {}
    model = _publish(publisher, small_model, range(1, 3), states)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deltastore.cli", *args],
            capture_output=True,
            text=True,
            timeout=180,
            env=dict(os.environ),
        )

    assert cli("replicate", src, near, "-q").returncode == 0
    _publish(publisher, model, range(3, 4), states)
    assert cli("replicate", src, far, "-q").returncode == 0
    proc = cli(
        "pull",
        "--store",
        near,
        "--store",
        far,
        "--local",
        host,
        "--base",
        str(base_dir),
        "--version",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == 3 and checkpoint_bytes(host) == states[3]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_replicas_of_different_runs_are_refused(
    kind: str,
    tmp_path: Path,
    base_dir: Path,
    small_model: Model,
    request: pytest.FixtureRequest,
) -> None:
    """Two runs seeded from the same base, publishing the same steps: replicas of one cannot
    stand in for the other's, even where their tensors happen to agree."""
    options = _options(kind, request)
    near, far = (_replica(kind, tmp_path, n, request) for n in ("near", "far"))
    for name, dst, steps in (("run-a", near, range(1, 3)), ("run-b", far, range(1, 4))):
        publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / name), base_dir)
        publisher.seed()
        _publish(publisher, small_model, steps, {})
        ds.replicate(str(tmp_path / name), dst, dst_storage_options=options)
    host = tmp_path / "host"
    stores = [ds.VersionStore(near, options), ds.VersionStore(far, options)]
    with pytest.raises(FormatError, match="not copies of one run") as caught:
        ds.pull_weights(host, stores, 3, base_dir)
    assert near in str(caught.value) and far in str(caught.value)
    assert "weight_v000002" in str(caught.value)


def test_a_repaired_transition_records_the_store_it_read(
    tmp_path: Path, base_dir: Path, run
) -> None:
    near, far, states = run
    host, stores = tmp_path / "host", [str(near), str(far)]
    ds.pull_weights(host, stores, 2, base_dir)
    stream = ds.VersionStore(far).index(3).stream_id
    LocalCheckpoint(host).begin(PendingTransition(2, 3, stream, stream, [3]))  # a crash
    assert ds.pull_weights(host, stores, 3, base_dir).action == "repaired"
    assert checkpoint_bytes(host) == states[3]
    state = _state(host)
    assert state["source"] == str(far) and state["sources"] == {"000003": str(far)}
