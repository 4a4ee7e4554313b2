"""``deltastore serve``: a ``/pull_weights`` HTTP endpoint for one engine host."""

from __future__ import annotations

import argparse
import sys

from deltastore.cli import add_storage_option_flag, parse_storage_options
from deltastore.cli.common import add_trust_flag
from deltastore.errors import ConfigError
from deltastore.hooks import load as load_hook
from deltastore.hooks.loader import PRE_READ


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve POST /pull_weights, GET /state and GET /healthz for one engine host",
        description=(
            "Answer the reference engine endpoint POST /pull_weights {local_checkpoint_dir, "
            "source_dir, target_version} with {success, message} (200/400). --base is the "
            "engine's model path (version 0; copied, never modified). Binds 127.0.0.1 unless "
            "--host says otherwise; a non-loopback host needs --allow."
        ),
    )
    p.add_argument("--base", required=True, help="the engine's base model dir (version 0)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="DIR",
        help="root that request paths must lie under (repeatable; a dir or a URL prefix)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="host name clients may call this server by (repeatable; IP literals, localhost "
        "and, when bound beyond loopback, this machine's names always pass)",
    )
    p.add_argument("--token-file", help="file holding a bearer token every request must carry")
    p.add_argument("--workers", type=int, default=4, help="apply threads per pull")
    p.add_argument(
        "--pre-read-hook",
        metavar="MODULE.FUNC",
        help="hook(source_dir, target_version) run before a version is read, by import path",
    )
    add_trust_flag(p)
    add_storage_option_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deltastore.pull.server import ServerConfig, serve
    from deltastore.trust import as_trusted_keys

    token = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file: {exc}") from None
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty")
    config = ServerConfig(
        base_dir=args.base,
        host=args.host,
        port=args.port,
        allow=tuple(args.allow),
        token=token,
        allowed_hosts=tuple(args.allow_host),
        storage_options=parse_storage_options(args.storage_option),
        pre_read=load_hook(args.pre_read_hook, PRE_READ) if args.pre_read_hook else None,
        workers=args.workers,
        trusted_keys=tuple(as_trusted_keys(args.trust)) if args.trust else None,
    )
    config.check()

    def ready(url: str) -> None:
        print(f"deltastore serve: listening on {url}", flush=True)

    serve(config, ready)
    print("deltastore serve: stopped", file=sys.stderr)
    return 0
