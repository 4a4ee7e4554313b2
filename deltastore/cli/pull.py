"""``deltastore pull``: bring a host-local checkpoint to a published version."""

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
from deltastore.errors import ConfigError
from deltastore.pull import pull_weights
from deltastore.pull.source import PullSource, open_store
from deltastore.storage import VersionStore


def parse_target(value: str) -> int | str:
    if value == "latest":
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"version must be a number or 'latest', not {value!r}")


def resolve_target(store: VersionStore, target: int | str) -> int:
    """A version number, or the newest committed version for ``"latest"``.

    Raises :class:`ConfigError` for ``"latest"`` of a URL where nothing was ever published:
    a mistyped path must not read as an empty store (and reset a host to the base).
    """
    if target != "latest" and not isinstance(target, int):
        raise ConfigError(f"bad version {target!r}: a number or 'latest'")
    return PullSource(store).resolve_target(target)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "pull",
        help="apply published versions to a host-local checkpoint, verified",
        description=(
            "Bring --local to --version, creating it from --base when it does not exist. A "
            "directory without a state file is treated as holding nothing and reseeded."
        ),
    )
    p.add_argument(
        "--store",
        required=True,
        action="append",
        help="store URL; repeat it for copies of one run, nearest first (each version is read "
        "from the first store that has it)",
    )
    p.add_argument("--local", required=True, help="host-local checkpoint dir (patched in place)")
    p.add_argument("--base", required=True, help="the engine's base model dir (version 0)")
    p.add_argument("--version", required=True, type=parse_target, help="N or 'latest'")
    p.add_argument("--workers", type=int, default=4, help="apply threads")
    add_trust_flag(p)
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store = open_store(args.store, parse_storage_options(args.storage_option))
    target = resolve_target(store, args.version)
    with byte_progress(args, f"pulling weight_v{target:06d} into {args.local}") as progress:
        result = pull_weights(
            args.local,
            store,
            target,
            base_dir=args.base,
            workers=args.workers,
            trusted_keys=args.trust,
            progress=progress,
        )
    if args.json:
        print_json(
            {
                "local": args.local,
                "version": result.version,
                "action": result.action,
                "versions_applied": result.versions_applied,
                "tensors_applied": result.tensors_applied,
                "bytes_read": result.bytes_read,
                "seconds": result.seconds,
                "message": result.message,
            }
        )
    else:
        print(f"{args.local}: {result.message}")
    return 0
