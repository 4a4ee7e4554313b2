"""``deltastore ls``: list the committed versions of a store."""

from __future__ import annotations

import argparse
import json

from deltastore.cli import add_storage_option_flag, parse_storage_options
from deltastore.storage import VersionStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list committed versions", description="List committed versions.")
    p.add_argument("url", help="store URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def list_versions(store: VersionStore) -> list[dict[str, object]]:
    """One row per committed version: version, kind, base_version, encoding, tensors, wire_bytes."""
    rows = []
    for version in store.versions():
        index = store.index(version)
        wire = index.totals.get("wire_bytes")
        if wire is None:  # a foreign publisher: count the shard files
            wire = sum(store.file_size(version, shard) for shard in index.shards())
        rows.append(
            {
                "version": version,
                "kind": index.kind,
                "base_version": index.base_version,
                "encoding": index.encoding,
                "tensors": len(index.weight_map),
                "wire_bytes": wire,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    store = VersionStore(args.url, parse_storage_options(args.storage_option))
    store.refresh()
    rows = list_versions(store)
    if args.json:
        print(json.dumps({"versions": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{store.url}: {len(rows)} committed version(s)")
    for column in ("version", "kind", "base version", "encoding", "tensors", "wire bytes"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    for row in rows:
        table.add_row(
            f"{row['version']:06d}",
            str(row["kind"]),
            "-" if row["base_version"] is None else f"{row['base_version']:06d}",
            str(row["encoding"] or "-"),
            str(row["tensors"]),
            f"{row['wire_bytes']:,}",
        )
    Console().print(table)
    return 0
