"""The pull's figures on ``StagedUpdate`` (under ``PullResult``'s names) and the bytes a
``CommitResult`` wrote, for a real training run's versions."""

from __future__ import annotations

from pathlib import Path

from deltastore.engines import LiveWeights
from tests.engines.helpers import TrainingRun, engine_model, raw


def test_stage_and_commit_report_bytes_tensors_and_phases(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    model = engine_model(run.config, run.states[0])
    live = LiveWeights(model, tmp_path / "ckpt", str(run.store_dir), run.base_dir, version=0)
    first = live.stage(run.step())
    assert first.reseeds == first.pull.reseeds == 1  # a fresh local dir is seeded from the base
    assert first.wire_bytes == first.pull.bytes_read > 0
    assert first.bytes_reconstructed == first.pull.bytes_reconstructed > 0
    assert {"prepare", "reseed", "patches"} <= set(first.phase_seconds)
    done = live.commit(first)
    assert done.bytes_written == done.elements * 2 > 0  # every tensor is bf16

    second = live.stage(run.step())
    changed = {n for n in run.states[2] if raw(run.states[2][n]) != raw(run.states[1][n])}
    assert second.reseeds == 0 and second.tensors == len(changed)
    assert second.tensors_skipped == len(run.states[2]) - len(changed)
    assert set(second.phase_seconds) == {"prepare", "apply", "patches"}
    assert sum(second.phase_seconds.values()) <= second.seconds + 1e-6
    assert live.commit(second).bytes_written == second.elements * 2

    nothing = live.stage(run.step(train=False))
    assert live.commit(nothing).bytes_written == 0 and nothing.wire_bytes == 0
