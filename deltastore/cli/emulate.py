"""``deltastore emulate s3|gcs``: a local S3 (moto) or GCS (fake-gcs-server) emulator.

Prints the environment lines that point other shells at it and runs until Ctrl-C.
``deltastore demo`` and ``bench`` start theirs through :func:`backend_store`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deltastore.cli.common import Subparsers, add_command, parse_storage_options
from deltastore.errors import ConfigError

INSTALL_HINT = "pip install 'deltastore[emulators]'"


@dataclass(frozen=True)
class Emulator:
    """A running emulator: the bucket's URL, fsspec storage options for this process, and
    the environment a shell or subprocess needs to reach it without options."""

    url: str
    endpoint_url: str
    storage_options: dict[str, object]
    env: dict[str, str]


@contextlib.contextmanager
def running_emulator(kind: str, bucket: str) -> Iterator[Emulator]:
    """Start the ``kind`` ("s3" or "gcs") emulator with ``bucket`` created; stop it on exit.
    :class:`ConfigError` names the extra to install when the emulator is missing. For GCS this
    sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` here (before gcsfs is imported): else
    gcsfs asks each bucket for a hierarchical namespace the emulator cannot answer."""
    from deltastore.testing import servers

    if kind not in ("s3", "gcs"):
        raise ConfigError(f"no emulator for {kind!r}: s3 or gcs")
    s3 = kind == "s3"
    if not s3:
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    missing = ImportError if s3 else FileNotFoundError  # a package, or a binary
    try:
        server: Any = servers.start_moto_s3() if s3 else servers.start_fake_gcs()
    except missing as exc:
        what = "S3 emulator (moto)" if s3 else "GCS emulator (fake-gcs-server)"
        raise ConfigError(f"the {what} is not installed: {INSTALL_HINT} ({exc})") from None
    env = servers.s3_env(server) if s3 else servers.gcs_env(server)
    with server:
        server.make_bucket(bucket)
        url = f"{'s3' if s3 else 'gs'}://{bucket}"
        yield Emulator(url, server.endpoint_url, server.storage_options, env)


@contextlib.contextmanager
def backend_store(
    args: argparse.Namespace, local: str, name: str
) -> Iterator[tuple[str, dict[str, object]]]:
    """(URL, storage options) of the store ``--store`` names, else one of ``--backend``:
    ``local`` (a dir), a memory store, or the bucket ``deltastore-NAME`` of an embedded
    emulator, under the prefix ``run`` (demo) or ``bench``."""
    options = parse_storage_options(args.storage_option)
    if args.store:
        yield args.store, options
    elif args.backend == "memory":
        yield f"memory://deltastore-{name}-{os.getpid()}", options
    elif args.backend in ("s3", "gcs"):
        with running_emulator(args.backend, f"deltastore-{name}") as emulator:
            prefix = "run" if name == "demo" else name
            yield f"{emulator.url}/{prefix}", {**emulator.storage_options, **options}
    else:
        yield local, options


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "emulate",
        run,
        "run a local S3 or GCS emulator and print the environment to use it",
        "Start an embedded S3 server (moto) or GCS server (fake-gcs-server) on 127.0.0.1 "
        "with one bucket, print the `export` lines that point deltastore (and s3fs / "
        f"gcsfs) at it, and run until Ctrl-C. Needs {INSTALL_HINT}.",
        json=None,
        storage=False,
    )
    p.add_argument("kind", choices=("s3", "gcs"), help="which object store to emulate")
    p.add_argument("--bucket", default="deltastore", help="bucket to create (default deltastore)")


def run(args: argparse.Namespace) -> int:
    with running_emulator(args.kind, args.bucket) as emulator:
        print(f"# {args.kind} emulator at {emulator.endpoint_url}; bucket {emulator.url}")
        print(f"# paste these lines into another shell, then use URLs like {emulator.url}/run1:")
        for key, value in emulator.env.items():
            print(f"export {key}={value}")
        print("# Ctrl-C stops the emulator (its data lives in memory and goes with it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("deltastore emulate: stopped", file=sys.stderr)
    return 0
