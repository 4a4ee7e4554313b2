"""``EngineSync(engine="sglang")`` against a stand-in sglang server (tests/engines/standin.py:
the routes and JSON of sglang 0.5.23 and of its ``/pull_weights``, PR #30366) whose pulls are
real ``pull_weights`` calls and whose reload reads the real local checkpoint, and against real
``deltastore serve`` processes' apps: call order, the no-change skip, a failed pull (never
paused), a failed reload (retried once, else left paused), several hosts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.engines import EngineSync
from deltastore.engines.sync import changes_between
from deltastore.errors import EngineLeftPausedError, EngineSyncError
from deltastore.format.safetensors_io import read_header_file
from deltastore.pull.server import ServerConfig
from tests.engines.standin import SglangStandIn
from tests.pull.helpers import evolve, many_tensors, write_checkpoint
from tests.pull.serving import running_server, serving

FULL_CYCLE = [
    "/pull_weights",
    "/pause_generation",
    "/flush_cache",
    "/update_weights_from_disk",
    "/continue_generation",
]


class Run:
    """A base checkpoint and a store: v1, v2 change tensors, v3 changes nothing, v4 does."""

    def __init__(self, root: Path, encoding: str = "xor") -> None:
        self.root = root
        self.base_dir = root / "base"
        self.store_dir = root / "store"
        base = many_tensors(24, seed=21, elements=512)
        write_checkpoint(self.base_dir, base)
        publisher = ds.DeltaPublisher(str(self.store_dir), str(self.base_dir), encoding=encoding)
        publisher.seed()
        rng = np.random.default_rng(22)
        self.states = {0: base}
        current = base
        for version in (1, 2, 3, 4):
            if version != 3:
                current = evolve(current, rng, 0.3, 0.05)
            assert publisher.publish(current.items()).version == version
            self.states[version] = current

    def matches(self, weights: dict[str, torch.Tensor], version: int) -> bool:
        want = self.states[version]
        return set(weights) == set(want) and all(
            torch.equal(weights[n].view(torch.uint8), want[n].contiguous().view(torch.uint8))
            for n in want
        )


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


def _sync(run: Run, url: str, **kw: object) -> EngineSync:
    return EngineSync("sglang", url, str(run.store_dir), str(run.root / "ckpt"), **kw)  # type: ignore[arg-type]


def test_call_order_weights_and_the_phase_split(run: Run):
    engine = SglangStandIn(run.base_dir)
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        result = sync.sync(1)
    assert engine.state.calls == FULL_CYCLE
    pull, _pause, _flush, reload, _go = engine.state.bodies
    assert pull == {
        "local_checkpoint_dir": str(run.root / "ckpt"),
        "source_dir": str(run.store_dir),
        "target_version": 1,
    }
    assert reload == {"model_path": str(run.root / "ckpt"), "weight_version": "1"}
    assert run.matches(engine.state.weights[0], 1) and not engine.state.paused
    assert result.changed and result.version == 1 == sync.version and not result.retried
    changed = {n for n in run.states[1] if not torch.equal(run.states[1][n], run.states[0][n])}
    assert result.tensors_changed == len(changed) and result.wire_bytes > 0
    assert min(result.pull_s, result.pause_s, result.reload_s, result.resume_s) > 0
    assert result.total_s >= result.pull_s + result.paused_s
    metrics = sync.pop_metrics()
    assert metrics["version"] == 1 and metrics["syncs"] == 1 and metrics["wire_bytes"] > 0
    assert metrics["paused_s"] == pytest.approx(result.paused_s)
    assert sync.pop_metrics()["syncs"] == 0  # cleared


def test_a_version_that_changes_nothing_skips_pause_and_reload(run: Run):
    engine = SglangStandIn(run.base_dir)
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        sync.sync(2)  # v1 and v2 in one catch-up
        engine.state.calls.clear()
        skipped = sync.sync(3)
        assert engine.state.calls == ["/pull_weights"]  # pulled, never paused
        assert not skipped.changed and skipped.paused_s == 0 and sync.version == 3
        assert ds.VersionStore(str(run.store_dir)).index(3).weight_map == {}
        assert run.matches(engine.state.weights[0], 2)  # = v3's bytes
        engine.state.calls.clear()
        assert sync.sync("latest").version == 4
        assert engine.state.calls == FULL_CYCLE
    assert run.matches(engine.state.weights[0], 4)
    assert sync.pop_metrics()["skipped"] == 1


def _corrupt(store_dir: Path, version: int) -> str:
    shard = next((store_dir / f"weight_v{version:06d}").glob("*.safetensors"))
    entry = max(read_header_file(str(shard)).tensors.values(), key=lambda e: e.end - e.start)
    data = bytearray(shard.read_bytes())
    data[(entry.start + entry.end) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return entry.name


def test_a_failed_pull_never_pauses_the_engine(run: Run):
    engine = SglangStandIn(run.base_dir)
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        sync.sync(1)
        victim = _corrupt(run.store_dir, 2)
        engine.state.calls.clear()
        with pytest.raises(EngineSyncError, match="not paused") as info:
            sync.sync(2)
    assert victim in str(info.value) and "v000001" in str(info.value)
    assert engine.state.calls == ["/pull_weights"] and not engine.state.paused
    assert run.matches(engine.state.weights[0], 1) and sync.version == 1
    assert sync.pop_metrics()["failed"] == 1


def test_a_failed_reload_is_retried_once_from_the_verified_checkpoint(run: Run):
    engine = SglangStandIn(run.base_dir)
    engine.state.fail_reloads = 1
    with serving(engine.app()) as url:
        result = _sync(run, url).sync(1)
    assert result.retried
    assert engine.state.calls == [
        "/pull_weights",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/pull_weights",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert run.matches(engine.state.weights[0], 1) and not engine.state.paused


def test_a_reload_that_fails_twice_leaves_the_engine_paused(run: Run):
    engine = SglangStandIn(run.base_dir)
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        sync.sync(1)
        engine.state.fail_reloads = 2
        engine.state.calls.clear()
        with pytest.raises(EngineLeftPausedError, match="LEFT PAUSED") as info:
            sync.sync(2)
        assert "v000002" in str(info.value) and "injected: CUDA error" in str(info.value)
        assert engine.state.calls[-1] == "/update_weights_from_disk"
        assert "/continue_generation" not in engine.state.calls and engine.state.paused
        assert sync.version is None  # partly loaded: the next sync reloads
        assert isinstance(info.value, ds.DeltastoreError)
        # Once the engine works again, the next sync brings it back and resumes it.
        assert sync.sync(2).changed
    assert run.matches(engine.state.weights[0], 2) and not engine.state.paused


def test_several_hosts_through_the_engines_pull_weights(run: Run, tmp_path: Path):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    engine = SglangStandIn(run.base_dir, hosts)
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        sync.sync(1)
        assert all(run.matches(engine.state.weights[h], 1) for h in (0, 1))
        engine.state.fail_pull_hosts = {1}
        engine.state.calls.clear()
        with pytest.raises(EngineSyncError, match="host 1: injected") as info:
            sync.sync(2)
    assert "not paused" in str(info.value) and engine.state.calls == ["/pull_weights"]
    assert all(run.matches(engine.state.weights[h], 1) for h in (0, 1))


def test_several_hosts_through_deltastore_serve(tmp_path: Path):
    """Deltastore's own encoding (``auto``), which sglang's own puller cannot read: one
    ``deltastore serve`` per host pulls, then the engine reloads from disk."""
    run = Run(tmp_path / "run", encoding="auto")
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    engine = SglangStandIn(run.base_dir, hosts)
    config = ServerConfig(base_dir=str(run.base_dir), allow=(str(tmp_path),))
    with running_server(config) as s0, running_server(config) as s1, serving(engine.app()) as url:
        dirs = {s0.url: str(hosts[0] / "ckpt"), s1.url: str(hosts[1] / "ckpt")}
        sync = EngineSync(
            "sglang",
            url,
            str(run.store_dir),
            dirs,
            engine_checkpoint_dir="/ckpt",
            serve_urls=[s0.url, s1.url],
        )
        result = sync.sync(2)
        assert engine.state.calls == FULL_CYCLE[1:]  # the engine's own puller is not used
        assert [r.success for r in result.hosts] == [True, True]
        assert all(run.matches(engine.state.weights[h], 2) for h in (0, 1))
        assert engine.state.bodies[2]["model_path"] == "/ckpt"
        # One host's pull fails (its checkpoint's state is unreadable): nobody is paused.
        (hosts[1] / "ckpt" / ".weight_sync" / "state.json").write_text("{not json")
        _corrupt(run.store_dir, 4)
        engine.state.calls.clear()
        with pytest.raises(EngineSyncError, match="not paused"):
            sync.sync(4)
        assert engine.state.calls == [] and not engine.state.paused
        assert s0.server.metrics.pulls.labels("failed")._value.get() == 1


def test_changes_between_counts_only_a_plain_run_of_deltas(run: Run, tmp_path: Path):
    store = ds.VersionStore(str(run.store_dir))
    assert not changes_between(store, 2, 3).changed
    assert not changes_between(store, 3, 3).changed
    assert changes_between(store, 2, 4).changed
    assert changes_between(store, None, 3).changed  # the engine's version is unknown
    assert changes_between(store, 4, 3).changed  # backward
    one = changes_between(store, 0, 1)
    assert one.changed and one.tensors == len(store.index(1).weight_map) > 0


def test_bad_settings_are_refused(run: Run):
    with pytest.raises(ds.ConfigError, match="engine must be"):
        EngineSync("tgi", "http://x", str(run.store_dir), "/ckpt")
    with pytest.raises(ds.ConfigError, match="serve_urls"):
        EngineSync("vllm", "http://x", str(run.store_dir), "/ckpt", serve_urls=["http://y"])
    with pytest.raises(ds.ConfigError, match="serve_urls"):
        EngineSync("sglang", "http://x", [str(run.store_dir), "s3://b/r"], "/ckpt")
    with pytest.raises(ds.ConfigError, match="version"):
        EngineSync("sglang", "http://x", str(run.store_dir), "/ckpt").sync(-1)


def test_a_failed_flush_resumes_the_engine_unreloaded(run: Run):
    engine = SglangStandIn(run.base_dir)
    engine.state.fail_flush = True
    with serving(engine.app()) as url:
        sync = _sync(run, url)
        with pytest.raises(EngineSyncError, match=r"flush failed.*resumed"):
            sync.sync(1)
    assert engine.state.calls == [*FULL_CYCLE[:3], "/continue_generation"]
    assert not engine.state.paused and run.matches(engine.state.weights[0], 0)
    assert sync.version == 0
