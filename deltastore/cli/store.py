"""``deltastore ls``, ``inspect`` and ``prune``: the committed versions of a store; one
version's tensors or the history of the run (drawn with ``--plot``); unpublishing old versions
and deleting garbage. A path that holds no store is an error (a typo must not read as an empty
store); a version whose index cannot be read is listed as ``corrupt``, beside the healthy ones.
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from deltastore.cli.common import (
    Subparsers,
    add_command,
    byte_progress,
    emit,
    fields,
    open_store,
    parse_target,
    phase,
    print_json,
)
from deltastore.codecs import get_encoding
from deltastore.codecs.compression import decompress
from deltastore.errors import ConfigError, DeltastoreError, VersionNotFoundError
from deltastore.format.checkpoint import scan_checkpoint
from deltastore.format.safetensors_io import TensorEntry
from deltastore.pull.source import PullSource
from deltastore.storage import VersionStore
from deltastore.storage.prune import check_prune_args
from deltastore.storage.store import require_store


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "ls",
        run_ls,
        "list committed versions",
        "List committed versions. Exits 1 when URL holds no store; a version whose index "
        "is unreadable is listed as corrupt (exit 0, a warning on stderr).",
    )
    p.add_argument("url", help="store URL")
    p = add_command(
        sub,
        "inspect",
        run_inspect,
        "show a version's tensors (real dtype/shape, density, wire bytes) or the history",
        "Show a version's index metadata and, per tensor, its payload bytes, digest and "
        "density; with --base, each tensor's real dtype and shape from the checkpoint's "
        "header. --history lists every version's wire bytes and density instead. --plot "
        "FILE.png draws either (needs the 'plot' extra: matplotlib).",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("version", nargs="?", type=parse_target, help="version number or 'latest'")
    p.add_argument("--history", action="store_true", help="every version, not one")
    p.add_argument("--base", metavar="DIR", help="base or local checkpoint (real dtype/shape)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the result into a PNG")
    _add_prune(sub)


def _add_prune(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "prune",
        run_prune,
        "remove old versions and garbage (dry run unless --yes)",
        "Keep the newest N committed versions and every version needed to rebuild them (a "
        "chain back to a full version or the base); unpublish the others, then delete "
        "their data once they have been unpublished for the grace period. Uncommitted "
        "leftovers older than the grace period are fenced, then deleted. Prints what would "
        "happen unless --yes is given.",
    )
    p.add_argument("url", help="store URL (a directory, s3://, gs://, memory://)")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="versions to keep (>= 1)")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="seconds an unpublished or uncommitted version waits before its data goes "
        "(default 3600: longer than any pull or publish)",
    )
    p.add_argument("--yes", action="store_true", help="really change the store")


def version_row(store: VersionStore, version: int, density: bool) -> dict[str, object]:
    """version, kind, base_version, encoding, tensors, wire_bytes, with ``density``: changed /
    total bytes from the index totals (and ``error`` when the index is unreadable: kind
    ``corrupt``, the other fields null)."""
    extra: dict[str, object] = {"density": None} if density else {}
    try:
        index = store.index(version)
        wire = index.totals.get("wire_bytes")
        if wire is None:  # a foreign publisher: count the shard files
            wire = sum(store.file_size(version, shard) for shard in index.shards())
    except DeltastoreError as exc:
        unknown = dict.fromkeys(("base_version", "encoding", "tensors", "wire_bytes"))
        return {"version": version, "kind": "corrupt", **unknown, "error": str(exc), **extra}
    known = {"version": version, **fields(index, "kind base_version encoding")}
    if density and index.totals.get("total_bytes"):
        extra["density"] = index.totals.get("changed_bytes", 0) / index.totals["total_bytes"]
    return {**known, "tensors": len(index.weight_map), "wire_bytes": wire, **extra}


def list_versions(store: VersionStore, *, density: bool = False) -> list[dict[str, object]]:
    """One row per committed version; :class:`ConfigError` when the URL holds no store."""
    listing = store.listing()
    require_store(store, listing)
    return [version_row(store, version, density) for version in listing.committed]


def run_ls(args: argparse.Namespace) -> int:
    store = open_store(args, args.url)
    store.refresh()
    with phase(args, f"listing {store.url}"):
        rows = list_versions(store)
    for row in (row for row in rows if row["kind"] == "corrupt"):
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


def tensor_density(
    store: VersionStore,
    version: int,
    shard: str,
    entry: TensorEntry,
    encoding: str | None,
    size: int | None,
) -> float | None:
    """Changed bytes / tensor bytes of one payload (None when the tensor size is unknown:
    a payload other than ``xor`` without --base, or a full version)."""
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
    names = "kind base_version encoding compression checksum stream_id totals"
    return {"version": version, **fields(index, names), "shards": shards}


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


def run_inspect(args: argparse.Namespace) -> int:
    store = open_store(args, args.url)
    if args.history == (args.version is not None):
        raise ConfigError("give a VERSION (a number or 'latest') or --history, not both")
    if args.history:
        store.refresh()
        with phase(args, f"reading the indexes of {store.url}"):
            rows = list_versions(store, density=True)
        info: dict[str, object] = {"url": store.url, "versions": rows}
        title = store.url
    else:
        version = PullSource(store).resolve_target(args.version)
        store.refresh(version)
        with phase(args, f"reading weight_v{version:06d}"):
            try:
                info = describe(store, version, args.base)
            except VersionNotFoundError:
                require_store(store)  # a mistyped URL, not a pruned version
                raise
        title = f"{store.url} weight_v{version:06d}"
    if args.plot:
        if args.history:
            figure = history_figure(rows, title=title)
        else:
            figure = version_figure(info, title=title)
        figure.savefig(args.plot, dpi=100)
        _pyplot().close(figure)
        print(f"wrote {args.plot}", file=sys.stderr)  # stderr: --json keeps stdout clean
    if args.json:
        print_json(info)
    elif args.history:
        _print_history(store.url, rows)
    else:
        _print_version(info)
    return 0


def run_prune(args: argparse.Namespace) -> int:
    check_prune_args(args.keep, args.grace)  # a bad argument is named before the store is read
    store = open_store(args, args.url)
    require_store(store)
    what = f"pruning {store.url}" + ("" if args.yes else " (dry run)")
    with byte_progress(args, what) as progress:
        report = store.prune(
            keep=args.keep, grace_s=args.grace, dry_run=not args.yes, progress=progress
        )
    mode = "dry run" if report.dry_run else "pruned"
    text = [f"{store.url} ({mode}, keep {args.keep}):", *(f"  {line}" for line in report.lines())]
    if report.dry_run and report.changes:
        text.append("nothing was changed; run again with --yes to apply")
    payload = {"url": store.url, **asdict(report), "lines": report.lines()}
    return emit(args, payload, "\n".join(text))


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib  # ImportError → the CLI's one-line hint to install the 'plot' extra

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def version_figure(info: dict[str, object], *, title: str):  # type: ignore[no-untyped-def]
    """Per tensor of one version: density (%) and wire bytes, as two bar charts."""
    plt = _pyplot()
    names, density, wire = [], [], []
    for tensors in dict(info["shards"]).values():  # type: ignore[call-overload]
        for name, entry in tensors.items():
            names.append(name)
            density.append(100 * (entry["density"] or 0.0))
            wire.append(entry["bytes"])
    height = max(4.0, 0.25 * len(names) + 2)
    fig, (ax_density, ax_wire) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    ax_density.barh(names, density, color="tab:blue")
    ax_density.set_xlabel("density (% of the tensor's bytes changed)")
    ax_density.invert_yaxis()
    ax_wire.barh(names, wire, color="tab:orange")
    ax_wire.set_xlabel("wire bytes (compressed payload)")
    fig.suptitle(f"{title}: {info['kind']}, {info['encoding']}")
    fig.tight_layout()
    return fig


def history_figure(rows: Sequence[dict[str, object]], *, title: str):  # type: ignore[no-untyped-def]
    """Per version: wire bytes (bars; full versions marked) and density (line)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    healthy = [r for r in rows if r["kind"] != "corrupt"]
    versions = [int(r["version"]) for r in healthy]  # type: ignore[call-overload]
    wire_mb = [int(r["wire_bytes"]) / 1e6 for r in healthy]  # type: ignore[call-overload]
    colors = ["tab:red" if r["kind"] == "full" else "tab:blue" for r in healthy]
    fig, ax_wire = plt.subplots(figsize=(10, 4.5))
    ax_wire.bar(versions, wire_mb, color=colors)
    ax_wire.set_xlabel("version")
    ax_wire.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole numbers
    ax_wire.set_ylabel("wire MB (bars; red = full version)")
    ax_density = ax_wire.twinx()
    points = [
        (v, 100 * float(r["density"]))  # type: ignore[arg-type]
        for v, r in zip(versions, healthy)
        if r["density"] is not None
    ]
    if points:
        xs, ys = zip(*points)
        ax_density.plot(xs, ys, color="black", marker="o")
    ax_density.set_ylabel("density % (line)")
    ax_density.set_ylim(0, 2.2 * max((y for _, y in points), default=1.0))  # below the labels
    positive = [w for w in wire_mb if w > 0]
    if positive and max(positive) > 20 * min(positive):  # a full version next to deltas
        ax_wire.set_yscale("log")
        ax_wire.set_ylabel("wire MB, log scale (bars; red = full version)")
        ax_wire.set_ylim(top=4 * max(positive))  # room for the labels
    elif positive:
        ax_wire.set_ylim(0, 1.2 * max(positive))
    for row, version, wire in zip(healthy, versions, wire_mb):
        label = f"full\n{wire:.3g}" if row["kind"] == "full" else f"{wire:.3g}"
        ax_wire.annotate(
            label,
            (version, wire),
            textcoords="offset points",
            xytext=(0, 2),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_wire.set_title(f"{title}: {len(healthy)} version(s)")
    fig.tight_layout()
    return fig
