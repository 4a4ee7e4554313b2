"""Byte progress of prune: the listed bytes of every file removed, ending at the total."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import deltastore as ds
from deltastore.storage import store_objects
from tests.conftest import make_checkpoint, perturb, small_tensors
from tests.progress_check import Recorder, report_every_step


def _store_with_versions(tmp_path: Path, plan: str) -> ds.VersionStore:
    model = small_tensors()
    base = make_checkpoint(tmp_path / "base", model)
    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base)
    publisher.seed()
    for step, kind in enumerate(plan, start=1):
        model = perturb(model, step)
        publisher.publish(model.items(), full=kind == "f")
    return store


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_prune_reports_the_bytes_it_removes(tmp_path: Path, monkeypatch) -> None:
    report_every_step(monkeypatch)
    store = _store_with_versions(tmp_path, "ddfd")
    before = _tree_bytes(store.root)
    progress = Recorder()
    report = store.prune(keep=1, grace_s=0, progress=progress)
    assert report.delete == (1, 2)
    totals = progress.check()
    assert progress.phases() == ["prune"]
    # Tombstones are written, versions 1 and 2 (files and claims) removed.
    removed = before - _tree_bytes(store.root)
    tombstones = sum(os.path.getsize(store_objects(store).abort_path(v)) for v in report.delete)
    assert totals["prune"] == removed + tombstones > 0
    assert len(progress.of("prune")) >= 3  # version by version


def test_a_dry_run_reports_nothing(tmp_path: Path) -> None:
    store = _store_with_versions(tmp_path, "ddfd")
    progress = Recorder()
    assert store.prune(keep=1, dry_run=True, progress=progress).unpublish == (1, 2)
    assert progress.calls == []


def test_a_raising_callback_stops_prune_and_the_next_run_finishes(
    tmp_path: Path, monkeypatch
) -> None:
    report_every_step(monkeypatch)
    store = _store_with_versions(tmp_path, "ddfd")
    failing = Recorder(fail_when=lambda call: call[1] > 0)
    with pytest.raises(RuntimeError, match="progress callback gave up"):
        store.prune(keep=1, grace_s=0, progress=failing)
    store.refresh()
    assert store.versions() == [2, 3, 4]  # v1 unpublished, the rest left as they were
    report = store.prune(keep=1, grace_s=0)
    assert set(report.delete) == {1, 2}
    store.refresh()
    assert store.versions() == [3, 4]
