"""``deltastore inspect`` gives every delta encoding a density, not only the reference ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltastore.cli.inspect import describe
from deltastore.storage import VersionStore
from tests.conftest import make_checkpoint, publish_run


@pytest.mark.parametrize("encoding", ["auto", "sparse-v2", "xor"])
def test_inspect_gives_each_encoding_its_changed_share(tmp_path: Path, encoding: str) -> None:
    base = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "b": torch.zeros(64)}
    new = {name: tensor.clone() for name, tensor in base.items()}
    new["w"].view(-1)[[3, 700, 4000]] = 1.0  # 3 bf16 elements: 1 or 2 bytes of each
    base_dir = make_checkpoint(tmp_path / "base", base)
    publish_run(tmp_path / "store", base_dir, [new], encoding=encoding)
    info = describe(VersionStore(str(tmp_path / "store")), 1, str(base_dir))
    (tensors,) = info["shards"].values()  # type: ignore[attr-defined]
    changed = tensors["w"]["density"]
    assert changed is not None and 3 / 8192 <= changed <= 6 / 8192
    assert tensors.get("b", {"density": 0.0})["density"] in (None, 0.0)
    assert describe(VersionStore(str(tmp_path / "store")), 1)["shards"]  # no --base: no crash
