"""Fan-out over a real torch.distributed (gloo) group: one apply per host, success only if
every host verified, every failure named on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltastore import VersionStore, verify_local
from deltastore.errors import ConfigError
from deltastore.pull import LocalCheckpoint, pull_weights
from deltastore.testing.servers import free_port
from tests.pull.helpers import many_tensors, publish_versions, write_checkpoint

# Slow: real gloo ranks.
pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("fanout_worker.py")


def test_group_pull_one_apply_per_host_and_failures_named_everywhere(tmp_path: Path):
    base = many_tensors(30, seed=101, elements=512)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 2, seed=102)
    store = VersionStore(str(published.store_dir))
    victim = sorted(store.index(2).weight_map)[0]
    host0, host1 = str(tmp_path / "host0"), str(tmp_path / "host1")
    dirs = [host0, host1, host0]  # ranks 0 and 2 share a host
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), GLOO_SOCKET_IFNAME="lo")
    procs = []
    for rank in range(3):
        args = {
            "rank": rank,
            "world": 3,
            "port": port,
            "store": str(published.store_dir),
            "base": str(published.base_dir),
            "dirs": dirs,
            "corrupt_rank": 1,
            "corrupt_tensor": victim,
            "out": str(tmp_path / f"rank{rank}.json"),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank]}"
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]

    # v1: every rank succeeded; the shared host applied once, its other rank found a no-op.
    assert sorted([out[0]["v1"]["action"], out[2]["v1"]["action"]]) == ["noop", "reseeded"]
    assert out[1]["v1"]["action"] == "reseeded"
    group = out[0]["v1"]["group"]
    assert [o["rank"] for o in group] == [0, 1, 2] and all(o["success"] for o in group)

    # v2: host1 holds a corrupted tensor, so every rank reports failure, naming rank 1.
    for rank in range(3):
        v2 = out[rank]["v2"]
        assert v2["success"] is False
        assert v2["failed_ranks"] == [1]
        assert "rank 1" in v2["message"] and host1 in v2["message"]
        assert victim in v2["message"]
    assert out[1]["v2"]["cause"] == "IntegrityError"
    # The healthy host is verified at v2; the corrupted one still records v1 (put back).
    assert verify_local(host0, store, None, published.base_dir) == 2
    state = LocalCheckpoint(host1).read_state()
    assert state is not None and state.version == 1


def test_process_group_needs_an_initialised_group(tmp_path: Path):
    base = many_tensors(4, seed=103, elements=64)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 1, seed=104)
    with pytest.raises(ConfigError, match="not initialised"):
        pull_weights(
            tmp_path / "h", published.store_dir, 1, published.base_dir, process_group="world"
        )
    # "auto" without an initialised group is a plain single-host pull.
    result = pull_weights(
        tmp_path / "h", published.store_dir, 1, published.base_dir, process_group="auto"
    )
    assert result.version == 1 and result.group == ()
