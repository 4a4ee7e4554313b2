"""``pull_weights(..., flush_after_reply=True)``: the reply comes once every written tensor is
verified in the mapped files; the flush, then the state, follow under the host lock, and a
crash (a real ``kill -9``) or a failed flush in between is repaired by the next pull from the
pending record, which stays until the state is written."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import deltastore as ds
import deltastore.pull.local as pull_local
from deltastore.errors import PutBackError
from deltastore.format.names import LOCK_NAME
from deltastore.pull import LocalCheckpoint, wait_durable
from tests.conftest import checkpoint_bytes, perturb, raw_bytes
from tests.pull.helpers import (
    local_bytes,
    many_tensors,
    publish_versions,
    state_bytes,
    write_checkpoint,
)
from tests.pull.test_durability_order import Recorder, _file_bytes

Model = dict[str, torch.Tensor]
WORKER = Path(__file__).with_name("reply_worker.py")


def _published(store: ds.VersionStore, base_dir: Path, model: Model, count: int) -> list[Model]:
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    states = [model]
    for version in range(1, count + 1):
        states.append(perturb(states[-1], version))
        publisher.publish(states[-1].items())
    return states


def _on_disk(host: Path) -> tuple[bool, bool]:
    """(state.json exists, pending.json exists), read from the files, waiting for nothing."""
    sync = host / ".weight_sync"
    return (sync / "state.json").exists(), (sync / "pending.json").exists()


def _lock_is_held(host: Path) -> bool:
    fd = os.open(host / ".weight_sync" / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as exc:
        assert exc.errno in (errno.EAGAIN, errno.EACCES)
        return True
    finally:
        os.close(fd)


def test_the_reply_comes_verified_and_the_flush_then_the_state_follow(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    store = ds.VersionStore(tmp_path / "store")
    states = _published(store, base_dir, small_model, 3)
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    files_before = _file_bytes(host)
    recorder = Recorder(monkeypatch)
    gate = threading.Event()
    recorded_msync = pull_local.msync

    def held_msync(mm, path):  # type: ignore[no-untyped-def]
        assert gate.wait(60), "the test never let the flush run"
        recorded_msync(mm, path)

    monkeypatch.setattr(pull_local, "msync", held_msync)
    result = ds.pull_weights(host, store, 3, base_dir=base_dir, flush_after_reply=True)
    try:
        # The reply: the new bytes are in place and verified, nothing is flushed or recorded.
        assert result.version == 3 and result.action == "applied"
        assert checkpoint_bytes(host) == {n: raw_bytes(t) for n, t in states[3].items()}
        assert _on_disk(host) == (False, True)
        assert ("state", "000003") not in recorder.events
        assert _lock_is_held(host)
    finally:
        gate.set()
    wait_durable(host)
    assert _on_disk(host) == (True, False) and not _lock_is_held(host)
    changed = [p for p, data in _file_bytes(host).items() if data != files_before[p]]
    assert changed
    recorder.mapped_paths = {os.path.realpath(p) for p in changed}
    recorder.check_durable(changed, recorder.state_write(3))
    state = LocalCheckpoint(host).read_state()
    assert state is not None and state.version == 3


def test_a_flush_failing_after_the_reply_keeps_the_pending_record_for_the_next_pull(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    store = ds.VersionStore(tmp_path / "store")
    _published(store, base_dir, small_model, 3)
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)

    def failing_msync(mm, path):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(pull_local, "msync", failing_msync)
    assert ds.pull_weights(host, store, 3, base_dir=base_dir, flush_after_reply=True).version == 3
    with pytest.raises(PutBackError, match="could not be flushed"):
        wait_durable(host)
    assert _on_disk(host) == (False, True) and not _lock_is_held(host)
    monkeypatch.undo()
    again = ds.pull_weights(host, store, 3, base_dir=base_dir)
    assert again.action == "repaired" and again.repair is not None
    assert again.repair.applied == again.repair.restored == 0 and again.repair.kept > 0
    assert ds.verify_local(host, store, None, base_dir) == 3
    assert _on_disk(host) == (True, False)


def test_no_thread_left_to_flush_after_the_reply_completes_before_it(
    tmp_path: Path, base_dir: Path, small_model: Model, monkeypatch: pytest.MonkeyPatch
):
    store = ds.VersionStore(tmp_path / "store")
    _published(store, base_dir, small_model, 2)
    host = tmp_path / "host"
    ds.pull_weights(host, store, 1, base_dir=base_dir)
    closed = cf.ThreadPoolExecutor(1)
    closed.shutdown()  # as the pools are while the interpreter exits: submit refuses
    monkeypatch.setattr(pull_local, "kept_pool", lambda name, workers: closed)
    assert ds.pull_weights(host, store, 2, base_dir=base_dir, flush_after_reply=True).version == 2
    assert _on_disk(host) == (True, False) and not _lock_is_held(host)
    state = LocalCheckpoint(host).read_state()
    assert state is not None and state.version == 2


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory):
    """10 versions of a 600-tensor model in three shards, and a host template at v3."""
    root = tmp_path_factory.mktemp("reply-crash")
    base = many_tensors(600, seed=21, elements=4096)
    write_checkpoint(root / "base", base, shards=3)
    published = publish_versions(root / "store", root / "base", base, 10, seed=22, fraction=0.5)
    template = root / "template-v3"
    ds.pull_weights(template, published.store_dir, 3, published.base_dir)
    return published, template


@pytest.mark.parametrize("trial", range(3))
def test_kill_9_between_the_reply_and_durability_is_repaired_by_the_next_pull(
    chain, tmp_path: Path, trial: int
):
    published, template = chain
    local = tmp_path / f"host-{trial}"
    shutil.copytree(template, local)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "READY"
        args = {
            "local": str(local),
            "store": str(published.store_dir),
            "target": 10,
            "base": str(published.base_dir),
            "hold_s": 30.0,
        }
        proc.stdin.write(json.dumps(args) + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "GO"
        replied = proc.stdout.readline()
        assert replied.startswith("REPLIED"), replied
        assert json.loads(replied.split(" ", 1)[1]) == {"version": 10, "action": "applied"}
        os.kill(proc.pid, signal.SIGKILL)  # after the reply, while its flush is held
    finally:
        proc.kill()
        proc.wait()
    # The crash left what it promised: the verified bytes, a pending record, no state.
    assert _on_disk(local) == (False, True)
    assert local_bytes(local) == state_bytes(published.states[10])
    pending = LocalCheckpoint(local).read_pending()
    assert pending is not None and (pending.from_version, pending.to_version) == (3, 10)

    result = ds.pull_weights(local, published.store_dir, 10, published.base_dir)

    assert result.action == "repaired" and result.repair is not None
    assert result.repair.kept > 0 and result.repair.applied == result.repair.restored == 0
    assert ds.verify_local(local, published.store_dir, None, published.base_dir) == 10
    assert local_bytes(local) == state_bytes(published.states[10])
    assert _on_disk(local) == (True, False)
