"""``deltastore serve`` and ``sync``: a ``/pull_weights`` HTTP endpoint for one engine host,
and bringing one vLLM or sglang engine (all its hosts) to a version."""

from __future__ import annotations

import argparse
import sys

from deltastore.cli.common import (
    Subparsers,
    add_base_flag,
    add_command,
    add_trust_flag,
    emit,
    fields,
    parse_storage_options,
    parse_target,
    read_token,
    version_or,
)
from deltastore.hooks import load as load_hook
from deltastore.hooks.loader import PRE_READ


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "serve",
        run_serve,
        "serve POST /pull_weights, GET /state and GET /healthz for one engine host",
        "Answer the reference engine endpoint POST /pull_weights {local_checkpoint_dir, "
        "source_dir, target_version} with {success, message} (200/400). --base is the "
        "engine's model path (version 0; copied, never modified). Binds 127.0.0.1 unless "
        "--host says otherwise; a non-loopback host needs --allow.",
        json=None,
    )
    add_base_flag(p)
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
    _add_sync(sub)


def _add_sync(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "sync",
        run_sync,
        "bring a vLLM or sglang engine to a version: pull, pause, reload, resume",
        "Pull the version on every engine host while the engine serves, then pause it, "
        "reload (vLLM: the changed tensors through the deltastore weight-transfer "
        "backend; sglang: /update_weights_from_disk of the local checkpoint) and resume. "
        "A failed pull never pauses the engine; a version that changes nothing is not "
        "reloaded; a reload that fails twice leaves the engine paused (exit 1).",
    )
    p.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    p.add_argument("--url", required=True, help="the engine's HTTP server, http://HOST:PORT")
    p.add_argument(
        "--store", required=True, action="append", help="store URL, as the hosts read it"
    )
    p.add_argument("--local", required=True, help="host-local checkpoint dir on every host")
    p.add_argument("--version", required=True, type=parse_target, help="N or 'latest'")
    p.add_argument(
        "--from",
        dest="engine_version",
        type=version_or("unknown"),
        metavar="N",
        help="the version the engine holds now (default 'unknown': always reloads)",
    )
    p.add_argument("--trainer-store", help="the store as this machine reads it (default --store)")
    p.add_argument("--serve-token-file", help="bearer token of the deltastore serve URLs")
    p.add_argument("--engine-token-file", help="the engine's API key, sent as a bearer token")
    p.add_argument("--base", help="vLLM: the base model dir on the hosts (default: its model)")
    for flag, metavar, what in (
        ("--serve", "URL", "sglang: a deltastore serve URL per host, instead of /pull_weights"),
        (
            "--engine-trust",
            "FILE",
            "vLLM: a public key file on the engine hosts that versions must be signed by",
        ),
    ):
        p.add_argument(flag, action="append", metavar=metavar, help=f"{what} (repeatable)")
    p.add_argument("--pause-mode", help="vLLM: abort|wait|keep; sglang: abort|retract|in_place")


def run_serve(args: argparse.Namespace) -> int:
    from deltastore.pull.server import ServerConfig, serve
    from deltastore.trust import as_trusted_keys

    config = ServerConfig(
        base_dir=args.base,
        host=args.host,
        port=args.port,
        allow=tuple(args.allow),
        token=read_token(args.token_file or None, "--token-file"),
        allowed_hosts=tuple(args.allow_host),
        storage_options=parse_storage_options(args.storage_option),
        pre_read=load_hook(args.pre_read_hook, PRE_READ) if args.pre_read_hook else None,
        workers=args.workers,
        trusted_keys=tuple(as_trusted_keys(args.trust)) if args.trust else None,
    )
    config.check()
    serve(config, lambda url: print(f"deltastore serve: listening on {url}", flush=True))
    print("deltastore serve: stopped", file=sys.stderr)
    return 0


def run_sync(args: argparse.Namespace) -> int:
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
        serve_token=read_token(args.serve_token_file, "--serve-token-file"),
        engine_token=read_token(args.engine_token_file, "--engine-token-file"),
        engine_version=args.engine_version,
        pause_mode=args.pause_mode,
    )
    result = sync.sync(args.version)
    if not result.changed:
        text = f"v{result.version:06d} changes nothing: pulled in {result.pull_s:.2f} s, not paused"
    else:
        retried = ", after one retry" if result.retried else ""
        text = (
            f"at v{result.version:06d}: pulled in "
            f"{result.pull_s:.2f} s, paused {result.paused_s:.2f} s (pause {result.pause_s:.2f},"
            f" reload {result.reload_s:.2f}, resume {result.resume_s:.2f}{retried}); "
            f"{result.tensors_changed} tensors changed, {result.wire_bytes} wire bytes"
        )
    hosts = [r.describe() for r in result.hosts]
    payload = {**fields(result, "engine version changed retried"), **result.metrics()}
    return emit(args, {**payload, "hosts": hosts}, f"{args.engine} {args.url}: {text}")
