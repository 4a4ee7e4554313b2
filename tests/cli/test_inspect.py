"""``deltastore inspect``: a density for every delta encoding; plots with whole-version ticks
that say where they were written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltastore.cli import main
from deltastore.cli.store import describe
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


def test_the_history_plot_ticks_whole_versions_and_says_where_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from deltastore.cli.store import history_figure

    rows = [
        {"version": v, "kind": "delta", "wire_bytes": 1000 * v, "density": 0.001 * v}
        for v in (1, 2, 3)
    ]
    ticks = history_figure(rows, title="t").axes[0].get_xticks()
    assert len(ticks) and all(float(t).is_integer() for t in ticks)
    base = {"w": torch.zeros(8, 8, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][0, 0] = 1.0
    base_dir = make_checkpoint(tmp_path / "base", base)
    publish_run(tmp_path / "store", base_dir, [new], encoding="xor")
    png = tmp_path / "h.png"
    assert (
        main(["inspect", str(tmp_path / "store"), "--history", "--plot", str(png), "--json"]) == 0
    )
    out, err = capsys.readouterr()
    assert png.stat().st_size > 0 and f"wrote {png}" in err and str(png) not in out
