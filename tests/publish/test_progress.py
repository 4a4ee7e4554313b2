"""Byte progress of ``seed`` and ``publish``: phases, totals, and a callback that raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltastore as ds
from tests.conftest import make_checkpoint, perturb, small_tensors
from tests.progress_check import Recorder, report_every_step

Model = dict[str, torch.Tensor]


def _model() -> Model:
    """A few tensors large enough that each is its own step of the count."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(6)}
    return {**tensors, **small_tensors()}


def _model_bytes(model: Model) -> int:
    return sum(t.numel() * t.element_size() for t in model.values())


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ds.VersionStore, Path, Model]:
    report_every_step(monkeypatch)
    model = _model()
    base = make_checkpoint(tmp_path / "base", model, shards=2)
    return ds.VersionStore(tmp_path / "store"), base, model


def test_seed_reports_the_snapshot_bytes_loaded(setup) -> None:
    store, base, model = setup
    progress = Recorder()
    ds.DeltaPublisher(store, base).seed(progress=progress)
    assert progress.check() == {"seed": _model_bytes(model)}
    assert len(progress.of("seed")) > 3  # tensor by tensor, not one jump


@pytest.mark.parametrize("full", [False, True])
def test_publish_reports_diff_then_write(setup, full: bool) -> None:
    store, base, model = setup
    publisher = ds.DeltaPublisher(store, base, workers=2)
    publisher.seed()
    progress = Recorder()
    step = perturb(model, 1)
    result = publisher.publish(step.items(), full=full, progress=progress)
    totals = progress.check()
    assert progress.phases() == ["diff", "write"]
    assert totals["diff"] == _model_bytes(model)
    assert len(progress.of("diff")) > 3
    write = totals["write"]
    assert write is not None and 0 < write < result.wire_bytes  # shard headers not counted
    if full:
        assert write == _model_bytes(model)


def test_publish_of_some_tensors_still_ends_at_the_model_size(setup) -> None:
    store, base, model = setup
    publisher = ds.DeltaPublisher(store, base)
    publisher.seed()
    progress = Recorder()
    changed = perturb(model, 2)
    some = [(n, t) for n, t in changed.items() if not torch.equal(t, model[n])]
    assert 0 < len(some) < len(model)
    publisher.publish(some, progress=progress)
    assert progress.check()["diff"] == _model_bytes(model)


@pytest.mark.parametrize("phase", ["diff", "write"])
def test_a_raising_callback_commits_nothing(setup, phase: str) -> None:
    store, base, model = setup
    publisher = ds.DeltaPublisher(store, base)
    publisher.seed()
    publisher.publish(perturb(model, 1).items())
    progress = Recorder(fail_when=lambda call: call[0] == phase and call[1] > 0)
    with pytest.raises(ds.PublishError, match="progress callback gave up") as raised:
        publisher.publish(perturb(model, 2).items(), progress=progress)
    assert isinstance(raised.value.__cause__, RuntimeError)
    store.refresh()
    assert store.versions() == [1]
    # The snapshot did not move: the same step publishes as version 2, and pulls right.
    result = publisher.publish(perturb(model, 2).items())
    assert result.version == 2
    host = base.parent / "host"
    ds.pull_weights(host, store, 2, base_dir=base)
    assert ds.verify_local(host, store, base_dir=base) == 2


def test_a_raising_seed_callback_is_a_publish_error(setup) -> None:
    store, base, _ = setup
    progress = Recorder(fail_when=lambda call: call[1] > 0)
    with pytest.raises(ds.PublishError, match="progress callback gave up"):
        ds.DeltaPublisher(store, base).seed(progress=progress)
