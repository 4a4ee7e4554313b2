"""The ``deltastore`` command.

Each module in :data:`COMMAND_MODULES` has ``register(subparsers)``, which adds the parsers of
its subcommands through :func:`deltastore.cli.common.add_command`. Errors print one line and
exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import difflib
import importlib
import logging
import os
import signal
import sys
import threading
import time
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
    not import module 'datetime'"), so "was there a Ctrl-C" is asked, not the exception.

    A Ctrl-C whose KeyboardInterrupt is raised inside a callback from C (numba compiling
    through llvmlite's ctypes callbacks) or a finalizer is swallowed there as "unraisable",
    and the command would run on as if never interrupted: such a one is delivered again.
    After a Ctrl-C, the finalizers of objects it left half built fail ("Exception ignored
    in ..."): noise, not reported (to the process's end when it is the command's own)."""

    def __init__(self, *, own_process: bool = False) -> None:
        self.own_process = own_process
        self.seen = False
        self.active = False
        self._lock = threading.Lock()

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        if self.active:  # (once the command has ended there is nothing left to interrupt)
            raise KeyboardInterrupt

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if self.active and isinstance(unraisable.exc_value, KeyboardInterrupt):
            # A little later, from another thread: raised inside this hook, it would be
            # swallowed once more (and unseen: the hook is not called for its own errors).
            later = threading.Timer(0.05, self._deliver_again)
            later.daemon = True
            later.start()
        elif not self.seen:
            self.previous_hook(unraisable)

    def _deliver_again(self) -> None:
        with self._lock:
            if self.active:
                _thread.interrupt_main()

    def __enter__(self) -> _Interrupts:
        try:
            self.previous = signal.signal(signal.SIGINT, self)
        except ValueError:  # not the main thread: signals go to the main thread's handler
            self.previous = None
        self.previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        self.active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.active = False
        if self.seen and self.own_process:
            # The process only exits now: a second Ctrl-C ends it at once.
            if self.previous is not None:
                signal.signal(signal.SIGINT, lambda signum, frame: _end_process())
            return
        sys.unraisablehook = self.previous_hook
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


_EXIT_GRACE_S = 10.0
"""How long an interrupted command's process may take to exit before it is ended."""


def _end_process() -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _exit_within_grace() -> None:
    """End the interrupted process if its exit waits on a thread for longer than
    :data:`_EXIT_GRACE_S`. Python joins every pool thread at exit, and a thread whose start the
    Ctrl-C interrupted was never registered with its pool, so nothing ever tells it to stop.
    What the command had to undo ran as it unwound; what a kill leaves, the next pull repairs."""

    def end() -> None:
        time.sleep(_EXIT_GRACE_S)
        _end_process()

    threading.Thread(target=end, name="deltastore-exit", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed, 2 usage, 130 interrupted).
    ``argv`` None: this process is the command's own (`deltastore ...`), which an interrupt
    ends within :data:`_EXIT_GRACE_S` of the command's return."""
    with _Interrupts(own_process=argv is None) as interrupts:
        try:
            code = _main(list(sys.argv[1:] if argv is None else argv), interrupts)
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
        except Exception:
            if not interrupts.seen:
                raise
            code = EXIT_INTERRUPTED
    # (Said once the handler no longer raises: an interrupt delivered again late is ignored.)
    if code == EXIT_INTERRUPTED:
        print("deltastore: interrupted", file=sys.stderr)
        if interrupts.own_process:
            _exit_within_grace()
    return code


def _main(argv: list[str], interrupts: _Interrupts) -> int:
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
        if interrupts.seen:  # the error is the interrupt's doing (a write it cut short)
            return EXIT_INTERRUPTED
        if args.debug:
            raise
        return report_error(args, str(exc))
    except ImportError as exc:
        hint = missing_extra_hint(exc)
        if args.debug or hint is None:
            raise
        return report_error(args, hint)
