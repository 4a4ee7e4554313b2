"""``kill -9`` of a real ``deltastore replicate --follow`` process at random moments, while a
reader polls the replica the whole time.

Each trial starts a fresh replica on moto S3 and kills ``DELTASTORE_REPLICATE_KILLS`` (1)
replicator processes at random moments (mostly in the middle of a version), then lets one
more finish. The reader checks every
listing it sees: versions only ever appear whole (index equal to the source's, every file at
its source size), in order and without holes; every version it pulls (into a host-local
checkpoint with a base) verifies and equals the trainer's model. ``DELTASTORE_REPLICATE_TRIALS``
sets the number of trials (3 by default; the full run uses 30).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import deltastore as ds
from deltastore.errors import VersionNotFoundError
from deltastore.format.names import INDEX_NAME
from deltastore.replicate.version import same_content
from deltastore.storage import VersionStore
from deltastore.testing.servers import s3_env
from tests.conftest import STORE_BUCKET
from tests.replicate.helpers import assert_big_model, publish_big_run

TRIALS = int(os.environ.get("DELTASTORE_REPLICATE_TRIALS", "3"))
KILLS = int(os.environ.get("DELTASTORE_REPLICATE_KILLS", "1"))
"""Replicators killed per trial before one is let finish."""
KINDS = {1: "full", 2: "delta", 3: "full", 4: "delta", 5: "full"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[VersionStore, Path]:
    root = tmp_path_factory.mktemp("kill")
    src = VersionStore(root / "trainer")
    publish_big_run(src, root / "base", KINDS)
    return src, root / "base"


class Reader(threading.Thread):
    """Polls the replica until stopped; records anything a reader must never see."""

    def __init__(self, src: VersionStore, dst: VersionStore, base: Path, host: Path) -> None:
        super().__init__(daemon=True)
        self.src, self.dst, self.base, self.host = src, dst, base, host
        self.expected = src.versions()
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.checked: set[int] = set()
        self.pulled: list[int] = []
        self.listings = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.look()
            except Exception as exc:  # every surprise is a finding
                self.problems.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)
        self.look()

    def look(self) -> None:
        self.dst.refresh()
        listed = self.dst.versions()
        self.listings += 1
        if listed != self.expected[: len(listed)]:
            self.problems.append(f"listing {listed} is not a prefix of {self.expected}")
            return
        for version in listed:
            if version not in self.checked:
                self.check_whole(version)
        if listed and listed[-1] not in self.pulled:
            ds.pull_weights(self.host, self.dst, listed[-1], base_dir=self.base)
            assert_big_model(self.host, listed[-1])
            self.pulled.append(listed[-1])

    def check_whole(self, version: int) -> None:
        try:
            index = self.dst.index(version)
        except VersionNotFoundError:
            self.problems.append(f"v{version} listed but its index cannot be read")
            return
        if not same_content(index, self.src.index(version)):
            self.problems.append(f"v{version} visible with another index than the source's")
        for name in self.src.list_files(version):
            if name != INDEX_NAME and (
                self.dst.file_size(version, name) != self.src.file_size(version, name)
            ):
                self.problems.append(f"v{version}/{name} visible at a partial size")
        self.checked.add(version)


def _replicator(src: VersionStore, dst_url: str, env: dict[str, str], *extra: str) -> Any:
    command = [sys.executable, "-m", "deltastore", "replicate", src.url, dst_url, "--json"]
    command += ["--stale-claim", "1", "--poll-max", "0.3", "--jobs", "2", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_kill_9_never_shows_a_partial_or_out_of_order_version(
    run: tuple[VersionStore, Path], s3_server: Any, tmp_path: Path
) -> None:
    src, base = run
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **s3_env(s3_server))
    rng = random.Random(int(os.environ.get("DELTASTORE_REPLICATE_SEED", "11")))
    mid_version = 0
    for trial in range(TRIALS):
        dst_url = f"s3://{STORE_BUCKET}/kill-{uuid.uuid4().hex[:8]}"
        dst = VersionStore(dst_url, s3_server.storage_options)
        reader = Reader(src, dst, base, tmp_path / f"host{trial}")
        reader.start()
        for _ in range(KILLS):
            proc = _replicator(src, dst_url, env, "--follow")
            assert proc.stdout is not None
            proc.stdout.readline()  # the first version it committed: it is copying now
            time.sleep(rng.uniform(0.0, 0.6))
            proc.kill()
            proc.wait()
            listing = dst.listing()
            mid_version += bool(set(listing.claims) - set(listing.committed))
        done = _replicator(src, dst_url, env)
        _, err = done.communicate(timeout=240)
        assert done.returncode == 0, err.decode()
        reader.stop.set()
        reader.join(timeout=120)
        assert not reader.problems, reader.problems
        assert dst.versions() == src.versions()
        assert reader.pulled and reader.pulled[-1] == src.versions()[-1]
    print(f"{TRIALS} trials, {KILLS * TRIALS} kills, {mid_version} in the middle of a version")
    if TRIALS >= 10:
        assert mid_version > 0, "no kill landed in the middle of a version"
