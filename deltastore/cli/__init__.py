"""The ``deltastore`` command.

Each module in :data:`COMMAND_MODULES` has ``register(subparsers)``, which adds the parsers of
its subcommands through :func:`deltastore.cli.common.add_command`. Errors print one line and
exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from deltastore.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    common_flags,
    missing_extra_hint,
    report_error,
)
from deltastore.errors import DeltastoreError

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

COMMAND_MODULES = (
    "demo",
    "emulate",
    "publish",
    "pull",
    "store",
    "bench",
    "engine",
    "replicate",
    "keygen",
)
"""Subcommand modules, in the order `deltastore --help` lists their commands."""


def build_parser() -> argparse.ArgumentParser:
    from deltastore import __version__

    parser = argparse.ArgumentParser(
        prog="deltastore",
        description="Ship only the bytes that changed from a trainer to inference engines.",
        parents=[common_flags(top_level=True)],
    )
    parser.add_argument("--version", action="version", version=f"deltastore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"deltastore.cli.{name}").register(sub)
    return parser


def suggest_command(argv: Sequence[str], commands: Sequence[str]) -> str | None:
    """A "did you mean" line for a mistyped subcommand in ``argv``, else None."""
    for token in argv:
        if token.startswith("-"):
            continue
        if token in commands:
            return None
        close = difflib.get_close_matches(token, commands, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"deltastore: error: unknown command {token!r}{hint} (see deltastore --help)"
    return None


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit finds no broken pipe."""
    with contextlib.suppress(OSError, ValueError):  # stdout is not a real file (captured)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class _Interrupts:
    """Notes a Ctrl-C as it arrives. An extension module whose import it interrupts can turn
    the KeyboardInterrupt into an ImportError of its own (numpy does: "PyCapsule_Import could
    not import module 'datetime'"), so "was there a Ctrl-C" is asked, not the exception."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> _Interrupts:
        try:
            self.previous = signal.signal(signal.SIGINT, self)
        except ValueError:  # not the main thread: signals go to the main thread's handler
            self.previous = None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _interrupted() -> int:
    print("deltastore: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed, 2 usage, 130 interrupted)."""
    with _Interrupts() as interrupts:
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        except KeyboardInterrupt:
            return _interrupted()
        except Exception:
            if interrupts.seen:
                return _interrupted()
            raise


def _main(argv: list[str]) -> int:
    # Building the parser imports every subcommand (numpy, torch among them): seconds in
    # which a Ctrl-C must end the command as it does later, not with a traceback.
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    suggestion = suggest_command(argv, list(commands.choices))
    if suggestion:
        print(suggestion, file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    level = max(logging.DEBUG, logging.WARNING - 10 * args.verbose)  # -v: INFO, -vv: DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or EXIT_OK)
    except BrokenPipeError:
        # The reader of our output went away (`| head`): stop writing, quietly, with the
        # status rich's tables exit with in the same case (Python's documented convention).
        _drop_stdout()
        return EXIT_ERROR
    except (DeltastoreError, OSError) as exc:
        if args.debug:
            raise
        return report_error(args, str(exc))
    except ImportError as exc:
        hint = missing_extra_hint(exc)
        if args.debug or hint is None:
            raise
        return report_error(args, hint)
