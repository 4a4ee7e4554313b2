"""The ``deltastore`` command.

Each subcommand lives in its own module of this package and exposes ``register(subparsers)``,
which adds its parser and sets ``func`` (taking the parsed namespace, returning an exit code).
Errors print one line and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from deltastore.errors import DeltastoreError

# Subcommand modules, in the order `deltastore --help` lists them.
COMMAND_MODULES = ("demo", "publish", "pull", "ls", "verify", "prune", "inspect", "bench", "serve",
                   "replicate")  # fmt: skip

EXIT_ERROR = 1
EXIT_USAGE = 2


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, object]:
    """``--storage-option KEY=VALUE`` pairs → fsspec storage options (JSON values allowed).

    Dotted keys nest: ``client_kwargs.endpoint_url=http://...``.
    """
    import json

    options: dict[str, object] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise DeltastoreError(f"--storage-option {pair!r} is not KEY=VALUE")
        try:
            value: object = json.loads(raw)
        except ValueError:
            value = raw
        target = options
        *parents, leaf = key.split(".")
        for part in parents:
            nested = target.setdefault(part, {})
            if not isinstance(nested, dict):
                raise DeltastoreError(f"--storage-option {pair!r} conflicts with {part}={nested!r}")
            target = nested
        target[leaf] = value
    return options


def add_storage_option_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option for the store (repeatable; dotted keys nest, JSON values)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltastore",
        description="Ship only the bytes that changed from a trainer to inference engines.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"deltastore.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    level = (
        logging.WARNING
        if args.verbose == 0
        else logging.INFO
        if args.verbose == 1
        else logging.DEBUG
    )
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("deltastore: interrupted", file=sys.stderr)
        return 130
    except (DeltastoreError, OSError) as exc:
        if args.debug:
            raise
        print(f"deltastore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
