"""Replicating a shard far larger than the memory bound: ranged reads into a streamed upload,
never the whole shard in memory. Peak Python allocations are measured in a child process for
a 32 MiB and a 96 MiB shard: they must not grow with the shard (the constant part is the S3
client's own state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from deltastore.format.index import VersionIndex
from deltastore.format.safetensors_io import TensorLayout, write_safetensors
from deltastore.storage import VersionStore
from deltastore.testing.servers import s3_env
from tests.conftest import STORE_BUCKET

MiB = 1024 * 1024
NAME = "model-00001-of-00001.safetensors"


def one_shard_store(directory: Path, megabytes: int) -> VersionStore:
    store = VersionStore(directory)
    rng = np.random.default_rng(0)
    names = [f"t{i}" for i in range(megabytes // 8)]
    with store.begin(1) as writer:
        with writer.open_write(NAME) as fh:
            write_safetensors(
                fh,
                [
                    (TensorLayout(n, "U8", (8 * MiB,)), rng.integers(0, 255, 8 * MiB, np.uint8))
                    for n in names
                ],
            )
        writer.commit(VersionIndex(1, dict.fromkeys(names, NAME)))
    return store


def peak_while_replicating(src: VersionStore, server: Any) -> int:
    dst_url = f"s3://{STORE_BUCKET}/memory-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **s3_env(server))
    probe = Path(__file__).with_name("memory_probe.py")
    out = subprocess.run(
        [sys.executable, str(probe), src.url, dst_url, "2", str(MiB), str(5 * MiB)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["copied"] == [1]
    dst = VersionStore(dst_url, server.storage_options)
    assert dst.file_size(1, NAME) == src.file_size(1, NAME)
    return int(result["peak"])


def test_a_large_shard_is_copied_in_bounded_memory(s3_server: Any, tmp_path: Path) -> None:
    small = peak_while_replicating(one_shard_store(tmp_path / "small", 32), s3_server)
    large = peak_while_replicating(one_shard_store(tmp_path / "large", 96), s3_server)
    # Three times the shard, the same peak: a few 1 MiB chunks and 5 MiB parts, never a shard.
    assert abs(large - small) < 8 * MiB, (small, large)
    assert large < 96 * MiB, (small, large)
