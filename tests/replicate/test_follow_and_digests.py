"""``follow``: new versions are picked up as the source commits them; the streamed digests
agree with ``deltastore.codecs``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import deltastore as ds
from deltastore.codecs import CHECKSUMS, get_checksum
from deltastore.errors import IntegrityError
from deltastore.format.safetensors_io import TensorLayout, write_safetensors
from deltastore.replicate import Observer, ReplicationPolicy, ReplicationReport, VersionCopy
from deltastore.replicate.version import shard_checker
from deltastore.storage import VersionStore
from tests.replicate.helpers import assert_replica
from tests.storage.models import model_at, write_base


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


class Seen(Observer):
    def __init__(self) -> None:
        self.done: list[int] = []
        self.event = threading.Event()

    def version_done(self, record: VersionCopy) -> None:
        self.done.append(record.version)
        self.event.set()


def test_follow_picks_up_new_versions_and_mirrors_pruning(tmp_path: Path) -> None:
    base = write_base(tmp_path / "base")
    src, dst = VersionStore(tmp_path / "src"), VersionStore(tmp_path / "dst")
    publisher = ds.DeltaPublisher(src, base)
    publisher.seed()
    publisher.publish(model_at(1).items())
    seen, stop = Seen(), threading.Event()
    policy = ReplicationPolicy(poll_min_s=0.05, poll_max_s=0.2, prune_grace_s=0)
    result: list[object] = []
    thread = threading.Thread(
        target=lambda: result.append(
            ds.replicate(
                src,
                dst,
                follow=True,
                prune_like_source=True,
                policy=policy,
                observer=seen,
                stop=stop,
            )
        )
    )
    thread.start()
    try:
        for step, full in ((2, False), (3, True), (4, False)):
            publisher.publish(model_at(step).items(), full=full)
            wait_until(lambda step=step: step in seen.done)  # type: ignore[misc]
        src.prune(keep=1, grace_s=0)  # the source keeps v3 (full) and v4
        wait_until(lambda: dst.versions() == [3, 4])
    finally:
        stop.set()
        thread.join(timeout=60)
    assert seen.done == [1, 2, 3, 4]
    assert_replica(src, dst, [3, 4])
    report = result[0]
    assert isinstance(report, ReplicationReport)
    assert report.pruned == (1, 2)


@pytest.mark.parametrize("algorithm", sorted(CHECKSUMS))
@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_streamed_digests_match_codecs(algorithm: str, piece: int, tmp_path: Path) -> None:
    checksum = get_checksum(algorithm)
    tensors = [
        (TensorLayout(f"t{i}", "U8", (n,)), bytes(range(256)) * (n // 256) + bytes(n % 256))
        for i, n in enumerate([0, 1, 300, 5000])
    ]
    metadata = {layout.name: checksum.hexdigest(data) for layout, data in tensors}
    path = tmp_path / "shard.safetensors"
    with open(path, "wb") as fh:
        write_safetensors(fh, tensors, metadata)
    data = path.read_bytes()
    checker = shard_checker("shard", len(data), algorithm, check_digests=True, hash_tensors=True)
    for offset in range(0, len(data), piece):
        checker.update(data[offset : offset + piece])
    checker.finish()
    assert checker.checked == 4
    corrupt = bytearray(data)
    corrupt[-1] ^= 1
    checker = shard_checker("shard", len(data), algorithm, check_digests=True, hash_tensors=True)
    with pytest.raises(IntegrityError, match="'t3'"):
        for offset in range(0, len(corrupt), piece):
            checker.update(bytes(corrupt[offset : offset + piece]))
