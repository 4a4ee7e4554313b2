"""``deltastore inspect``: show one version's index metadata and per-tensor payloads."""

from __future__ import annotations

import argparse
import json

from deltastore.cli import add_storage_option_flag, parse_storage_options
from deltastore.storage import VersionStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a version's metadata, shards and per-tensor payload sizes and digests",
        description="Show a version's index metadata, its shards and per-tensor entries.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("version", type=int, help="version number")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def describe(store: VersionStore, version: int) -> dict[str, object]:
    """Index metadata plus, per shard, each tensor's stored dtype, shape, bytes and digest."""
    index = store.index(version)
    shards = {}
    for shard in index.shards():
        header = store.read_shard_header(version, shard)
        shards[shard] = {
            name: {
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "bytes": entry.nbytes,
                "digest": header.metadata.get(name),
            }
            for name, entry in header.tensors.items()
        }
    return {
        "version": version,
        "kind": index.kind,
        "base_version": index.base_version,
        "encoding": index.encoding,
        "compression": index.compression,
        "checksum": index.checksum,
        "stream_id": index.stream_id,
        "totals": index.totals,
        "shards": shards,
    }


def run(args: argparse.Namespace) -> int:
    store = VersionStore(args.url, parse_storage_options(args.storage_option))
    store.refresh(args.version)
    info = describe(store, args.version)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"weight_v{args.version:06d} ({info['kind']}) base={info['base_version']} "
        f"encoding={info['encoding']} checksum={info['checksum']} stream={info['stream_id']}"
    )
    for key, value in dict(info["totals"]).items():  # type: ignore[call-overload]
        print(f"  {key}: {value:,}")
    for shard, tensors in dict(info["shards"]).items():  # type: ignore[call-overload]
        print(f"  {shard}: {len(tensors)} tensors")
        for name, entry in tensors.items():
            shape = f"{entry['dtype']}{entry['shape']}"
            print(f"    {name}: {entry['bytes']:,} bytes {shape} digest {entry['digest']}")
    return 0
