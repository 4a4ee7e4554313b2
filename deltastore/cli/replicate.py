"""``deltastore replicate SRC DST``: copy committed versions into a replica, in order."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from deltastore.cli.common import Subparsers, add_command, parse_storage_options
from deltastore.replicate import (
    Observer,
    ReplicationPolicy,
    ReplicationReport,
    VersionCopy,
    replicate,
)


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "replicate",
        run,
        "copy committed versions from one store into a replica, in order",
        "Copy every committed version of SRC that DST lacks, oldest first, each through "
        "DST's version-writing transaction (files first, the index last, create-only): a "
        "reader of DST only ever sees whole versions, in order, with SRC's lineage and "
        "stream id. Each file's size is checked; --verify also recomputes tensor digests "
        "and reads every copied file back.",
        json="one JSON line per version, and a summary",
        storage=False,
    )
    p.add_argument("src", help="source store URL (a directory, s3://, gs://)")
    p.add_argument("dst", help="destination store URL (the replica)")
    p.add_argument("--verify", action="store_true", help="check digests and read copies back")
    p.add_argument(
        "--from",
        dest="from_version",
        type=int,
        metavar="N",
        help="a new replica starts at the newest full version <= N (older deltas skipped)",
    )
    p.add_argument("--jobs", type=int, default=4, metavar="K", help="transfers in flight")
    p.add_argument("--follow", action="store_true", help="keep copying new versions")
    p.add_argument(
        "--prune-like-source",
        action="store_true",
        help="unpublish replica versions SRC no longer lists (the replica's prune rules)",
    )
    for flag, default, what in (
        (
            "--prune-grace",
            3600,
            "data of a version unpublished by --prune-like-source stays this long (3600)",
        ),
        (
            "--stale-claim",
            60,
            "a replica claim idle this long belongs to a dead replicator: resume it (60)",
        ),
        (
            "--poll-max",
            30,
            "--follow: longest wait between two looks at SRC (30; the wait "
            "starts at 1 s, jittered, and doubles while nothing is new)",
        ),
    ):
        p.add_argument(flag, type=float, default=float(default), metavar="SECONDS", help=what)
    for side in ("src", "dst"):
        p.add_argument(
            f"--{side}-option",
            action="append",
            metavar="KEY=VALUE",
            help=f"fsspec storage option for {side.upper()} (repeatable; dotted keys nest)",
        )


def _line(record: VersionCopy) -> str:
    return (
        f"weight_v{record.version:06d} {record.kind} {record.outcome}: "
        f"{record.bytes / 1e6:.1f} MB in {record.seconds:.2f} s "
        f"({record.mb_per_s:.1f} MB/s, {record.retries} retries)"
    )


class _Lines(Observer):
    """No TTY, or ``--json`` (then a JSON object): a line per version as it is committed."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def version_done(self, record: VersionCopy) -> None:
        print(json.dumps(record.as_dict()) if self.as_json else _line(record), flush=True)


class _Bar(Observer):
    """A TTY: a rich progress bar per version."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[int, Any] = {}
        self.lock = threading.Lock()

    def version_started(self, version: int, total_bytes: int) -> None:
        with self.lock:
            if version in self.tasks:
                self.progress.reset(self.tasks[version], total=total_bytes)
            else:
                self.tasks[version] = self.progress.add_task(
                    f"weight_v{version:06d}", total=total_bytes
                )

    def advanced(self, version: int, nbytes: int) -> None:
        with self.lock:
            if version in self.tasks:
                self.progress.advance(self.tasks[version], nbytes)

    def version_done(self, record: VersionCopy) -> None:
        with self.lock:
            task = self.tasks.pop(record.version, None)
            if task is not None:
                self.progress.remove_task(task)
        self.progress.console.print(_line(record), markup=False)


def _summary(report: ReplicationReport) -> str:
    copied = report.copied
    span = f"v{copied[0]:06d}..v{copied[-1]:06d}" if copied else "nothing new"
    rate = report.bytes / 1e6 / report.seconds if report.seconds > 0 else 0.0
    lines = [
        f"{report.src} -> {report.dst}: copied {len(copied)} version(s) ({span}), "
        f"{report.bytes / 1e6:.1f} MB in {report.seconds:.2f} s ({rate:.1f} MB/s), "
        f"{report.retries} retries; replica at v{report.latest:06d}"
    ]
    if report.skipped:
        lines.append(f"  skipped: {', '.join(f'v{v:06d}' for v in report.skipped)}")
    if report.pruned:
        lines.append(f"  unpublished like the source: {len(report.pruned)} version(s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def copy(observer: Observer) -> ReplicationReport:
        return replicate(
            args.src,
            args.dst,
            from_version=args.from_version,
            verify=args.verify,
            jobs=args.jobs,
            follow=args.follow,
            prune_like_source=args.prune_like_source,
            src_storage_options=parse_storage_options(args.src_option),
            dst_storage_options=parse_storage_options(args.dst_option),
            observer=observer,
            policy=ReplicationPolicy(
                prune_grace_s=args.prune_grace,
                stale_claim_s=args.stale_claim,
                poll_max_s=args.poll_max,
            ),
        )

    if args.json:
        print(json.dumps(copy(_Lines(as_json=True)).as_dict()), flush=True)
        return 0
    if sys.stdout.isatty():
        import rich.progress as rp

        columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn())
        with rp.Progress(*columns, rp.TransferSpeedColumn(), transient=True) as progress:
            report = copy(_Bar(progress))
    else:
        report = copy(_Lines(as_json=False))
    print(_summary(report))
    return 0
