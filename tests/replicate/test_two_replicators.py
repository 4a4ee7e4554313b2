"""Two real ``deltastore replicate`` processes on one replica: each version is committed by
exactly one of them, the other finds the winner's index equal to the source's and moves on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import deltastore as ds
from deltastore.storage import VersionStore
from deltastore.testing.servers import s3_env
from tests.conftest import STORE_BUCKET
from tests.replicate.helpers import assert_pulls_big, assert_replica, publish_big_run

KINDS = {1: "full", 2: "delta", 3: "full", 4: "full", 5: "delta"}


def test_two_replicators_on_one_destination(s3_server: Any, tmp_path: Path) -> None:
    src = VersionStore(tmp_path / "trainer")
    publish_big_run(src, tmp_path / "base", KINDS)
    dst_url = f"s3://{STORE_BUCKET}/two-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **s3_env(s3_server))
    command = [sys.executable, "-m", "deltastore", "replicate", src.url, dst_url, "--json"]
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outcomes: dict[int, list[str]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err.decode()
        for line in out.decode().splitlines():
            record = json.loads(line)
            if "summary" not in record:
                outcomes.setdefault(record["version"], []).append(record["outcome"])
    assert sorted(outcomes) == [1, 2, 3, 4, 5]
    for version, seen in outcomes.items():
        assert seen.count("copied") == 1, (version, seen)
    assert any("present" in seen for seen in outcomes.values()), f"no contention: {outcomes}"
    dst = VersionStore(dst_url, s3_server.storage_options)
    assert_replica(src, dst, [1, 2, 3, 4, 5])
    assert_pulls_big(dst, tmp_path / "base", tmp_path / "host", [2, 5])
    assert ds.replicate(src, dst).copied == ()
