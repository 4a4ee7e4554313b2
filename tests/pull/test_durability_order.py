"""Data is durable before a state names it: the order of msyncs, fsyncs, renames and state
writes during a real catch-up, a reseed from a full version, a reseed from the base, and a
failure put back.

``kill -9`` keeps the page cache, so crash trials cannot see a state file that names bytes not
yet on disk (a power loss would). This test records every ``os.fsync`` (by the path of its
descriptor), every msync of a mapped weight file (:func:`deltastore.pull.local.msync`) and
every ``os.replace`` (a ``state.json`` replace is a state write), and checks, at each state
write, that each weight file the pull wrote is durable: its content flushed (msync + fsync of
the mapped file, or an fsync of the file it was renamed from) and, for a renamed file, its
directory fsynced after the rename.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import deltastore as ds
import deltastore.pull.local as pull_local
from deltastore.format.checkpoint import scan_checkpoint
from tests.conftest import perturb

Model = dict[str, torch.Tensor]
Event = tuple[str, ...]


class Recorder:
    """Records the durability-relevant calls of one pull, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[Event] = []
        self.mapped_paths: set[str] = set()
        """Files the pull wrote through a map (set by the test once it knows them)."""
        real_fsync, real_replace, real_msync = os.fsync, os.replace, pull_local.msync

        def fsync(fd: int) -> None:
            real_fsync(fd)
            self.events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))

        def replace(src: str, dst: str) -> None:
            real_replace(src, dst)
            dst_real = os.path.realpath(dst)
            self.events.append(("replace", os.path.realpath(src), dst_real))
            if dst_real.endswith(os.path.join(".weight_sync", "state.json")):
                with open(dst_real) as fh:
                    self.events.append(("state", json.load(fh)["version"]))

        def msync(mm: object, path: str) -> None:
            real_msync(mm, path)  # type: ignore[arg-type]
            self.events.append(("msync", os.path.realpath(path)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(pull_local, "msync", msync)

    def state_write(self, version: int) -> int:
        """Index of the last state write naming ``version``."""
        hits = [i for i, e in enumerate(self.events) if e == ("state", f"{version:06d}")]
        assert hits, f"no state write names v{version:06d}: {self.events}"
        return hits[-1]

    def _content_durable(self, path: str, before: int) -> bool:
        if path in self.mapped_paths:
            # Written through a map: its last msync must be followed by an fsync of the file.
            msyncs = [i for i in range(before) if self.events[i] == ("msync", path)]
            return bool(msyncs) and ("fsync", path) in self.events[msyncs[-1] : before]
        for i in range(before - 1, -1, -1):
            event = self.events[i]
            if event == ("fsync", path):
                return True
            if event[0] == "replace" and event[2] == path:
                return self._content_durable(event[1], i)
        return False

    def _name_durable(self, path: str, before: int) -> bool:
        renames = [i for i in range(before) if self.events[i][0] == "replace"]
        renames = [i for i in renames if self.events[i][2] == path]
        if not renames:
            return True  # written in place: the name was already durable
        directory = os.path.dirname(path)
        return any(e == ("fsync", directory) for e in self.events[renames[-1] : before])

    def check_durable(self, paths: list[str], before: int) -> None:
        for path in paths:
            path = os.path.realpath(path)
            assert self._content_durable(path, before), f"{path} not flushed before the state"
            assert self._name_durable(path, before), f"{path}'s rename not durable before state"


def _weight_files(host: Path) -> list[str]:
    return sorted(str(p) for p in host.iterdir() if p.suffix == ".safetensors")


def _file_bytes(host: Path) -> dict[str, bytes]:
    return {p: Path(p).read_bytes() for p in _weight_files(host)}


def _publish(store: ds.VersionStore, base_dir: Path, model: Model, plan: str) -> None:
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    for version, kind in enumerate(plan, start=1):
        model = perturb(model, version)
        publisher.publish(model.items(), full=kind == "f")


def test_catch_up_flushes_patched_files_before_the_state(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "ddd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    before = _file_bytes(host)
    recorder = Recorder(monkeypatch)
    ds.pull_weights(host, store, 3, base_dir=base_dir)
    changed = [p for p, data in _file_bytes(host).items() if data != before[p]]
    assert changed
    recorder.mapped_paths = {os.path.realpath(p) for p in changed}
    recorder.check_durable(changed, recorder.state_write(3))


@pytest.mark.parametrize("plan", ["fd", "dd"], ids=["full-version", "base"])
def test_reseed_makes_every_file_durable_before_the_state(
    tmp_path: Path,
    base_dir: Path,
    small_model: Model,
    monkeypatch: pytest.MonkeyPatch,
    plan: str,
):
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, plan)
    (base_dir / "config.json").write_text("{}")  # copied in beside the weights by a reseed
    host = tmp_path / "host"
    recorder = Recorder(monkeypatch)
    ds.pull_weights(host, store, 2, base_dir=base_dir)
    start = 1 if plan == "fd" else 0
    seeded = recorder.state_write(start)
    files = [*_weight_files(host), str(host / "model.safetensors.index.json")]
    files.append(str(host / "config.json"))
    recorder.check_durable(files, seeded)


def test_a_failure_put_back_is_flushed_before_the_state(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    store = ds.VersionStore(tmp_path / "store")
    _publish(store, base_dir, small_model, "dd")
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    # Corrupt the payload of the last tensor v2 changes: the ones before it are written first.
    index = store.index(2)
    victim = sorted(index.weight_map)[-1]
    shard = index.weight_map[victim]
    entry = store.read_shard_header(2, shard).tensors[victim]
    path = Path(store.root) / "weight_v000002" / shard
    raw = bytearray(path.read_bytes())
    raw[entry.end - 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    recorder = Recorder(monkeypatch)
    with pytest.raises(ds.DeltastoreError):
        ds.pull_weights(host, store, 2, base_dir=base_dir, workers=1)
    mapped_files = sorted({e[1] for e in recorder.events if e[0] == "msync"})
    put_back = recorder.state_write(1)
    local = scan_checkpoint(str(host))
    written = sorted({os.path.realpath(local[n].file) for n in sorted(index.weight_map)[:-1]})
    assert written
    recorder.mapped_paths = set(written)
    recorder.check_durable(written, put_back)
    assert set(written) <= set(mapped_files)
