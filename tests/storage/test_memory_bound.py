"""Streaming with bounded memory: a 64 MiB shard through S3 (multipart) and GCS (resumable)
with a block of a few MiB. The transfer runs in a child process (``memory_probe.py``) so the
emulator in this process does not count; tracemalloc measures the peak of each phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deltastore.testing.servers import GCSServer, S3Server

MiB = 1024**2
SIZE = 64 * MiB
PROBE = Path(__file__).with_name("memory_probe.py")


def run_probe(url: str, options: dict[str, Any], block: int) -> dict[str, Any]:
    child = subprocess.run(
        [sys.executable, str(PROBE), url, json.dumps(options), str(SIZE), str(block)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_peak_memory_stays_bounded(
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    if backend == "s3":
        server: S3Server | GCSServer = request.getfixturevalue("s3_server")
        url, block = request.getfixturevalue("s3_url"), 5 * MiB  # S3's minimum part size
    else:
        server = request.getfixturevalue("gcs_server")
        url, block = request.getfixturevalue("gcs_url"), MiB
    result = run_probe(url, server.storage_options, block)

    assert result["size"] == SIZE
    assert result["ranged_ok"] and result["streamed_ok"]
    # A few blocks of buffering, far below the 64 MiB a whole-object read or write would hold.
    bound = 4 * block + 8 * MiB
    assert bound < SIZE / 2
    for phase in ("write_peak", "range_peak", "stream_peak"):
        assert result[phase] < bound, (phase, result)
