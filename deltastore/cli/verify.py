"""``deltastore verify``: check a local checkpoint's bytes against a version by digest."""

from __future__ import annotations

import argparse

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    add_trust_flag,
    byte_progress,
    parse_storage_options,
    print_json,
)
from deltastore.pull import verify_local
from deltastore.storage import VersionStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="exit 0 only if every local tensor matches a version's digests",
        description=(
            "Hash every tensor of --local and compare with version N (default: the version the "
            "local state records). Judged by digests, not by the state file."
        ),
    )
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--local", required=True, help="host-local checkpoint dir")
    p.add_argument("--base", required=True, help="the engine's base model dir (version 0)")
    p.add_argument("--version", type=int, default=None, help="version to verify against")
    add_trust_flag(p)
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store = VersionStore(args.store, parse_storage_options(args.storage_option))
    with byte_progress(args, f"hashing every tensor of {args.local}") as progress:
        version = verify_local(
            args.local,
            store,
            args.version,
            base_dir=args.base,
            trusted_keys=args.trust,
            progress=progress,
        )
    if args.json:
        print_json({"local": args.local, "version": version, "matches": True})
    else:
        print(f"{args.local}: every tensor matches weight_v{version:06d}")
    return 0
