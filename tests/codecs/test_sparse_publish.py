"""sparse-v2 and auto through the real publisher and puller; reference readers refuse them.

The publisher names the encoding in the index; deltastore's pull applies it byte-exactly
(also catching up over several versions); the reference reader (written from the reference
format alone) refuses such a version as an unknown delta encoding and leaves the host as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import deltastore as ds
from tests.conftest import checkpoint_bytes, perturb, raw_bytes
from tests.format import reference_reader


@pytest.mark.parametrize("encoding", ["sparse-v2", "auto"])
def test_publish_pull_and_reference_refusal(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor], encoding: str
):
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding=encoding)
    publisher.seed()
    model, states = small_model, {}
    for version in (1, 2, 3):
        model = perturb(model, version)
        assert publisher.publish(model.items()).version == version
        states[version] = {name: raw_bytes(t) for name, t in model.items()}
    index = json.loads((tmp_path / "store" / "weight_v000001" / reference_reader.INDEX).read_text())
    assert index["metadata"]["delta_encoding"] == encoding

    stepwise, catch_up = tmp_path / "stepwise", tmp_path / "catch-up"
    for version in (0, 1, 2, 3):
        ds.pull_weights(str(stepwise), str(store.root), version, base_dir=str(base_dir))
        if version:
            assert checkpoint_bytes(stepwise) == states[version]
    ds.pull_weights(str(catch_up), str(store.root), 3, base_dir=str(base_dir))
    assert checkpoint_bytes(catch_up) == states[3]

    host = tmp_path / "reference-host"
    reference_reader.pull(str(host), str(store.root), 0, str(base_dir))
    before = checkpoint_bytes(host)
    # A reader that checks the encoding first names it; one that walks the shard first meets
    # the packed entry, which the index does not map: either way it refuses before writing.
    with pytest.raises(
        reference_reader.ReferenceReaderError,
        match=f"unknown delta_encoding '{encoding}'|holds deltastore.payloads, not mapped",
    ):
        reference_reader.pull(str(host), str(store.root), 1, str(base_dir))
    assert checkpoint_bytes(host) == before
    assert reference_reader.read_state(str(host)) == 0


def test_a_version_naming_the_removed_sparse_v1_is_refused_and_the_host_kept(
    tmp_path: Path, base_dir: Path, small_model: dict[str, torch.Tensor]
):
    """A version whose index names sparse-v1 (removed) is refused before a byte is written,
    naming the version and saying what to do."""
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding="auto")
    publisher.seed()
    publisher.publish(perturb(small_model, 1).items())
    host = tmp_path / "host"
    ds.pull_weights(str(host), str(store.root), 0, base_dir=str(base_dir))
    before = checkpoint_bytes(host)
    path = tmp_path / "store" / "weight_v000001" / reference_reader.INDEX
    path.chmod(0o644)
    index = json.loads(path.read_text())
    index["metadata"]["delta_encoding"] = "sparse-v1"
    path.write_text(json.dumps(index, indent=2))
    with pytest.raises(ds.DeltastoreError, match=r"000001.*sparse-v1 was removed.*full version"):
        ds.pull_weights(str(host), str(store.root), 1, base_dir=str(base_dir))
    assert checkpoint_bytes(host) == before
