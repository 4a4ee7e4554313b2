"""A full version's shard is flushed to disk while it downloads, not only after."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import deltastore.pull.full as full


def test_a_file_being_written_is_flushed_while_the_block_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed: list[int] = []
    real = full._datasync

    def record(fd: int) -> None:
        flushed.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(full, "_datasync", record)
    path = tmp_path / "shard.safetensors"
    with full.flushed_behind(str(path), every_s=0.02):
        time.sleep(0.06)  # the file does not exist yet: nothing to flush, no error
        with open(path, "wb") as out:
            for _ in range(10):
                out.write(b"x" * 4096)
                out.flush()
                time.sleep(0.03)
        written_while_open = list(flushed)
    # Some flush landed mid-write (with 10 writes 30 ms apart and a flush every 20 ms, many do).
    assert any(0 < size < 10 * 4096 for size in written_while_open), written_while_open


def test_a_reseed_through_the_store_flushes_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = full.flushed_behind

    def spy(path: str, every_s: float = full.FLUSH_BEHIND_S):  # type: ignore[no-untyped-def]
        calls.append(os.path.basename(path))
        return real(path, every_s)

    monkeypatch.setattr(full, "flushed_behind", spy)
    import torch

    import deltastore as ds
    from tests.conftest import make_checkpoint

    model = {"w": torch.arange(4096, dtype=torch.float32)}
    base = tmp_path / "base"
    make_checkpoint(base, model)
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base)
    publisher.seed()
    publisher.publish({"w": model["w"] + 1}, full=True)
    ds.pull_weights(tmp_path / "host", tmp_path / "store", 1, base_dir=base)
    assert calls and all(name.endswith(".safetensors") for name in calls)
