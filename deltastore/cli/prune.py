"""``deltastore prune``: unpublish old versions and delete garbage (dry run by default)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    byte_progress,
    parse_storage_options,
    print_json,
)
from deltastore.storage import VersionStore
from deltastore.storage.listing import require_store
from deltastore.storage.prune import check_prune_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prune",
        help="remove old versions and garbage (dry run unless --yes)",
        description=(
            "Keep the newest N committed versions and every version needed to rebuild them (a "
            "chain back to a full version or the base); unpublish the others, then delete "
            "their data once they have been unpublished for the grace period. Uncommitted "
            "leftovers older than the grace period are fenced, then deleted. Prints what would "
            "happen unless --yes is given."
        ),
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
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_prune_args(args.keep, args.grace)  # a bad argument is named before the store is read
    store = VersionStore(args.url, parse_storage_options(args.storage_option))
    require_store(store)
    what = f"pruning {store.url}" + ("" if args.yes else " (dry run)")
    with byte_progress(args, what) as progress:
        report = store.prune(
            keep=args.keep, grace_s=args.grace, dry_run=not args.yes, progress=progress
        )
    if args.json:
        print_json({"url": store.url, **asdict(report), "lines": report.lines()})
        return 0
    mode = "dry run" if report.dry_run else "pruned"
    print(f"{store.url} ({mode}, keep {args.keep}):")
    for line in report.lines():
        print(f"  {line}")
    if report.dry_run and report.changes:
        print("nothing was changed; run again with --yes to apply")
    return 0
