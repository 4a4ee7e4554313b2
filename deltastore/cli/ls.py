"""``deltastore ls``: list the committed versions of a store.

A path that holds no store is an error (a typo must not read as an empty store). A version
whose index cannot be read is listed as ``corrupt`` with the reason, beside the healthy ones.
"""

from __future__ import annotations

import argparse
import sys

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    parse_storage_options,
    phase,
    print_json,
)
from deltastore.errors import DeltastoreError
from deltastore.storage import VersionStore
from deltastore.storage.listing import require_store


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ls",
        help="list committed versions",
        description=(
            "List committed versions. Exits 1 when URL holds no store; a version whose index "
            "is unreadable is listed as corrupt (exit 0, a warning on stderr)."
        ),
    )
    p.add_argument("url", help="store URL")
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def version_row(store: VersionStore, version: int) -> dict[str, object]:
    """version, kind, base_version, encoding, tensors, wire_bytes (and ``error`` when the
    index is unreadable: kind ``corrupt``, the other fields null)."""
    try:
        index = store.index(version)
        wire = index.totals.get("wire_bytes")
        if wire is None:  # a foreign publisher: count the shard files
            wire = sum(store.file_size(version, shard) for shard in index.shards())
    except DeltastoreError as exc:
        return {
            "version": version,
            "kind": "corrupt",
            "base_version": None,
            "encoding": None,
            "tensors": None,
            "wire_bytes": None,
            "error": str(exc),
        }
    return {
        "version": version,
        "kind": index.kind,
        "base_version": index.base_version,
        "encoding": index.encoding,
        "tensors": len(index.weight_map),
        "wire_bytes": wire,
    }


def list_versions(store: VersionStore) -> list[dict[str, object]]:
    """One row per committed version (see :func:`version_row`); raises :class:`ConfigError`
    when the URL holds no store."""
    listing = store.listing()
    require_store(store, listing)
    return [version_row(store, version) for version in listing.committed]


def run(args: argparse.Namespace) -> int:
    store = VersionStore(args.url, parse_storage_options(args.storage_option))
    store.refresh()
    with phase(args, f"listing {store.url}"):
        rows = list_versions(store)
    corrupt = [row for row in rows if row["kind"] == "corrupt"]
    for row in corrupt:
        print(
            f"deltastore ls: warning: weight_v{row['version']:06d}: {row['error']}", file=sys.stderr
        )
    if args.json:
        print_json({"url": store.url, "versions": rows})
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{store.url}: {len(rows)} committed version(s)")
    for column in ("version", "kind", "base version", "encoding", "tensors", "wire bytes"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    for row in rows:
        if row["kind"] == "corrupt":
            table.add_row(f"{row['version']:06d}", "corrupt index", "-", "-", "-", "-")
            continue
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
