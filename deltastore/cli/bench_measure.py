"""The measurements behind ``deltastore bench``: one model step, published and pulled by
deltastore (per encoding), by the reference-style path (deltastore.cli.reference) and as a
full-checkpoint copy, in one process, same bytes, same thread count, best of ``repeat``."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from deltastore.cli.reference import reference_publish, reference_pull
from deltastore.publish import DeltaPublisher
from deltastore.publish.device import host_bytes
from deltastore.pull import pull_weights, wait_durable
from deltastore.storage import VersionStore

Model = dict[str, torch.Tensor]
PUBLISH_PHASES = ("load_s", "copy_s", "encode_s", "diff_s", "write_s", "commit_s")
"""Publisher metrics (``pop_metrics()``) reported per encoding; encode_s is summed over threads."""


@dataclass
class Path:
    """Best-of figures of one way to sync the step (seconds; bytes)."""

    wire_bytes: int = 0
    publish_s: float = float("inf")
    pull_s: float = float("inf")
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the fastest publish / pull."""

    def keep(self, publish_s: float, pull_s: float, phases: dict[str, float]) -> None:
        if publish_s < self.publish_s:
            self.phases = {**self.phases, **{k: v for k, v in phases.items() if "pull" not in k}}
        self.publish_s = min(self.publish_s, publish_s)
        if pull_s < self.pull_s:
            self.phases.update({k: v for k, v in phases.items() if "pull" in k})
        self.pull_s = min(self.pull_s, pull_s)


@dataclass
class Bench:
    """What one bench run measures."""

    base_dir: str
    after: Model
    workdir: str
    workers: int
    store_root: str
    storage_options: dict[str, object] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)
    runs: int = 0

    def base_files(self) -> list[str]:
        return sorted(
            os.path.join(self.base_dir, f)
            for f in os.listdir(self.base_dir)
            if f.endswith(".safetensors")
        )

    def measure_reference(self) -> None:
        """One reference-style publish and in-place pull (best kept)."""
        from safetensors import safe_open

        snapshot: dict[str, np.ndarray] = {}
        for file in self.base_files():
            with safe_open(file, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    snapshot[name] = host_bytes(name, fh.get_tensor(name)).copy()
        shard = os.path.join(self.workdir, "reference-delta.safetensors")
        news = [(n, host_bytes(n, t)) for n, t in self.after.items()]
        settle()
        begun = time.perf_counter()
        wire, phases = reference_publish(snapshot, news, shard, self.workers)
        publish_s = time.perf_counter() - begun
        del snapshot
        (base_file,) = self.base_files()[:1]
        host_file = os.path.join(self.workdir, "reference-host.safetensors")
        shutil.copyfile(base_file, host_file)
        settle()
        begun = time.perf_counter()
        pulled = reference_pull(shard, host_file, self.workers)
        pull_s = time.perf_counter() - begun
        path = self.paths.setdefault("reference", Path())
        path.wire_bytes = wire
        path.keep(
            publish_s,
            pull_s,
            {**phases.seconds, **{f"pull_{k}": v for k, v in pulled.seconds.items()}},
        )
        # The same pull without the final msync, as the upstream engine readers apply a
        # version (the engine reloads from the page cache).
        shutil.copyfile(base_file, host_file)
        settle()
        begun = time.perf_counter()
        reference_pull(shard, host_file, self.workers, flush=False)
        upstream = self.paths.setdefault("upstream", Path())
        upstream.wire_bytes = wire
        upstream.keep(publish_s, time.perf_counter() - begun, {})

    def measure_deltastore(self, encoding: str) -> None:
        """Seed a fresh store, publish the step with ``encoding``, pull it onto a host at v0."""
        self.runs += 1  # a fresh store per run: a remote prefix is never reused
        root = f"{self.store_root.rstrip('/')}/store-{encoding}-{self.runs}"
        store = VersionStore(root, self.storage_options)
        publisher = DeltaPublisher(store, self.base_dir, encoding=encoding, workers=self.workers)
        publisher.seed()
        host = os.path.join(self.workdir, f"host-{encoding}")
        shutil.rmtree(host, ignore_errors=True)
        pull_weights(host, store, 0, base_dir=self.base_dir, workers=self.workers)
        publisher.pop_metrics()
        settle()
        begun = time.perf_counter()
        result = publisher.publish(self.after.items())
        publish_s = time.perf_counter() - begun
        metrics = publisher.pop_metrics()
        settle()
        # Timed to the reply (what an engine waits for); the flush and the state after it.
        begun = time.perf_counter()
        pull_weights(
            host,
            store,
            result.version,
            base_dir=self.base_dir,
            workers=self.workers,
            flush_after_reply=True,
        )
        pull_s = time.perf_counter() - begun
        wait_durable(host)
        durable_s = time.perf_counter() - begun - pull_s
        path = self.paths.setdefault(encoding, Path())
        path.wire_bytes = result.wire_bytes
        phases = {k: float(metrics[k]) for k in PUBLISH_PHASES if k in metrics}
        path.keep(publish_s, pull_s, {**phases, "pull_durable_after_reply_s": durable_s})
        if "://" not in root:
            shutil.rmtree(root, ignore_errors=True)

    def measure_full_copy(self) -> None:
        """Copy every base file (what shipping the whole checkpoint costs), fsynced."""
        settle()
        begun = time.perf_counter()
        total = 0
        for source in self.base_files():
            target = os.path.join(self.workdir, "full-copy-" + os.path.basename(source))
            shutil.copyfile(source, target)
            with open(target, "rb+") as fh:
                os.fsync(fh.fileno())
            total += os.path.getsize(target)
        seconds = time.perf_counter() - begun
        path = self.paths.setdefault("full", Path())
        path.wire_bytes = total
        path.keep(seconds, seconds, {})


def settle() -> None:
    """Flush dirty pages before a timed section, so no path pays for the previous one's writes."""
    if hasattr(os, "sync"):
        os.sync()


def run_all(bench: Bench, encodings: list[str], repeat: int, advance: Callable[[], None]) -> None:
    """Every path ``repeat`` times, interleaved so drift on a shared machine hits all alike."""
    for _ in range(repeat):
        bench.measure_reference()
        advance()
        for encoding in encodings:
            bench.measure_deltastore(encoding)
            advance()
        bench.measure_full_copy()
        advance()
