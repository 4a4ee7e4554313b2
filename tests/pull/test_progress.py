"""Byte progress of ``pull_weights`` and ``verify_local``: every kind of pull reports phases
that start at 0, never go back and end at their totals; a callback that raises leaves the host
verifiably at the version it held."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import deltastore as ds
import deltastore.pull.apply as apply_module
from deltastore.storage import store_objects
from tests.conftest import checkpoint_bytes, make_checkpoint, perturb, raw_bytes, small_tensors
from tests.progress_check import Recorder, report_every_step

Model = dict[str, torch.Tensor]


def _model() -> Model:
    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(6)}
    return {**tensors, **small_tensors()}


def _publish(store: ds.VersionStore, base: Path, model: Model, plan: str) -> dict[int, Model]:
    """One version per letter (d: delta touching every big tensor, f: full); states by version."""
    publisher = ds.DeltaPublisher(store, base)
    publisher.seed()
    states = {0: model}
    for version, kind in enumerate(plan, start=1):
        model = {n: t.clone() for n, t in perturb(model, version).items()}
        for name in sorted(model)[:6]:
            model[name].view(-1)[version] += 1.0  # every big tensor changes: several payloads
        publisher.publish(model.items(), full=kind == "f")
        states[version] = model
    return states


def _at(host: Path, store: ds.VersionStore, base: Path, state: Model, version: int) -> None:
    assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in state.items()}
    assert ds.verify_local(host, store, base_dir=base) == version


@pytest.fixture
def chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    report_every_step(monkeypatch)
    model = _model()
    base = make_checkpoint(tmp_path / "base", model, shards=2)
    store = ds.VersionStore(tmp_path / "store")
    return store, base, _publish(store, base, model, "ddfdd")


def _file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def test_first_pull_reports_the_base_copy_then_the_deltas(chain, tmp_path: Path) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    progress = Recorder()
    result = ds.pull_weights(host, store, 2, base_dir=base, progress=progress)
    totals = progress.check()
    assert progress.phases() == ["seed", "apply"]
    assert totals["seed"] == _file_bytes(base)
    assert totals["apply"] == result.bytes_read > 0
    # Payloads are read in windows of up to ~32 MB (one here): a start at 0, then a report
    # per window read, then the end.
    assert len(progress.of("apply")) >= 3
    _at(host, store, base, states[2], 2)


def test_catch_up_reports_the_payload_bytes(chain, tmp_path: Path) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    ds.pull_weights(host, store, 3, base_dir=base)
    progress = Recorder()
    result = ds.pull_weights(host, store, 5, base_dir=base, progress=progress)
    assert progress.phases() == ["apply"]
    assert progress.check()["apply"] == result.bytes_read > 0
    _at(host, store, base, states[5], 5)


def test_a_reseed_from_a_full_version_reports_the_download(chain, tmp_path: Path) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base)
    progress = Recorder()
    ds.pull_weights(host, store, 4, base_dir=base, progress=progress)
    totals = progress.check()
    assert progress.phases() == ["download", "apply"]
    objects = store_objects(store)
    index_size = os.path.getsize(objects.file_path(3, "model.safetensors.index.json"))
    assert totals["download"] == _file_bytes(Path(objects.version_path(3))) - index_size
    _at(host, store, base, states[4], 4)


def test_verify_reports_the_bytes_hashed(chain, tmp_path: Path) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base)
    progress = Recorder()
    assert ds.verify_local(host, store, base_dir=base, progress=progress) == 2
    totals = progress.check()
    assert progress.phases() == ["base", "verify"]
    model_bytes = sum(t.numel() * t.element_size() for t in states[2].values())
    assert totals["verify"] == model_bytes
    assert 0 < (totals["base"] or 0) < model_bytes  # only what no delta changed
    # From a full version, nothing is hashed from the base.
    progress = Recorder()
    ds.pull_weights(host, store, 3, base_dir=base)
    ds.verify_local(host, store, base_dir=base, progress=progress)
    assert progress.phases() == ["verify"]


def test_a_callback_raising_mid_apply_leaves_the_host_at_its_version(
    chain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base)
    # One payload per read window, so the apply reports after each tensor's read and the raise
    # lands while earlier windows are applied.
    one_each = functools.partial(apply_module.plan_windows, window_bytes=1, max_gap=0)
    monkeypatch.setattr(apply_module, "plan_windows", one_each)
    seen = []

    def second_tensor(call) -> bool:
        seen.append(call)
        return call[0] == "apply" and len(seen) >= 3  # after the first window was read

    with pytest.raises(RuntimeError, match="progress callback gave up"):
        ds.pull_weights(host, store, 2, base_dir=base, workers=1, progress=Recorder(second_tensor))
    _at(host, store, base, states[1], 1)
    ds.pull_weights(host, store, 2, base_dir=base)
    _at(host, store, base, states[2], 2)


def test_a_callback_raising_mid_download_leaves_the_host_at_its_version(
    chain, tmp_path: Path
) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    ds.pull_weights(host, store, 2, base_dir=base)
    failing = Recorder(fail_when=lambda call: call[0] == "download" and call[1] > 0)
    with pytest.raises(RuntimeError, match="progress callback gave up"):
        ds.pull_weights(host, store, 3, base_dir=base, progress=failing)
    _at(host, store, base, states[2], 2)


def test_pull_over_s3_reports_progress(s3_server, s3_url: str, tmp_path: Path) -> None:
    model = _model()
    base = make_checkpoint(tmp_path / "base", model, shards=2)
    store = ds.VersionStore(s3_url, s3_server.storage_options)
    states = _publish(store, base, model, "dfd")
    host = tmp_path / "host"
    progress = Recorder()
    result = ds.pull_weights(host, store, 3, base_dir=base, progress=progress)
    totals = progress.check()
    assert progress.phases() == ["download", "apply"]
    assert totals["download"] == store.index(2).totals["wire_bytes"]
    assert totals["apply"] == result.bytes_read - (totals["download"] or 0)
    _at(host, store, base, states[3], 3)


def test_a_callback_raising_mid_seed_leaves_no_partial_copy(chain, tmp_path: Path) -> None:
    store, base, states = chain
    host = tmp_path / "host"
    failing = Recorder(fail_when=lambda call: call[0] == "seed" and call[1] > 0)
    with pytest.raises(RuntimeError, match="progress callback gave up"):
        ds.pull_weights(host, store, 1, base_dir=base, progress=failing)
    assert not [p.name for p in host.iterdir() if p.name.endswith(".tmp")]
    ds.pull_weights(host, store, 1, base_dir=base)
    _at(host, store, base, states[1], 1)
