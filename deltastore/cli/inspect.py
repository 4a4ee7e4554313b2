"""``deltastore inspect``: one version's index metadata and per-tensor payloads, or the
history of the whole run (``--history``); ``--plot FILE.png`` draws either."""

from __future__ import annotations

import argparse
import struct
import sys

import numpy as np

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    parse_storage_options,
    phase,
    print_json,
)
from deltastore.cli.ls import list_versions
from deltastore.cli.pull import parse_target, resolve_target
from deltastore.codecs import get_encoding
from deltastore.codecs.compression import decompress
from deltastore.errors import ConfigError, VersionNotFoundError
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.storage import VersionStore
from deltastore.storage.listing import require_store


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a version's tensors (real dtype/shape, density, wire bytes) or the history",
        description=(
            "Show a version's index metadata and, per tensor, its payload bytes, digest and "
            "density; with --base, each tensor's real dtype and shape from the checkpoint's "
            "header. --history lists every version's wire bytes and density instead. --plot "
            "FILE.png draws either (needs the 'plot' extra: matplotlib)."
        ),
    )
    p.add_argument("url", help="store URL")
    p.add_argument("version", nargs="?", type=parse_target, help="version number or 'latest'")
    p.add_argument("--history", action="store_true", help="every version, not one")
    p.add_argument("--base", metavar="DIR", help="base or local checkpoint (real dtype/shape)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the result into a PNG")
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def tensor_density(
    store: VersionStore,
    version: int,
    shard: str,
    entry: object,
    encoding: str | None,
    size: int | None,
) -> float | None:
    """Changed bytes / tensor bytes of one payload (None when the tensor size is unknown:
    a payload other than ``xor`` without --base, or a full version)."""
    from deltastore.format.safetensors_io import TensorEntry

    assert isinstance(entry, TensorEntry)
    if encoding is None or (encoding not in ("xor", "overwrite") and size is None):
        return None
    frame = store.read_range(version, shard, entry.start, entry.end)
    what = f"payload of {entry.name!r}"
    if encoding == "overwrite":
        raw = decompress(frame, max_size=4 + 5 * size if size is not None else 1 << 40, what=what)
        (count,) = struct.unpack_from("<I", raw[:4]) if len(raw) >= 4 else (0,)
        return count / size if size else None
    if encoding == "xor":
        raw = decompress(frame, max_size=size if size is not None else 1 << 40, what=what)
        return int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8))) / len(raw) if raw else 0.0
    # Any other self-inverse encoding (auto, sparse-v2): applied to zeros, the payload leaves
    # exactly the changed bytes non-zero (each holds old ^ new).
    assert size is not None
    codec = get_encoding(encoding)
    if not codec.self_inverse or not size:
        return None
    raw = decompress(frame, max_size=codec.max_payload_size(size), what=what)
    changed = np.zeros(size, dtype=np.uint8)
    codec.apply(changed, memoryview(raw), tensor=entry.name)
    return int(np.count_nonzero(changed)) / size


def describe(store: VersionStore, version: int, base_dir: str | None = None) -> dict[str, object]:
    """Index metadata plus, per shard, each tensor's stored dtype, shape, bytes, digest,
    density and (with ``base_dir``) its real dtype and shape."""
    index = store.index(version)
    real = scan_checkpoint(base_dir) if base_dir else {}
    encoding = index.encoding if index.kind == "delta" else None
    shards = {}
    for shard in index.shards():
        header = store.read_shard_header(version, shard)
        tensors = {}
        for name, entry in header.tensors.items():
            model = real.get(name)
            size = model.entry.nbytes if model else None
            tensors[name] = {
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "bytes": entry.nbytes,
                "digest": header.metadata.get(name),
                "density": tensor_density(store, version, shard, entry, encoding, size),
                "model_dtype": model.entry.dtype if model else None,
                "model_shape": list(model.entry.shape) if model else None,
            }
        shards[shard] = tensors
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


def history(store: VersionStore) -> list[dict[str, object]]:
    """Per committed version: the ``ls`` row plus density from the index totals."""
    rows = list_versions(store)
    for row in rows:
        row["density"] = None
        if row["kind"] == "corrupt":
            continue
        totals = store.index(int(row["version"])).totals  # type: ignore[call-overload]
        if totals.get("total_bytes"):
            row["density"] = totals.get("changed_bytes", 0) / totals["total_bytes"]
    return rows


def _print_version(info: dict[str, object]) -> None:
    print(
        f"weight_v{info['version']:06d} ({info['kind']}) base={info['base_version']} "
        f"encoding={info['encoding']} checksum={info['checksum']} stream={info['stream_id']}"
    )
    for key, value in dict(info["totals"]).items():  # type: ignore[call-overload]
        print(f"  {key}: {value:,}")
    for shard, tensors in dict(info["shards"]).items():  # type: ignore[call-overload]
        print(f"  {shard}: {len(tensors)} tensors")
        for name, entry in tensors.items():
            model = f"{entry['model_dtype']}{entry['model_shape']}" if entry["model_dtype"] else "?"
            density = "-" if entry["density"] is None else f"{entry['density']:.4%}"
            print(
                f"    {name}: {model} density {density}, {entry['bytes']:,} wire bytes "
                f"(stored {entry['dtype']}{entry['shape']}) digest {entry['digest']}"
            )


def _print_history(url: str, rows: list[dict[str, object]]) -> None:
    print(f"{url}: {len(rows)} committed version(s)")
    for row in rows:
        if row["kind"] == "corrupt":
            print(f"  {row['version']:06d} corrupt index: {row['error']}")
            continue
        density = "-" if row["density"] is None else f"{row['density']:.4%}"
        print(
            f"  {row['version']:06d} {row['kind']:<6} density {density:>9} "
            f"{row['wire_bytes']:>14,} wire bytes"
        )


def run(args: argparse.Namespace) -> int:
    store = VersionStore(args.url, parse_storage_options(args.storage_option))
    if args.history == (args.version is not None):
        raise ConfigError("give a VERSION (a number or 'latest') or --history, not both")
    if args.history:
        store.refresh()
        with phase(args, f"reading the indexes of {store.url}"):
            rows = history(store)
        if args.plot:
            from deltastore.cli.plots import plot_history

            plot_history(rows, args.plot, title=store.url)
            print(f"wrote {args.plot}", file=sys.stderr)  # stderr: --json keeps stdout clean
        if args.json:
            print_json({"url": store.url, "versions": rows})
        else:
            _print_history(store.url, rows)
        return 0
    version = resolve_target(store, args.version)
    store.refresh(version)
    with phase(args, f"reading weight_v{version:06d}"):
        try:
            info = describe(store, version, args.base)
        except VersionNotFoundError:
            require_store(store)  # a mistyped URL, not a pruned version
            raise
    if args.plot:
        from deltastore.cli.plots import plot_version

        plot_version(info, args.plot, title=f"{store.url} weight_v{version:06d}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print_json(info)
    else:
        _print_version(info)
    return 0
