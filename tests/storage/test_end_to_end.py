"""publish → pull through each object store: DeltaPublisher on one client, pull_weights on
fresh hosts that reach the bucket by URL and storage options only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import deltastore as ds


def model_at(step: int) -> dict[str, torch.Tensor]:
    """A tiny model; each step changes a few elements of two tensors."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(32, 16, generator=g),
        "layers.0.norm.weight": torch.ones(16, dtype=torch.float16),
        "lm_head.bias": torch.zeros(8, dtype=torch.int8),
    }
    for s in range(1, step + 1):
        tensors["layers.0.mlp.weight"][s % 32, : s + 1] += 0.5
        tensors["embed.weight"][(7 * s) % 64, 3] = float(s)
    return tensors


def write_base(directory: Path) -> Path:
    directory.mkdir(parents=True)
    save_file(model_at(0), str(directory / "model.safetensors"))
    return directory


def local_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def assert_model(directory: Path, step: int) -> None:
    got = local_tensors(directory)
    want = model_at(step)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


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
