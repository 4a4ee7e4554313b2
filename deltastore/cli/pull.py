"""``deltastore pull`` and ``verify``: bring a host-local checkpoint to a published version,
and check its bytes against a version by digest."""

from __future__ import annotations

import argparse

from deltastore.cli.common import (
    Subparsers,
    add_base_flag,
    add_command,
    add_trust_flag,
    byte_progress,
    emit,
    fields,
    open_store,
    parse_target,
)
from deltastore.pull import pull_weights, verify_local
from deltastore.pull.source import PullSource


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "pull",
        run_pull,
        "apply published versions to a host-local checkpoint, verified",
        "Bring --local to --version, creating it from --base when it does not exist. A "
        "directory without a state file is treated as holding nothing and reseeded.",
    )
    p.add_argument(
        "--store",
        required=True,
        action="append",
        help="store URL; repeat it for copies of one run, nearest first (each version is read "
        "from the first store that has it)",
    )
    p.add_argument("--local", required=True, help="host-local checkpoint dir (patched in place)")
    add_base_flag(p)
    p.add_argument("--version", required=True, type=parse_target, help="N or 'latest'")
    p.add_argument("--workers", type=int, default=4, help="apply threads")
    add_trust_flag(p)
    p = add_command(
        sub,
        "verify",
        run_verify,
        "exit 0 only if every local tensor matches a version's digests",
        "Hash every tensor of --local and compare with version N (default: the version the "
        "local state records). Judged by digests, not by the state file.",
    )
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--local", required=True, help="host-local checkpoint dir")
    add_base_flag(p)
    p.add_argument("--version", type=int, default=None, help="version to verify against")
    add_trust_flag(p)


def run_pull(args: argparse.Namespace) -> int:
    store = open_store(args, args.store)
    target = PullSource(store).resolve_target(args.version)
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
    names = "version action versions_applied tensors_applied bytes_read seconds message"
    payload = {"local": args.local, **fields(result, names)}
    return emit(args, payload, f"{args.local}: {result.message}")


def run_verify(args: argparse.Namespace) -> int:
    store = open_store(args, args.store)
    with byte_progress(args, f"hashing every tensor of {args.local}") as progress:
        version = verify_local(
            args.local,
            store,
            args.version,
            base_dir=args.base,
            trusted_keys=args.trust,
            progress=progress,
        )
    payload = {"local": args.local, "version": version, "matches": True}
    return emit(args, payload, f"{args.local}: every tensor matches weight_v{version:06d}")
