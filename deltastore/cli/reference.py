"""A reference-style delta writer and reader, built from docs/format.md: the baseline of every
``deltastore bench`` ratio. Write: per tensor (a pool task each, at most ``2 * workers`` in
flight), XOR with the snapshot, skip it if unchanged, zstd-1, xxh3-128 of the new bytes, the
snapshot updated; one fsynced safetensors shard of U8 payloads. Read: each frame decompressed
and XORed in place into a writable map of the host's file, its digest checked, the map flushed
once (or, as the upstream engine readers do, not at all). No index, commit protocol or
lineage: the work a delta costs, nothing more.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import mmap
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from deltastore.codecs import ByteArray
from deltastore.codecs.compression import compress, decompress

Frame = tuple[str, bytes, str]
"""(tensor name, zstd-1 frame of new XOR old, xxh3-128 hex of new)."""


@dataclass
class Phases:
    """Seconds per phase, summed over worker threads."""

    seconds: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **spent: float) -> None:
        with self.lock:
            for key, value in spent.items():
                self.seconds[key] = self.seconds.get(key, 0.0) + value


def _encode_one(name: str, old: ByteArray, new: ByteArray, phases: Phases) -> Frame | None:
    t0 = time.perf_counter()
    delta = np.bitwise_xor(old, new)
    changed = bool(delta.any())
    t1 = time.perf_counter()
    if not changed:
        phases.add(diff_s=t1 - t0)
        return None
    frame = compress(memoryview(delta))
    t2 = time.perf_counter()
    digest = xxhash.xxh3_128_hexdigest(memoryview(new))
    t3 = time.perf_counter()
    np.copyto(old, new)  # the writer's snapshot moves to what it published
    phases.add(
        diff_s=t1 - t0, compress_s=t2 - t1, checksum_s=t3 - t2, snapshot_s=time.perf_counter() - t3
    )
    return name, frame, digest


def reference_publish(
    snapshot: dict[str, ByteArray],
    tensors: Iterable[tuple[str, ByteArray]],
    path: str,
    workers: int,
) -> tuple[int, Phases]:
    """Write one delta shard of ``tensors`` against ``snapshot`` to ``path``; (bytes, phases)."""
    phases = Phases()
    frames: list[Frame | None] = []
    pending: deque[cf.Future[Frame | None]] = deque()
    with cf.ThreadPoolExecutor(workers) as pool:
        for name, new in tensors:
            pending.append(pool.submit(_encode_one, name, snapshot[name], new, phases))
            if len(pending) >= 2 * workers:
                frames.append(pending.popleft().result())
        frames += [future.result() for future in pending]
    t0 = time.perf_counter()
    size = _write_shard(path, [frame for frame in frames if frame is not None])
    phases.add(write_s=time.perf_counter() - t0)
    return size, phases


def _write_shard(path: str, frames: list[Frame]) -> int:
    header: dict[str, object] = {"__metadata__": {n: d for n, _, d in frames}}
    offset = 0
    for name, frame, _ in frames:
        header[name] = {
            "dtype": "U8",
            "shape": [len(frame)],
            "data_offsets": [offset, offset + len(frame)],
        }
        offset += len(frame)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for _, frame, _ in frames:
            fh.write(frame)
        fh.flush()
        os.fsync(fh.fileno())
    return 8 + len(raw) + offset


def reference_pull(shard: str, host_file: str, workers: int, *, flush: bool = True) -> Phases:
    """Apply the delta shard at ``shard`` in place to the safetensors file ``host_file``;
    ``flush=False`` skips the final msync, as the upstream engine readers do."""
    phases = Phases()
    t0 = time.perf_counter()
    with open(shard, "rb") as shard_file:
        data = shard_file.read()
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    digests = header.pop("__metadata__")
    phases.add(read_s=time.perf_counter() - t0)
    with open(host_file, "r+b") as fh:
        (host_hlen,) = struct.unpack("<Q", fh.read(8))
        host_header = json.loads(fh.read(host_hlen))
        mapped = mmap.mmap(fh.fileno(), 0)
    host_body = np.frombuffer(mapped, dtype=np.uint8)[8 + host_hlen :]

    def apply(name: str) -> None:
        a, b = header[name]["data_offsets"]
        lo, hi = host_header[name]["data_offsets"]
        t1 = time.perf_counter()
        frame = data[8 + hlen + a : 8 + hlen + b]
        delta = np.frombuffer(decompress(frame, max_size=hi - lo, what=name), np.uint8)
        t2 = time.perf_counter()
        target = host_body[lo:hi]
        np.bitwise_xor(target, delta, out=target)
        t3 = time.perf_counter()
        ok = xxhash.xxh3_128_hexdigest(memoryview(target)) == digests[name]
        phases.add(decompress_s=t2 - t1, apply_s=t3 - t2, verify_s=time.perf_counter() - t3)
        if not ok:
            raise RuntimeError(f"reference pull: tensor {name!r} does not match its digest")

    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(apply, list(header)))
    if flush:
        t4 = time.perf_counter()
        mapped.flush()  # the map is closed when the last view of it goes
        phases.add(durable_s=time.perf_counter() - t4)
    return phases
