"""A version that vanishes while a host pulls it (pruned): the pull re-resolves and says so."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

import deltastore as ds
from deltastore.storage import VersionStore
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes, small_tensors


class _PruneOnFirstRead(VersionStore):
    """A real local store that runs ``on_first_read`` just before its first payload read."""

    on_first_read = staticmethod(lambda: None)

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        hook, self.on_first_read = self.on_first_read, staticmethod(lambda: None)
        hook()
        return super().read_range(version, name, start, end)


def _publish_chain(tmp_path: Path, steps: int) -> tuple[Path, list[dict]]:
    tensors = small_tensors()
    base = make_checkpoint(tmp_path / "base", tensors)
    publisher = ds.DeltaPublisher(ds.VersionStore(str(tmp_path / "store")), str(base))
    publisher.seed()
    states = [tensors]
    for step in range(steps):
        states.append(perturb(states[-1], step))
        publisher.publish(states[-1].items())
    return base, states


def test_target_pruned_mid_pull_names_the_latest(tmp_path: Path) -> None:
    base, _ = _publish_chain(tmp_path, 3)
    store = _PruneOnFirstRead(str(tmp_path / "store"))
    store.on_first_read = staticmethod(lambda: shutil.rmtree(tmp_path / "store" / "weight_v000002"))
    host = tmp_path / "host"
    ds.pull_weights(host, str(tmp_path / "store"), 0, base_dir=base)
    with pytest.raises(
        ds.VersionNotFoundError, match=r"pruned while this pull read it.*v000003"
    ) as e:
        ds.pull_weights(host, store, 2, base_dir=base)
    assert "is not committed" not in str(e.value)  # the cause is chained, not repeated inside
    # Nothing unverified was recorded: the host still verifies at what its state names.
    assert ds.verify_local(host, str(tmp_path / "store"), base_dir=base) == 0


def test_transient_loss_is_re_resolved_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base, states = _publish_chain(tmp_path, 2)
    version_dir = tmp_path / "store" / "weight_v000002"
    hidden = tmp_path / "hidden"

    class _ComesBackOnRefresh(_PruneOnFirstRead):
        """v2 disappears at the first payload read and is back by the next refresh."""

        def refresh(self, version: int | None = None) -> None:
            if hidden.exists():
                shutil.move(hidden, version_dir)
            super().refresh(version)

    store = _ComesBackOnRefresh(str(tmp_path / "store"))
    store.on_first_read = staticmethod(lambda: shutil.move(version_dir, hidden))
    host = tmp_path / "host"
    ds.pull_weights(host, str(tmp_path / "store"), 0, base_dir=base)
    with caplog.at_level(logging.WARNING, logger="deltastore.pull"):
        result = ds.pull_weights(host, store, 2, base_dir=base)
    assert result.version == 2
    assert any("re-resolving" in r.message for r in caplog.records)
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in states[2].items()}
    assert ds.verify_local(host, str(tmp_path / "store"), base_dir=base) == 2
