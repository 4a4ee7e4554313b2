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
    body["stream_id"] = "another-run"
    index.write_text(json.dumps(body))
    with pytest.raises(FormatError, match="differs between") as caught:
        ds.pull_weights(tmp_path / "host", [str(near), str(far)], 3, base_dir)
    assert str(near) in str(caught.value) and str(far) in str(caught.value)


def test_cli_pull_with_two_stores(tmp_path: Path, base_dir: Path, run) -> None:
    near, far, states = run
    host = tmp_path / "host"
    args = ["pull", "--store", str(near), "--store", str(far), "--local", str(host)]
    proc = subprocess.run(
        [sys.executable, "-m", "deltastore.cli", *args, "--base", str(base_dir), "--version",
         "latest", "--json"],
        capture_output=True, text=True, timeout=180, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == 3
    assert checkpoint_bytes(host) == states[3]
    assert _state(host)["sources"]["000003"] == str(far)
