"""``deltastore sync``: bring one vLLM or sglang engine (all its hosts) to a version."""

from __future__ import annotations

import argparse

from deltastore.cli.common import (
    add_json_flag,
    add_storage_option_flag,
    parse_storage_options,
    print_json,
)
from deltastore.cli.pull import parse_target
from deltastore.errors import ConfigError


def _read_token(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag}: {exc}") from None
    if not token:
        raise ConfigError(f"{flag} {path} is empty")
    return token


def _engine_version(value: str) -> int | None:
    if value == "unknown":
        return None
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"a version number or 'unknown', not {value!r}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sync",
        help="bring a vLLM or sglang engine to a version: pull, pause, reload, resume",
        description=(
            "Pull the version on every engine host while the engine serves, then pause it, "
            "reload (vLLM: the changed tensors through the deltastore weight-transfer "
            "backend; sglang: /update_weights_from_disk of the local checkpoint) and resume. "
            "A failed pull never pauses the engine; a version that changes nothing is not "
            "reloaded; a reload that fails twice leaves the engine paused (exit 1)."
        ),
    )
    p.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    p.add_argument("--url", required=True, help="the engine's HTTP server, http://HOST:PORT")
    p.add_argument(
        "--store", required=True, action="append", help="store URL as the engine hosts read it"
    )
    p.add_argument("--local", required=True, help="host-local checkpoint dir on every host")
    p.add_argument("--version", required=True, type=parse_target, help="N or 'latest'")
    p.add_argument(
        "--from",
        dest="engine_version",
        type=_engine_version,
        default=None,
        metavar="N",
        help="the version the engine holds now (default 'unknown': always reloads)",
    )
    p.add_argument("--trainer-store", help="the store as this machine reads it (default --store)")
    p.add_argument(
        "--serve",
        action="append",
        metavar="URL",
        help="sglang: a deltastore serve URL per host (repeatable) instead of /pull_weights",
    )
    p.add_argument("--serve-token-file", help="bearer token of the deltastore serve URLs")
    p.add_argument("--engine-token-file", help="the engine's API key, sent as a bearer token")
    p.add_argument("--base", help="vLLM: the base model dir on the hosts (default: its model)")
    p.add_argument(
        "--engine-trust",
        action="append",
        metavar="FILE",
        help="vLLM: a public key file on the engine hosts versions must be signed by",
    )
    p.add_argument("--pause-mode", help="vLLM: abort|wait|keep; sglang: abort|retract|in_place")
    add_json_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deltastore.engines import EngineSync

    sync = EngineSync(
        args.engine,
        args.url,
        args.store[0] if len(args.store) == 1 else args.store,
        args.local,
        store=args.trainer_store,
        storage_options=parse_storage_options(args.storage_option) or None,
        base_dir=args.base,
        trusted_keys=args.engine_trust,
        serve_urls=args.serve,
        serve_token=_read_token(args.serve_token_file, "--serve-token-file"),
        engine_token=_read_token(args.engine_token_file, "--engine-token-file"),
        engine_version=args.engine_version,
        pause_mode=args.pause_mode,
    )
    result = sync.sync(args.version)
    if args.json:
        print_json(
            {
                "engine": result.engine,
                "version": result.version,
                "changed": result.changed,
                "retried": result.retried,
                **result.metrics(),
                "hosts": [r.describe() for r in result.hosts],
            }
        )
    elif not result.changed:
        print(
            f"{args.engine} {args.url}: v{result.version:06d} changes nothing: pulled in "
            f"{result.pull_s:.2f} s, not paused"
        )
    else:
        retried = ", after one retry" if result.retried else ""
        print(
            f"{args.engine} {args.url}: at v{result.version:06d}: pulled in "
            f"{result.pull_s:.2f} s, paused {result.paused_s:.2f} s (pause {result.pause_s:.2f},"
            f" reload {result.reload_s:.2f}, resume {result.resume_s:.2f}{retried}); "
            f"{result.tensors_changed} tensors changed, {result.wire_bytes} wire bytes"
        )
    return 0
