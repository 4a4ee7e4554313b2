"""Pull speed against a reference-style in-place apply, in one process, on the same version.

    .venv/bin/python benchmarks/pull_speed.py                       # 168 MB bf16, 0.4 % density
    .venv/bin/python benchmarks/pull_speed.py --tensors 128 --elements 2097152 --workers 2
    .venv/bin/python benchmarks/pull_speed.py --profile             # cProfile of one pull

Builds a bf16 model, publishes one ``xor`` delta with the real :class:`DeltaPublisher` (every
tensor changed at ``--density`` of its elements), then times, best of ``--repeat``, from a host
copy of the base:

* **reference**: implemented here from ``docs/format.md`` the way the reference engine applies
  a version: for each payload, stream its zstd frame through 2 MB chunks, XOR each chunk into
  the mmap'd local file in place, hash the tensor's new bytes against the digest in the shard
  metadata, then msync + fsync every file. Tensors are shared among ``--workers`` threads.
* **deltastore**: ``pull_weights`` (read, decompress, apply in place, verify, durable) with the
  same ``--workers``.

Both end byte-exact (checked). Prints both times and the ratio deltastore / reference.

``--s3`` also measures a reseed through S3 (a moto server in this process): a full version is
published to it, then, best of ``--repeat``, ``s3fs.get`` of that version's files into a
fresh dir against ``pull_weights`` reseeding a fresh host from it (download, verify every
tensor, durable; also against ``s3fs.get(..., max_concurrency=1)``, one GET per file as the
reseed sends), and ``s3fs.put`` of those files to a new prefix against publishing the model
again as a full version (digests, shards, commit). Prints the ratios deltastore / s3fs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import cProfile
import json
import mmap
import os
import pstats
import shutil
import struct
import tempfile
import time

import numpy as np
import torch
import xxhash
import zstandard

# The synthetic model and its base checkpoint are catchup.py's (run from benchmarks/ as a script).
from catchup import build_model, write_base

from deltastore import DeltaPublisher, pull_weights
from deltastore.format.checkpoint import scan_checkpoint

CHUNK = 2 * 1024**2


def publish_step(store: str, base: str, model: dict[str, torch.Tensor], density: float) -> None:
    publisher = DeltaPublisher(store, base, encoding="xor")
    publisher.seed()
    rng = np.random.default_rng(1)
    changed = {}
    for name, tensor in model.items():
        raw = tensor.view(torch.uint16).clone().numpy()
        k = max(1, int(raw.size * density))
        where = rng.choice(raw.size, size=k, replace=False)
        raw[where] ^= rng.integers(1, 1 << 7, size=k, dtype=np.uint16)  # low mantissa bits
        changed[name] = torch.from_numpy(raw).view(torch.bfloat16)
    publisher.publish(changed.items())


# ------------------------------------------------------------- reference-style apply
def _shard_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return 8 + length, json.loads(fh.read(length))


def reference_apply(local: str, version_dir: str, workers: int) -> None:
    """Apply one ``xor`` version in place the reference way (see the module doc)."""
    tensors = scan_checkpoint(local)
    jobs = []
    for shard in sorted(os.listdir(version_dir)):
        if not shard.endswith(".safetensors"):
            continue
        path = os.path.join(version_dir, shard)
        data_start, header = _shard_header(path)
        digests = header.get("__metadata__", {})
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            jobs.append((name, path, data_start + begin, end - begin, digests[name]))
    maps: dict[str, tuple[int, mmap.mmap]] = {}
    for tensor in tensors.values():
        if tensor.file not in maps:
            fd = os.open(tensor.file, os.O_RDWR)
            maps[tensor.file] = (fd, mmap.mmap(fd, 0))

    def apply(job: tuple[str, str, int, int, str]) -> None:
        name, path, offset, length, digest = job
        target = tensors[name]
        with open(path, "rb") as fh:
            fh.seek(offset)
            frame = fh.read(length)
        view = np.frombuffer(
            maps[target.file][1], np.uint8, target.entry.nbytes, target.entry.start
        )
        reader = zstandard.ZstdDecompressor().stream_reader(frame)
        position = 0
        while chunk := reader.read(CHUNK):
            part = np.frombuffer(chunk, np.uint8)
            np.bitwise_xor(
                view[position : position + part.size],
                part,
                out=view[position : position + part.size],
            )
            position += part.size
        if position != target.entry.nbytes or xxhash.xxh3_128_hexdigest(view) != digest:
            raise SystemExit(f"reference apply: {name} does not verify")

    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(apply, jobs))
    for fd, mm in maps.values():
        mm.flush()
        os.fsync(fd)
        mm.close()
        os.close(fd)


def checkpoint_bytes(directory: str) -> dict[str, bytes]:
    out = {}
    for name, tensor in scan_checkpoint(directory).items():
        with open(tensor.file, "rb") as fh:
            fh.seek(tensor.entry.start)
            out[name] = fh.read(tensor.entry.nbytes)
    return out


def s3_reseed(work: str, base: str, model: dict[str, torch.Tensor], args: argparse.Namespace):
    """Best-of times of ``s3fs.get`` of a full version's files and of a reseed pull from it."""
    import fsspec

    from deltastore.testing.servers import start_moto_s3

    with start_moto_s3() as server:
        server.make_bucket("bench")
        options = server.storage_options
        url = "s3://bench/run"
        publisher = DeltaPublisher(url, base, storage_options=options)
        publisher.seed()
        publisher.publish(model.items(), full=True)
        fs, root = fsspec.core.url_to_fs(url, **options)
        files = [f for f in fs.find(root + "/weight_v000001") if f.endswith(".safetensors")]
        times: dict[str, list[float]] = {
            "s3fs.get": [],
            "s3fs.get one stream": [],
            "s3fs.get one stream + fsync": [],
            "deltastore": [],
            "s3fs.put": [],
            "deltastore publish": [],
        }
        local_copy = os.path.join(work, "s3copy")
        os.makedirs(local_copy)
        fs.get(files, local_copy + "/")
        local_files = sorted(os.path.join(local_copy, os.path.basename(f)) for f in files)
        for attempt in range(args.repeat):
            # A full version published again (diff, digests, shards, commit) against an upload
            # of the same files with s3fs alone.
            started = time.perf_counter()
            fs.put(local_files, f"{root}/put{attempt}/")
            times["s3fs.put"].append(time.perf_counter() - started)
            started = time.perf_counter()
            publisher.publish(model.items(), full=True)
            times["deltastore publish"].append(time.perf_counter() - started)
            target = os.path.join(work, f"s3get{attempt}")
            os.makedirs(target)
            started = time.perf_counter()
            fs.get(files, target + "/")
            times["s3fs.get"].append(time.perf_counter() - started)
            shutil.rmtree(target)
            os.makedirs(target)
            # One GET per file, as deltastore's reseed reads a shard (s3fs.get by default
            # fetches a file over 50 MiB in concurrent ranges after a GET that learns its size).
            started = time.perf_counter()
            fs.get(files, target + "/", max_concurrency=1)
            times["s3fs.get one stream"].append(time.perf_counter() - started)
            for name in os.listdir(target):  # durable, as the reseed's copy is
                fd = os.open(os.path.join(target, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            times["s3fs.get one stream + fsync"].append(time.perf_counter() - started)
            host = os.path.join(work, f"s3host{attempt}")
            started = time.perf_counter()
            pull_weights(host, url, 1, base, storage_options=options, workers=args.workers)
            times["deltastore"].append(time.perf_counter() - started)
            shutil.rmtree(target)
            shutil.rmtree(host)
        return {side: min(t) for side, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=84)
    parser.add_argument("--elements", type=int, default=1 << 20, help="bf16 elements per tensor")
    parser.add_argument("--density", type=float, default=0.004)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one pull")
    parser.add_argument("--s3", action="store_true", help="also a reseed through S3 (moto)")
    parser.add_argument("--workdir", help="scratch dir (default: a temp dir, removed after)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="deltastore-pullspeed-")
    try:
        base, store = os.path.join(work, "base"), os.path.join(work, "store")
        model = build_model(args.tensors, args.elements, 0)
        write_base(base, model)
        publish_step(store, base, model, args.density)
        size_mb = args.tensors * args.elements * 2 / 1e6
        print(f"model {size_mb:.0f} MB bf16, density {args.density:.2%}, workers {args.workers}")
        template = os.path.join(work, "host-v0")
        pull_weights(template, store, 0, base)
        times: dict[str, list[float]] = {"reference": [], "deltastore": []}
        for _ in range(args.repeat):
            for side in times:
                host = os.path.join(work, side)
                shutil.rmtree(host, ignore_errors=True)
                shutil.copytree(template, host)
            started = time.perf_counter()
            reference_apply(
                os.path.join(work, "reference"), os.path.join(store, "weight_v000001"), args.workers
            )
            times["reference"].append(time.perf_counter() - started)
            started = time.perf_counter()
            pull_weights(os.path.join(work, "deltastore"), store, 1, base, workers=args.workers)
            times["deltastore"].append(time.perf_counter() - started)
        ref, ours = (checkpoint_bytes(os.path.join(work, s)) for s in times)
        if ref != ours:
            raise SystemExit("reference and deltastore results differ")
        best = {side: min(t) for side, t in times.items()}
        print(f"reference  {best['reference']:.3f} s  ({size_mb / best['reference']:.0f} MB/s)")
        print(f"deltastore {best['deltastore']:.3f} s  ({size_mb / best['deltastore']:.0f} MB/s)")
        print(f"ratio deltastore / reference: {best['deltastore'] / best['reference']:.2f}x")
        if args.s3:
            best = s3_reseed(work, base, model, args)
            mb_s = {side: size_mb / t for side, t in best.items()}
            print(
                f"s3 reseed: s3fs.get {best['s3fs.get']:.3f} s ({mb_s['s3fs.get']:.0f} MB/s), "
                f"deltastore {best['deltastore']:.3f} s ({mb_s['deltastore']:.0f} MB/s)"
            )
            print(f"ratio deltastore / s3fs.get: {best['deltastore'] / best['s3fs.get']:.2f}x")
            for side in ("s3fs.get one stream", "s3fs.get one stream + fsync"):
                print(
                    f"{side} (max_concurrency=1) {best[side]:.3f} s ({mb_s[side]:.0f} MB/s); "
                    f"ratio deltastore / it: {best['deltastore'] / best[side]:.2f}x"
                )
            put, ours = best["s3fs.put"], best["deltastore publish"]
            print(
                f"s3 full publish: s3fs.put {put:.3f} s ({size_mb / put:.0f} MB/s), "
                f"deltastore {ours:.3f} s ({size_mb / ours:.0f} MB/s)"
            )
            print(f"ratio deltastore publish / s3fs.put: {ours / put:.2f}x")
        if args.profile:
            host = os.path.join(work, "profiled")
            shutil.rmtree(host, ignore_errors=True)
            shutil.copytree(template, host)
            profile = cProfile.Profile()
            profile.runcall(pull_weights, host, store, 1, base, workers=args.workers)
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
