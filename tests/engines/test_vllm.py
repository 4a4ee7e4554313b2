"""The vLLM backend's logic (``DeltastoreReceiver``), driven with vLLM's method names and
argument shapes (vLLM 0.33.0's ``WeightTransferEngine``: ``parse_init_info``,
``init_transfer_engine``, ``start_weight_update``, ``update_weights(dict)``,
``finish_weight_update``) into the ``load_weights`` of a real ``transformers`` Llama whose
q/k/v projections live in one fused tensor, as vLLM's ``QKVParallelLinear`` keeps them; then
``EngineSync(engine="vllm")`` over HTTP against a stand-in of vLLM's RL routes with that
receiver behind them. The vLLM subclass itself is import-tested only where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import tomllib
import torch
from transformers import LlamaForCausalLM

import deltastore as ds
from deltastore.engines import EngineSync
from deltastore.engines.vllm import BACKEND, DeltastoreReceiver
from deltastore.errors import EngineLeftPausedError, EngineSyncError
from deltastore.format.safetensors_io import read_header_file
from tests.engines.helpers import (
    TrainingRun,
    engine_model,
    greedy,
    live_bytes,
    load_checkpoint_model,
    raw,
)
from tests.engines.standin import VllmStandIn
from tests.pull.serving import serving

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[1, 5, 9, 2, 7]])
QKV = ("q_proj", "k_proj", "v_proj")


class VllmStyleModel:
    """A transformers Llama behind vLLM's ``load_weights`` contract: checkpoint names in;
    q/k/v go into their shard of the layer's fused qkv tensor (the HF projections are views of
    it), everything else is copied into the parameter of that name."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.fused: dict[str, torch.Tensor] = {}
        self.loaded: list[list[str]] = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            parts = [getattr(attn, p).weight.detach() for p in QKV]
            fused = torch.cat(parts).contiguous()
            self.fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = fused
            start = 0
            for p, part in zip(QKV, parts):
                rows = part.shape[0]
                getattr(attn, p).weight = torch.nn.Parameter(fused[start : start + rows], False)
                start += rows
        self.params = dict(model.state_dict(keep_vars=True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                names.append(name)
                shard = next((p for p in QKV if f".{p}." in name), None)
                if shard is None:
                    self.params[name].copy_(tensor)
                    continue
                fused = self.fused[name.replace(shard, "qkv_proj")]
                sizes = [self.params[name.replace(shard, p)].shape[0] for p in QKV]
                start = sum(sizes[: QKV.index(shard)])
                fused[start : start + sizes[QKV.index(shard)]].copy_(tensor)
        self.loaded.append(names)
        return set(names)


def _receiver(run: TrainingRun, root: Path, engine: VllmStyleModel, **init: object):
    receiver = DeltastoreReceiver(engine, default_base_dir=str(run.base_dir))
    info = {"source_dir": str(run.store_dir), "local_checkpoint_dir": str(root / "ckpt"), **init}
    receiver.init_transfer_engine(receiver.parse_init_info(info))
    return receiver


def _update(receiver: DeltastoreReceiver, version: int, phase: str) -> None:
    receiver.start_weight_update()
    receiver.update_weights({"version": version, "phase": phase})
    receiver.finish_weight_update()


def _changed(run: TrainingRun, before: int, after: int) -> set[str]:
    a, b = run.states[before], run.states[after]
    return {n for n in b if raw(a[n]) != raw(b[n])}


def _corrupt(store_dir: Path, version: int) -> None:
    shard = next((store_dir / f"weight_v{version:06d}").glob("*.safetensors"))
    entry = max(read_header_file(str(shard)).tensors.values(), key=lambda e: e.end - e.start)
    data = bytearray(shard.read_bytes())
    data[(entry.start + entry.end) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_each_update_is_bit_exact_and_generates_like_the_pulled_checkpoint(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    engine = VllmStyleModel(engine_model(run.config, run.states[0]))
    receiver = _receiver(run, tmp_path, engine)
    for _ in range(3):
        version = run.step()
        _update(receiver, version, "stage")
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[version - 1].items()}
        engine.loaded.clear()
        _update(receiver, version, "commit")
        assert receiver.version == version
        assert engine.loaded and set(engine.loaded[0]) == _changed(run, version - 1, version)
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[version].items()}
        fresh = load_checkpoint_model(run.config, tmp_path / "ckpt")
        assert torch.equal(greedy(engine.model, PROMPT), greedy(fresh, PROMPT))
    # A step that changes nothing is committed at the stage (it writes nothing).
    same = run.step(train=False)
    engine.loaded.clear()
    _update(receiver, same, "stage")
    assert receiver.version == same and engine.loaded == []


def test_a_corrupt_version_is_refused_with_the_model_untouched(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    engine = VllmStyleModel(engine_model(run.config, run.states[0]))
    receiver = _receiver(run, tmp_path, engine)
    _update(receiver, run.step(), "stage")
    _update(receiver, 1, "commit")
    bad = run.step()
    _corrupt(run.store_dir, bad)
    before = live_bytes(engine.model)
    engine.loaded.clear()
    for phase in ("stage", "commit"):
        receiver.start_weight_update()
        with pytest.raises(ds.DeltastoreError, match=f"weight_v{bad:06d}|v{bad:06d}"):
            receiver.update_weights({"version": bad, "phase": phase})
    assert live_bytes(engine.model) == before and engine.loaded == [] and receiver.version == 1


def test_unknown_weights_load_every_tensor_first(tmp_path: Path):
    """``engine_version: null``: an engine started with ``--load-format dummy``."""
    run = TrainingRun.start(tmp_path / "run")
    torch.manual_seed(99)
    engine = VllmStyleModel(LlamaForCausalLM(run.config).to(torch.bfloat16).eval())
    receiver = _receiver(run, tmp_path, engine, engine_version=None)
    version = run.step()
    _update(receiver, version, "stage")
    _update(receiver, version, "commit")
    assert len(engine.loaded[-1]) == len(run.states[version])  # every tensor
    assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[version].items()}
    _update(receiver, run.step(), "stage")
    _update(receiver, version + 1, "commit")
    assert set(engine.loaded[-1]) == _changed(run, version, version + 1)  # then deltas only


def test_bad_init_and_update_info_are_refused(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    receiver = DeltastoreReceiver(VllmStyleModel(engine_model(run.config, run.states[0])))
    with pytest.raises(ValueError, match="unknown key"):  # vLLM answers a ValueError with 400
        receiver.parse_init_info({"source_dir": "x", "local_checkpoint_dir": "/c", "typo": 1})
    with pytest.raises(ValueError, match="phase"):
        receiver.parse_update_info({"version": 1, "phase": "apply"})
    with pytest.raises(ValueError, match="version"):
        receiver.parse_update_info({"version": -1})
    with pytest.raises(ds.ConfigError, match="init_weight_transfer_engine"):
        receiver.update_weights({"version": 1})


def _phases(standin: VllmStandIn) -> list[str]:
    """The ``phase`` of each ``/update_weights`` call, in order."""
    return [b["update_info"]["phase"] for b in standin.state.bodies if b and "update_info" in b]


def _engine_sync(run: TrainingRun, url: str, tmp_path: Path) -> EngineSync:
    return EngineSync("vllm", url, str(run.store_dir), str(tmp_path / "ckpt"))


def test_engine_sync_over_vllms_routes(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    engine = VllmStyleModel(engine_model(run.config, run.states[0]))
    standin = VllmStandIn(DeltastoreReceiver(engine, default_base_dir=str(run.base_dir)))
    with serving(standin.app()) as url:
        sync = _engine_sync(run, url, tmp_path)
        result = sync.sync(run.step())
        assert standin.state.calls == [
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "pause",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "resume",
        ]
        phases = [
            b["update_info"]["phase"] for b in standin.state.bodies if b and "update_info" in b
        ]
        assert phases == ["stage", "commit"] and standin.state.weight_version == "1"
        assert result.changed and result.tensors_changed == len(_changed(run, 0, 1))
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[1].items()}

        standin.state.calls.clear()  # no change: staged (and committed there), never paused
        assert not sync.sync(run.step(train=False)).changed
        assert standin.state.calls == [
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ]

        _corrupt(run.store_dir, run.step())  # a failed pull never pauses
        standin.state.calls.clear()
        with pytest.raises(EngineSyncError, match="not paused"):
            sync.sync(3)
        assert "pause" not in standin.state.calls and not standin.state.paused
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[2].items()}


def test_a_failed_commit_is_retried_by_a_reload_else_left_paused(tmp_path: Path):
    run = TrainingRun.start(tmp_path / "run")
    engine = VllmStyleModel(engine_model(run.config, run.states[0]))
    standin = VllmStandIn(DeltastoreReceiver(engine, default_base_dir=str(run.base_dir)))
    standin.fail_updates = lambda info: info["phase"] == "commit"
    with serving(standin.app()) as url:
        sync = _engine_sync(run, url, tmp_path)
        result = sync.sync(run.step())
        assert result.retried and not standin.state.paused
        phases = [
            b["update_info"]["phase"] for b in standin.state.bodies if b and "update_info" in b
        ]
        assert phases == ["stage", "commit", "reload"]
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[1].items()}

        standin.fail_updates = lambda info: info["phase"] in ("commit", "reload")
        standin.state.calls.clear()
        with pytest.raises(EngineLeftPausedError, match="LEFT PAUSED"):
            sync.sync(run.step())
        assert standin.state.paused and "resume" not in standin.state.calls
        assert sync.version is None


def test_the_plugin_entry_point_names_the_register_function():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["deltastore"]
    assert target == "deltastore.engines.vllm:register"
    assert project["optional-dependencies"]["vllm"] == []  # the extra installs no vLLM
    import deltastore.engines.vllm as backend

    assert callable(backend.register) and BACKEND == "deltastore"


def test_the_vllm_subclass_registers_where_vllm_is_installed():
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from deltastore.engines import vllm as backend

    backend.register()
    backend.register()  # vLLM may load plugins more than once
    cls = WeightTransferEngineFactory._registry[BACKEND]()
    assert issubclass(cls, WeightTransferEngine) and cls is backend.engine_class()
    assert cls.init_info_cls is backend.DeltastoreInitInfo


def test_workers_of_one_host_share_one_pull(tmp_path: Path):
    """Two workers (tensor-parallel ranks of one host) stage at once: one pulls under the
    host's lock, the other finds the checkpoint there; both models get the version."""
    import concurrent.futures as cf

    run = TrainingRun.start(tmp_path / "run")
    engines = [VllmStyleModel(engine_model(run.config, run.states[0])) for _ in range(2)]
    receivers = [_receiver(run, tmp_path, e) for e in engines]
    version = run.step()
    with cf.ThreadPoolExecutor(2) as pool:
        staged = list(pool.map(lambda r: r.stage(version), receivers))
    actions = sorted(s.pull.action for s in staged if s is not None)
    assert actions == ["noop", "reseeded"]  # the first seeds the host's dir and applies v1
    for receiver, engine in zip(receivers, engines):
        receiver.commit(version)
        assert live_bytes(engine.model) == {n: raw(t) for n, t in run.states[version].items()}
