"""``deltastore emulate s3|gcs``: a local S3 (moto) or GCS (fake-gcs-server) emulator.

Prints the environment lines that point other shells at it and runs until Ctrl-C.
``deltastore demo --backend s3|gcs`` starts its emulator through :func:`running_emulator`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from deltastore.errors import ConfigError

INSTALL_HINT = "pip install 'deltastore[emulators]'"


@dataclass(frozen=True)
class Emulator:
    """A running emulator: the bucket's URL, fsspec storage options for this process, and
    the environment a shell or subprocess needs to reach it without options."""

    kind: str
    url: str
    endpoint_url: str
    storage_options: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def running_emulator(kind: str, bucket: str) -> Iterator[Emulator]:
    """Start the ``kind`` ("s3" or "gcs") emulator with ``bucket`` created; stop it on exit.

    For GCS this also sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` in this process
    (before gcsfs is imported): otherwise gcsfs probes each bucket for a hierarchical
    namespace, which the emulator cannot answer, and warns on every call.

    Raises :class:`ConfigError` naming the extra to install when the emulator is missing.
    """
    try:
        from deltastore.testing import servers
    except ImportError as exc:  # pragma: no cover - servers needs only the standard library
        raise ConfigError(f"the {kind} emulator is not installed: {INSTALL_HINT} ({exc})") from None
    if kind == "s3":
        try:
            server: servers.S3Server | servers.GCSServer = servers.start_moto_s3()
        except ImportError as exc:
            raise ConfigError(
                f"the S3 emulator (moto) is not installed: {INSTALL_HINT} ({exc})"
            ) from None
        env = servers.s3_env(server)  # type: ignore[arg-type]
        url = f"s3://{bucket}"
    elif kind == "gcs":
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        try:
            server = servers.start_fake_gcs()
        except FileNotFoundError as exc:
            raise ConfigError(
                f"the GCS emulator (fake-gcs-server) is not installed: {INSTALL_HINT} ({exc})"
            ) from None
        env = servers.gcs_env(server)  # type: ignore[arg-type]
        url = f"gs://{bucket}"
    else:
        raise ConfigError(f"no emulator for {kind!r}: s3 or gcs")
    with server:
        server.make_bucket(bucket)
        yield Emulator(kind, url, server.endpoint_url, server.storage_options, env)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "emulate",
        help="run a local S3 or GCS emulator and print the environment to use it",
        description=(
            "Start an embedded S3 server (moto) or GCS server (fake-gcs-server) on 127.0.0.1 "
            "with one bucket, print the `export` lines that point deltastore (and s3fs / "
            f"gcsfs) at it, and run until Ctrl-C. Needs {INSTALL_HINT}."
        ),
    )
    p.add_argument("kind", choices=("s3", "gcs"), help="which object store to emulate")
    p.add_argument("--bucket", default="deltastore", help="bucket to create (default deltastore)")
    p.set_defaults(func=run)


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
