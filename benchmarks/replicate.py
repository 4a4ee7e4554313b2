"""Replication throughput against a plain copy, and the WAN bytes a replica saves.

    .venv/bin/python benchmarks/replicate.py                     # 200 MB in 4 shards, jobs 4
    .venv/bin/python benchmarks/replicate.py --mb 400 --shards 8 --jobs 8 --repeat 3
    .venv/bin/python benchmarks/replicate.py --hosts 64 --versions 20   # WAN bytes part

**Throughput** (one process, local store -> moto S3 on 127.0.0.1): one full version of
``--mb`` MB in ``--shards`` shards is copied ``--repeat`` times each way into fresh prefixes:

* **plain**: every file of the version directory copied with fsspec (``open`` + streamed
  ``write`` in blocks of the store's block size), ``--jobs`` files at once: what rclone or
  ``s5cmd sync`` would do, and the upper bound for any version-aware copy;
* **replicate**: ``deltastore.replicate`` with ``jobs=--jobs`` (claim, ranged reads, size
  checks, create-only index, read-back of the commit).

Prints the best time of each and the ratio replicate / plain (1.0 = as fast as a plain copy).

**WAN bytes** (counted, not timed): a run of ``--versions`` versions (one full, then deltas) is
published; one host pulls every version in turn straight from the far store, counting the
bytes it reads from it; ``deltastore.replicate`` copies the run once, counting the bytes it
reads. N far hosts pulling across move N x host bytes over the WAN; one replica per
datacenter moves the replica's bytes once, and its hosts read inside the datacenter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import save_file

import deltastore as ds
from deltastore.format.index import VersionIndex
from deltastore.format.safetensors_io import TensorLayout, write_safetensors
from deltastore.storage import VersionStore, store_objects
from deltastore.testing.servers import start_moto_s3

BUCKET = "deltastore-bench"


def write_full_version(store: VersionStore, megabytes: int, shards: int) -> None:
    """Version 1: ``shards`` safetensors shards of random fp32 tensors, ``megabytes`` in all."""
    rng = np.random.default_rng(0)
    per_shard = megabytes * 1024 * 1024 // shards
    weight_map: dict[str, str] = {}
    with store.begin(1) as writer:
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            tensors = []
            for t in range(4):
                data = rng.integers(0, 255, per_shard // 4, dtype=np.uint8).tobytes()
                tensors.append((TensorLayout(f"s{s}.t{t}", "U8", (len(data),)), data))
                weight_map[f"s{s}.t{t}"] = name
            with writer.open_write(name) as fh:
                write_safetensors(fh, tensors)
        writer.commit(VersionIndex(version=1, weight_map=weight_map))


def plain_copy(src: VersionStore, dst_fs: Any, dst_root: str, jobs: int, block: int) -> None:
    """Every file of weight_v000001 with fsspec, ``jobs`` at once (the baseline)."""
    names = src.list_files(1)

    def one(name: str) -> None:
        with (
            open(store_objects(src).file_path(1, name), "rb") as fh,
            dst_fs.open(f"{dst_root}/weight_v000001/{name}", "wb", block_size=block) as out,
        ):
            while chunk := fh.read(block):
                out.write(chunk)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, names))


def throughput(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    src = VersionStore(os.path.join(tmp, "trainer"))
    write_full_version(src, args.mb, args.shards)
    total = sum(src.file_size(1, n) for n in src.list_files(1))
    with start_moto_s3() as server:
        server.make_bucket(BUCKET)
        options = server.storage_options
        probe = VersionStore(f"s3://{BUCKET}/probe", options)
        times: dict[str, list[float]] = {"plain": [], "replicate": []}
        for _ in range(args.repeat):
            for way in ("plain", "replicate"):
                prefix = f"{BUCKET}/{way}-{uuid.uuid4().hex[:8]}"
                started = time.perf_counter()
                if way == "plain":
                    plain_copy(src, probe.fs, prefix, args.jobs, probe.block_size)
                else:
                    ds.replicate(src, f"s3://{prefix}", jobs=args.jobs, dst_storage_options=options)
                times[way].append(time.perf_counter() - started)
    best = {way: min(values) for way, values in times.items()}
    return {
        "bytes": total,
        "jobs": args.jobs,
        "shards": args.shards,
        "plain_s": round(best["plain"], 3),
        "replicate_s": round(best["replicate"], 3),
        "plain_mb_s": round(total / 1e6 / best["plain"], 1),
        "replicate_mb_s": round(total / 1e6 / best["replicate"], 1),
        "ratio_replicate_over_plain": round(best["replicate"] / best["plain"], 3),
    }


class CountingStore(VersionStore):
    """A store that counts the bytes read from it (what would cross the WAN)."""

    read_bytes = 0

    def read_range(self, version: int, name: str, start: int, end: int) -> bytes:
        data = super().read_range(version, name, start, end)
        type(self).read_bytes += len(data)
        return data

    def index_bytes(self, version: int) -> bytes:
        data = super().index_bytes(version)
        type(self).read_bytes += len(data)
        return data

    @contextlib.contextmanager
    def open_read(self, version: int, name: str) -> Iterator[BinaryIO]:
        with super().open_read(version, name) as fh:
            original = fh.read

            def read(size: int = -1) -> bytes:
                data = original(size)
                type(self).read_bytes += len(data)
                return data

            fh.read = read  # type: ignore[method-assign]
            yield fh


def wan_bytes(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    model = {f"layers.{i}.w": torch.randn(1024, 1024, generator=g) for i in range(args.tensors)}
    base = os.path.join(tmp, "base")
    os.makedirs(base)
    save_file(model, os.path.join(base, "model.safetensors"))
    trainer = VersionStore(os.path.join(tmp, "far"))
    publisher = ds.DeltaPublisher(trainer, base)
    publisher.seed()
    for step in range(1, args.versions + 1):
        for name in list(model)[step % 3 :: 3]:  # a third of the tensors, 1 % of their values
            flat = model[name].view(-1)
            flat[torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)] += 0.01
        publisher.publish(model.items(), full=step == 1)
    far = CountingStore(trainer.root)
    for version in far.versions():
        ds.pull_weights(os.path.join(tmp, "host"), far, version, base_dir=base)
    host = CountingStore.read_bytes
    CountingStore.read_bytes = 0
    ds.replicate(far, os.path.join(tmp, "replica"))
    replica = CountingStore.read_bytes
    across = args.hosts * host
    return {
        "versions": args.versions,
        "model_mb": round(args.tensors * 4 * 1024 * 1024 / 1e6, 1),
        "hosts": args.hosts,
        "one_host_bytes": host,
        "replica_bytes": replica,
        "wan_bytes_hosts_pull_across": across,
        "wan_bytes_one_replica": replica,
        "wan_saved_factor": round(across / replica, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="size of the full version (MB)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=64, help="far engine hosts")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=16, help="4 MB fp32 tensors (WAN part)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            print(json.dumps({"throughput": throughput(args, os.path.join(tmp, "t"))}))
        print(json.dumps({"wan": wan_bytes(args, os.path.join(tmp, "w"))}))


if __name__ == "__main__":
    main()
