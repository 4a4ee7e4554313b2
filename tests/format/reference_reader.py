"""A reader of published versions written from the format description alone (docs/format.md).

It does what the reference engine's ``/pull_weights`` does to a host-local checkpoint, using
only json, safetensors ``safe_open``, zstandard, numpy and the digest libraries: no deltastore
import, so it cannot share a bug with deltastore's own reader. Tests use it to show that what
deltastore publishes is applied correctly by an independent implementation of the format.

The facts it relies on (all from the format document):

* ``<source>/weight_v{N:06d}/model.safetensors.index.json`` publishes version N:
  ``{"metadata": {...}, "weight_map": {name: shard_file}}``; metadata ``version`` and
  ``base_version`` are 6-digit strings, ``delta_encoding`` is ``xor`` or ``overwrite``,
  ``compression_format`` is ``zstd``, ``checksum_format`` one of xxh3-128, blake3, adler32.
* A version without ``delta_encoding`` is an ordinary full HF checkpoint, copied as-is.
* Each delta shard entry is a 1-D U8 tensor holding one zstd frame of the tensor's payload;
  the shard's ``__metadata__`` maps each name to the hex digest of its new full bytes.
* Payloads are the tensor's raw bytes: ``xor`` is ``new ^ old``; ``overwrite`` is
  ``u32le count ‖ u32le positions[count] ‖ u8 values[count]``.
* Offsets and sizes come from the local checkpoint's own safetensors headers.
* ``<local>/.weight_sync/state.json`` is ``{"version": "000007"}``, replaced atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import blake3
import numpy as np
import xxhash
import zstandard
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


class ReferenceReaderError(Exception):
    """The reference reader refused a version (the engine would answer success: false)."""


def digest(algorithm: str, data: bytes) -> str:
    """The reference hex form of a digest."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(data)
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(data):08x}"
    raise ReferenceReaderError(f"unknown checksum_format {algorithm!r}")


def version_dir(source_dir: str, version: int) -> str:
    return os.path.join(source_dir, f"weight_v{version:06d}")


def read_index(source_dir: str, version: int) -> dict:
    with open(os.path.join(version_dir(source_dir, version), INDEX), encoding="utf-8") as fh:
        return json.load(fh)


def read_state(local_dir: str) -> int | None:
    """The applied version of a local checkpoint, or None when it records none."""
    try:
        with open(os.path.join(local_dir, ".weight_sync", "state.json"), encoding="utf-8") as fh:
            return int(json.load(fh)["version"])
    except FileNotFoundError:
        return None


def write_state(local_dir: str, version: int) -> None:
    state_dir = os.path.join(local_dir, ".weight_sync")
    os.makedirs(state_dir, exist_ok=True)
    tmp = os.path.join(state_dir, "state.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"version": f"{version:06d}"}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(state_dir, "state.json"))


def local_layout(local_dir: str) -> dict[str, tuple[str, int, int]]:
    """Tensor name → (file, absolute start, absolute end) from the local safetensors headers."""
    layout: dict[str, tuple[str, int, int]] = {}
    for name in sorted(os.listdir(local_dir)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(local_dir, name)
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for tensor, spec in header.items():
            if tensor == "__metadata__":
                continue
            start, end = spec["data_offsets"]
            layout[tensor] = (path, 8 + length + start, 8 + length + end)
    return layout


def replace_weights(local_dir: str, from_dir: str) -> None:
    """Make ``local_dir`` hold a copy of the checkpoint in ``from_dir`` (weights and index)."""
    os.makedirs(local_dir, exist_ok=True)
    for name in os.listdir(local_dir):
        if name.endswith(".safetensors") or name == INDEX:
            os.unlink(os.path.join(local_dir, name))
    for name in os.listdir(from_dir):
        if name.endswith(".safetensors") or name == INDEX:
            shutil.copyfile(os.path.join(from_dir, name), os.path.join(local_dir, name))


def apply_payload(encoding: str, old: np.ndarray, payload: bytes) -> np.ndarray:
    """The new bytes of a tensor from its old bytes and a decompressed payload."""
    if encoding == "xor":
        delta = np.frombuffer(payload, dtype=np.uint8)
        if delta.size != old.size:
            raise ReferenceReaderError("xor payload size differs from the tensor size")
        return np.bitwise_xor(old, delta)
    if encoding == "overwrite":
        (count,) = struct.unpack_from("<I", payload, 0)
        if len(payload) != 4 + 5 * count:
            raise ReferenceReaderError("overwrite payload has the wrong length")
        positions = np.frombuffer(payload, dtype="<u4", count=count, offset=4)
        values = np.frombuffer(payload, dtype=np.uint8, count=count, offset=4 + 4 * count)
        if count and int(positions.max()) >= old.size:
            raise ReferenceReaderError("overwrite position outside the tensor")
        new = old.copy()
        new[positions] = values
        return new
    raise ReferenceReaderError(f"unknown delta_encoding {encoding!r}")


def apply_delta(local_dir: str, source_dir: str, version: int, index: dict) -> None:
    """Apply one delta version in place, verifying each tensor before writing it."""
    metadata = index["metadata"]
    applied = read_state(local_dir)
    if int(metadata["base_version"]) != applied:
        raise ReferenceReaderError(
            f"weight_v{version:06d} builds on {metadata['base_version']}, local is at {applied}"
        )
    if metadata.get("compression_format") != "zstd":
        raise ReferenceReaderError("compression_format must be zstd")
    encoding, algorithm = metadata["delta_encoding"], metadata["checksum_format"]
    layout = local_layout(local_dir)
    decompressor = zstandard.ZstdDecompressor()
    updates: list[tuple[str, int, bytes]] = []
    seen: set[str] = set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(version_dir(source_dir, version), shard), "numpy") as fh:
            digests = fh.metadata() or {}
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                if index["weight_map"].get(name) != shard:
                    raise ReferenceReaderError(f"{shard} holds {name}, not mapped to it")
                if name not in layout:
                    raise ReferenceReaderError(f"{name} is not in the local checkpoint")
                seen.add(name)
                path, start, end = layout[name]
                frame = fh.get_tensor(name).tobytes()
                payload = decompressor.decompress(frame)
                with open(path, "rb") as local:
                    local.seek(start)
                    old = np.frombuffer(local.read(end - start), dtype=np.uint8)
                new = apply_payload(encoding, old, payload).tobytes()
                if digest(algorithm, new) != digests.get(name):
                    raise ReferenceReaderError(f"{name}: digest mismatch in weight_v{version:06d}")
                updates.append((path, start, new))
    if seen != set(index["weight_map"]):
        raise ReferenceReaderError(f"shards lack {sorted(set(index['weight_map']) - seen)}")
    for path, start, new in updates:
        with open(path, "r+b") as local:
            local.seek(start)
            local.write(new)
            local.flush()
            os.fsync(local.fileno())


def pull(local_dir: str, source_dir: str, target: int, base_dir: str) -> None:
    """Bring ``local_dir`` to version ``target``, as the reference ``/pull_weights`` does.

    A checkpoint with no state (or one ahead of the target) is seeded from ``base_dir``; the
    newest full version at or below the target, above what is applied, is copied; the
    remaining deltas apply one version at a time.
    """
    applied = read_state(local_dir)
    if applied is None or applied > target:
        replace_weights(local_dir, base_dir)
        write_state(local_dir, 0)
        applied = 0
    indexes = {v: read_index(source_dir, v) for v in range(applied + 1, target + 1)}
    full = [v for v, idx in indexes.items() if "delta_encoding" not in idx["metadata"]]
    if full:
        replace_weights(local_dir, version_dir(source_dir, full[-1]))
        write_state(local_dir, full[-1])
        applied = full[-1]
    for version in range(applied + 1, target + 1):
        apply_delta(local_dir, source_dir, version, indexes[version])
        write_state(local_dir, version)
