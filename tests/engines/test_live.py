"""LiveWeights over a real training run: bit-exact commits, catch-up, generation, loader mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltastore.engines import LiveWeights
from deltastore.errors import ConfigError, IntegrityError
from tests.engines.helpers import (
    TrainingRun,
    engine_model,
    greedy,
    live_bytes,
    load_checkpoint_model,
    raw,
)
from tests.engines.writes import Writes


def assert_at(model: torch.nn.Module, run: TrainingRun, version: int) -> None:
    got = live_bytes(model)
    want = {n: raw(t) for n, t in run.states[version].items()}
    assert set(want) <= set(got)
    wrong = [n for n in want if got[n] != want[n]]
    assert not wrong, f"tensors differ from the trainer's v{version}: {wrong}"


def live_over(run: TrainingRun, root: Path, version: int = 0, **kw: object) -> tuple:
    engine = engine_model(run.config, run.states[version])
    live = LiveWeights(engine, root / "local", str(run.store_dir), base_dir=run.base_dir, **kw)
    return engine, live


@pytest.mark.parametrize("encoding", ["auto", "xor"])
def test_each_commit_is_bit_exact_and_generates_as_a_fresh_load(
    tmp_path: Path, encoding: str
) -> None:
    run = TrainingRun.start(tmp_path, encoding=encoding)
    engine, live = live_over(run, tmp_path)
    assert live.version == 0
    for _ in range(3):
        version = run.step()
        staged = live.stage(version)
        assert staged.version == version and staged.base_version == version - 1
        assert staged.tensors > 0 and not staged.whole
        assert_at(engine, run, version - 1)  # staging leaves the live weights untouched
        result = live.commit(staged)
        assert (result.version, result.verified) == (version, "patched")
        assert result.elements == staged.elements
        assert live.version == version
        assert_at(engine, run, version)
    fresh = load_checkpoint_model(run.config, tmp_path / "local")
    prompt = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(greedy(engine, prompt), greedy(fresh, prompt))


def test_catch_up_across_several_versions(tmp_path: Path, run: TrainingRun) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    for _ in range(3):
        run.step()
    staged = live.stage("latest")
    assert (staged.base_version, staged.version) == (1, 4)
    assert staged.pull.versions_applied == [2, 3, 4]
    live.commit(staged, verify="full")
    assert_at(engine, run, 4)


def test_catch_up_across_a_full_version_patches_whole_tensors(
    tmp_path: Path, run: TrainingRun
) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    run.step()
    run.step(full=True)
    last = run.step()
    staged = live.stage(last)
    assert staged.whole
    result = live.commit(staged, verify="full")
    assert result.verified == "full"
    assert_at(engine, run, last)
    nxt = run.step()  # and on from there, element by element again
    staged = live.stage(nxt)
    assert not staged.whole
    live.commit(staged)
    assert_at(engine, run, nxt)


def test_after_an_engine_restart(tmp_path: Path, run: TrainingRun) -> None:
    _, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    live.commit(live.stage(run.step()))
    del live
    # The restarted engine loads the local checkpoint; its version is the checkpoint's.
    engine = load_checkpoint_model(run.config, tmp_path / "local")
    live = LiveWeights(
        engine, tmp_path / "local", str(run.store_dir), base_dir=run.base_dir, check=True
    )
    assert live.version == 2
    run.step()
    last = run.step()
    live.commit(live.stage(last))
    assert_at(engine, run, last)


def test_check_finds_live_weights_that_are_not_the_version(
    tmp_path: Path, run: TrainingRun
) -> None:
    _, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    engine = engine_model(run.config, run.states[0])  # the base, not v1
    with pytest.raises(IntegrityError, match="differs from checkpoint tensor"):
        LiveWeights(engine, tmp_path / "local", str(run.store_dir), check=True)


def test_loader_mode_gets_exactly_the_changed_tensors(tmp_path: Path, run: TrainingRun) -> None:
    calls: list[dict[str, bytes]] = []

    def load_weights(weights: object) -> None:
        calls.append({name: raw(tensor) for name, tensor in weights})  # type: ignore[attr-defined]

    live = LiveWeights(
        None, tmp_path / "local", str(run.store_dir), base_dir=run.base_dir, loader=load_weights
    )
    v1 = run.step()
    result = live.commit(live.stage(v1))
    # Only some tensors change in the second step: freeze all but two.
    for name, param in run.master.named_parameters():
        param.requires_grad_(name.endswith(("layers.0.mlp.up_proj.weight", "norm.weight")))
    v2 = run.step()
    live.commit(live.stage(v2))
    assert len(calls) == 2 and result.version == v1
    for version, got in zip((v1, v2), calls, strict=True):
        before, after = run.states[version - 1], run.states[version]
        changed = {n for n in after if raw(after[n]) != raw(before[n])}
        assert set(got) == changed
        assert all(got[n] == raw(after[n]) for n in changed)
    assert len(calls[1]) < len(calls[0])
    assert live.version == v2


def test_loader_tensors_have_the_checkpoint_dtype_and_shape(
    tmp_path: Path, run: TrainingRun
) -> None:
    seen: dict[str, torch.Tensor] = {}
    live = LiveWeights(
        None,
        tmp_path / "local",
        str(run.store_dir),
        base_dir=run.base_dir,
        loader=lambda weights: seen.update({n: t.clone() for n, t in weights}),
    )
    version = run.step()
    live.commit(live.stage(version))
    for name, tensor in seen.items():
        want = run.states[version][name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape
        assert torch.equal(tensor, want)


def test_a_version_that_changes_nothing_writes_nothing(tmp_path: Path, run: TrainingRun) -> None:
    engine, live = live_over(run, tmp_path)
    live.commit(live.stage(run.step()))
    same = run.step(train=False)
    staged = live.stage(same)
    assert (staged.tensors, staged.elements, staged.bytes) == (0, 0, 0)
    before = live_bytes(engine)
    with Writes() as writes:
        result = live.commit(staged)
    assert writes.count == 0
    assert (result.version, result.tensors, result.verified) == (same, 0, None)
    assert live_bytes(engine) == before and live.version == same


def test_name_map_and_mapping_targets(tmp_path: Path, run: TrainingRun) -> None:
    engine = engine_model(run.config, run.states[0])
    renamed = {f"engine.{n}": t for n, t in engine.state_dict(keep_vars=True).items()}
    live = LiveWeights(
        renamed,
        tmp_path / "local",
        str(run.store_dir),
        base_dir=run.base_dir,
        name_map=lambda name: f"engine.{name}",
    )
    version = run.step()
    live.commit(live.stage(version))
    assert_at(engine, run, version)


def test_a_checkpoint_tensor_without_a_target_is_refused(tmp_path: Path, run: TrainingRun) -> None:
    engine = engine_model(run.config, run.states[0])
    targets = dict(engine.state_dict(keep_vars=True))
    del targets["model.norm.weight"]
    with pytest.raises(ConfigError, match=r"model\.norm\.weight"):
        LiveWeights(targets, tmp_path / "local", str(run.store_dir), base_dir=run.base_dir)
    targets["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"model\.norm\.weight.*bytes"):
        LiveWeights(targets, tmp_path / "local", str(run.store_dir), base_dir=run.base_dir)
