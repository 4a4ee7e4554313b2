"""A commit is all or nothing: rollback part way, and stages that no longer apply refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deltastore import DeltaPublisher, VersionStore
from deltastore.engines import LiveWeights
from deltastore.errors import DeltastoreError, OutOfOrderError, StreamError
from deltastore.pull import LocalCheckpoint
from tests.engines.helpers import TrainingRun, engine_model, live_bytes, raw
from tests.engines.test_live import assert_at, live_over
from tests.engines.writes import Writes


@pytest.mark.parametrize("error", [RuntimeError("device lost"), KeyboardInterrupt()])
@pytest.mark.parametrize("whole", [False, True])
def test_a_failure_part_way_rolls_every_tensor_back(
    tmp_path: Path, run: TrainingRun, error: BaseException, whole: bool
) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    version = run.step(full=whole)
    staged = live.stage(version)
    assert staged.whole == whole and staged.tensors > 4
    before = live_bytes(engine)
    with Writes(fail_at=staged.tensors // 2, error=error) as writes, pytest.raises(type(error)):
        live.commit(staged)
    assert writes.count > staged.tensors // 2  # it wrote, then put back
    assert live_bytes(engine) == before
    assert live.version == 1
    # The same stage still applies (nothing moved), and so does a new one.
    live.commit(live.stage(version))
    assert_at(engine, run, version)


def test_a_failed_verification_rolls_back(tmp_path: Path, run: TrainingRun) -> None:
    engine, live = live_over(run, tmp_path)
    version = run.step()
    staged = live.stage(version)
    before = live_bytes(engine)
    name = staged.patches[0].name
    staged.patches[0].new[0] ^= 1  # a staged value the version's digest does not have
    with pytest.raises(DeltastoreError, match=name):
        live.commit(staged, verify="full")
    assert live_bytes(engine) == before and live.version == 0


def _checkpoint_files(root: Path) -> dict[str, bytes]:
    local = root / "local"
    return {p.name: p.read_bytes() for p in sorted(local.glob("*.safetensors"))}


def test_corrupt_payload_is_refused_with_nothing_written(tmp_path: Path, run: TrainingRun) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    version = run.step()
    store = VersionStore(str(run.store_dir))
    shard = sorted(store.index(version).shards())[0]
    path = run.store_dir / f"weight_v{version:06d}" / shard
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # inside the last payload frame
    path.write_bytes(bytes(data))
    before, files = live_bytes(engine), _checkpoint_files(tmp_path)
    with pytest.raises(DeltastoreError):
        live.stage(version)
    assert live_bytes(engine) == before and live.version == 1
    assert _checkpoint_files(tmp_path) == files
    assert LocalCheckpoint(tmp_path / "local").read_state().version == 1  # type: ignore[union-attr]


def test_a_store_of_another_base_is_refused_with_nothing_written(
    tmp_path: Path, run: TrainingRun
) -> None:
    other = TrainingRun.start(tmp_path / "other", seed=7)  # same shapes, other bytes
    other.step()
    engine = engine_model(run.config, run.states[0])
    live = LiveWeights(engine, tmp_path / "local", str(other.store_dir), base_dir=run.base_dir)
    before = live_bytes(engine)
    with pytest.raises(DeltastoreError):
        live.stage(1)
    assert live_bytes(engine) == before and live.version == 0


def test_another_stream_is_refused_before_the_pull(tmp_path: Path, run: TrainingRun) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    restarted = DeltaPublisher(str(run.store_dir), str(run.base_dir), new_stream=True)
    restarted.seed()
    state = {n: t.clone() for n, t in run.states[1].items()}
    version = restarted.publish(state.items()).version
    before, files = live_bytes(engine), _checkpoint_files(tmp_path)
    with pytest.raises(StreamError, match="stream"):
        live.stage(version)
    assert live_bytes(engine) == before and _checkpoint_files(tmp_path) == files


def test_stale_and_out_of_order_stages_are_refused_before_any_write(
    tmp_path: Path, run: TrainingRun
) -> None:
    engine, live = live_over(run, tmp_path)
    v1 = run.step()
    first = live.stage(v1)
    live.commit(first)
    with Writes() as writes, pytest.raises(OutOfOrderError, match="stale"):
        live.commit(first)  # committed already: the live weights moved on
    assert writes.count == 0
    v2, v3 = run.step(), run.step()
    older, newer = live.stage(v2), live.stage(v3)
    with Writes() as writes, pytest.raises(OutOfOrderError, match="superseded"):
        live.commit(older)
    assert writes.count == 0 and live.version == v1
    live.commit(newer)
    assert_at(engine, run, v3)
    before, files = live_bytes(engine), _checkpoint_files(tmp_path)
    with pytest.raises(OutOfOrderError, match="older"):
        live.stage(v2)
    assert live_bytes(engine) == before and _checkpoint_files(tmp_path) == files
    _, elsewhere = live_over(run, tmp_path / "elsewhere", version=v3)
    with pytest.raises(OutOfOrderError, match="another LiveWeights"):
        live.commit(elsewhere.stage(run.step()))
    assert live_bytes(engine) == before


def test_a_stage_whose_checkpoint_moved_is_refused(tmp_path: Path, run: TrainingRun) -> None:
    # In loader mode the tensors are read from the checkpoint at commit time.
    got: list[str] = []
    live = LiveWeights(
        None,
        tmp_path / "local",
        str(run.store_dir),
        base_dir=run.base_dir,
        loader=lambda weights: got.extend(n for n, _ in weights),
    )
    staged = live.stage(run.step())
    from deltastore import pull_weights

    pull_weights(tmp_path / "local", str(run.store_dir), run.step(), base_dir=run.base_dir)
    with pytest.raises(OutOfOrderError, match="no longer holds"):
        live.commit(staged)
    assert got == [] and live.version == 0
    assert os.path.isdir(tmp_path / "local")


def test_patches_are_small(tmp_path: Path, run: TrainingRun) -> None:
    _, live = live_over(run, tmp_path)
    staged = live.stage(run.step())
    total = sum(t.numel() for t in run.states[1].values())
    assert 0 < staged.elements < total
    # positions (8 bytes) + new and old bf16 words (2 + 2) per changed element
    assert staged.bytes == 12 * staged.elements
    assert all(p.new.dtype == torch.int16 for p in staged.patches)
    assert raw(run.states[1]["model.norm.weight"])


@pytest.mark.parametrize("error", [None, RuntimeError("device lost"), KeyboardInterrupt()])
def test_a_commit_spread_over_threads_is_exact_and_rolls_back(
    tmp_path: Path, run: TrainingRun, error: BaseException | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltastore.engines import commit

    monkeypatch.setattr(commit, "SPREAD_ELEMENTS", 1)  # spread even a tiny model's commit
    monkeypatch.setattr(commit, "CPU_CHUNK", 64)  # and cut its patches into pieces
    engine, live = live_over(run, tmp_path, workers=3)
    live.commit(live.stage(run.step()))
    version = run.step()
    staged = live.stage(version)
    assert max(p.elements for p in staged.patches) > 4 * 64
    before = live_bytes(engine)
    if error is None:
        live.commit(staged)
        assert_at(engine, run, version)
        return
    with Writes(fail_at=5, error=error), pytest.raises(type(error)):
        live.commit(staged)
    assert live_bytes(engine) == before and live.version == 1
    live.commit(staged)
    assert_at(engine, run, version)
