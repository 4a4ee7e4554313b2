"""posix_commit fsyncs every file and directory; posix_refresh revalidates a directory and never
looks at a version's files before its index is visible."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from deltastore.errors import HookError
from deltastore.format.names import INDEX_NAME
from deltastore.hooks import posix as posix_module
from deltastore.hooks import posix_commit, posix_refresh

SHARD = "model-00000-of-00001.safetensors"
INDEX = b'{"metadata": {"version": "000001"}, "weight_map": {"w": "' + SHARD.encode() + b'"}}'


def make_version(root: Path, version: int = 1, *, index: bool = True) -> Path:
    vdir = root / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    (vdir / SHARD).write_bytes(b"shard")
    if index:
        (vdir / INDEX_NAME).write_bytes(INDEX.replace(b"000001", f"{version:06d}".encode()))
    return vdir


def test_posix_commit_fsyncs_every_file_and_the_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vdir = make_version(tmp_path / "deltas")
    synced: list[str] = []
    real_fsync, real_open = os.fsync, os.open
    opened: dict[int, str] = {}

    def recording_open(path: str, flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        opened[fd] = os.path.abspath(path)
        return fd

    def recording_fsync(fd: int) -> None:
        synced.append(opened[fd])
        real_fsync(fd)

    monkeypatch.setattr(posix_module.os, "open", recording_open)
    monkeypatch.setattr(posix_module.os, "fsync", recording_fsync)
    posix_commit(None, str(vdir), None)
    assert sorted(synced) == sorted(
        [str(vdir / SHARD), str(vdir / INDEX_NAME), str(vdir), str(vdir.parent)]
    )


def test_posix_commit_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(HookError, match="is not a directory"):
        posix_commit(None, str(tmp_path / "weight_v000001"), None)


def test_posix_refresh_sees_a_committed_version(tmp_path: Path) -> None:
    make_version(tmp_path)
    assert posix_refresh(str(tmp_path), 1) is True
    assert posix_refresh(str(tmp_path), 2) is False
    assert posix_refresh(str(tmp_path), 0) is True


def test_posix_refresh_never_looks_up_files_before_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vdir = make_version(tmp_path, index=False)  # shards written, not yet committed
    looked_up: list[str] = []
    real_stat, real_listdir = os.stat, os.listdir

    def recording_stat(path: str, *args: object, **kwargs: object) -> os.stat_result:
        looked_up.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    def recording_listdir(path: str) -> list[str]:
        looked_up.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(posix_module.os, "stat", recording_stat)
    monkeypatch.setattr(posix_module.os, "listdir", recording_listdir)
    assert posix_refresh(str(tmp_path), 1) is False
    assert looked_up == [str(tmp_path)]  # the parent only: nothing inside the version

    (vdir / INDEX_NAME).write_bytes(INDEX)
    looked_up.clear()
    assert posix_refresh(str(tmp_path), 1) is True
    assert str(vdir / SHARD) in looked_up


def test_posix_refresh_waits_for_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASTORE_REFRESH_WAIT_S", "30")

    def publish_later() -> None:
        time.sleep(0.3)
        make_version(tmp_path)

    writer = threading.Thread(target=publish_later)
    writer.start()
    try:
        assert posix_refresh(str(tmp_path), 1) is True
    finally:
        writer.join()
    assert (tmp_path / "weight_v000001" / INDEX_NAME).exists()


def test_posix_refresh_rejects_a_bad_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASTORE_REFRESH_WAIT_S", "soon")
    with pytest.raises(HookError, match="DELTASTORE_REFRESH_WAIT_S"):
        posix_refresh(str(tmp_path), 1)
