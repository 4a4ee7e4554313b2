"""The settings of ``deltastore serve`` and which requests and paths it accepts.

:class:`ServerConfig` is refused before anything binds when unsafe; :class:`RequestRules`
decides a request's ``Host`` / ``Origin`` / content type / size, :class:`PathPolicy` the local
dirs and stores a request may name (see :mod:`deltastore.pull.server` for why).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from deltastore.errors import ConfigError, FormatError
from deltastore.pull.protocol import check_request_path

PreReadHook = Callable[[str, int], None]

MAX_REQUEST_BYTES = 64 * 1024
"""Largest request body accepted (413 above): a pull request is three short fields."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one ``deltastore serve`` process."""

    base_dir: str
    """The engine's model path: version 0, copied when a local dir is seeded, never modified."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (the bound URL is reported once listening)."""
    allow: tuple[str, ...] = ()
    """Roots request paths must lie under: directories, or URL prefixes (``s3://bucket/``)."""
    token: str | None = None
    """Bearer token every request but ``/healthz`` must carry; None: no token."""
    allowed_hosts: tuple[str, ...] = ()
    """Extra names a request's ``Host`` may carry (IP literals and ``localhost`` always pass)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    pre_read: PreReadHook | None = None
    workers: int = 4
    """Apply threads per pull."""
    max_parallel_pulls: int = 4
    """Pulls of different local dirs that may run at once."""
    trusted_keys: tuple[Any, ...] | None = None
    """Public keys (files or :class:`~deltastore.trust.TrustedKey`) every pull requires a
    signature from (``--trust``); None: versions need not be signed."""

    def check(self) -> None:
        """Refuse unsafe or broken settings before anything binds (:class:`ConfigError`)."""
        if not os.path.isdir(self.base_dir):
            raise ConfigError(f"--base {self.base_dir!r} is not a directory (the engine's model)")
        if not self.allow and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to serve on {self.host} without --allow: any host that can reach it "
                "could make this one write anywhere. Pass --allow DIR (repeatable) or bind "
                "127.0.0.1"
            )
        if self.token is not None and not self.token.strip():
            raise ConfigError("the token is empty; put a secret in --token-file")


def _split_host(header: str) -> str:
    """The host of a ``Host`` header, lower case, without the port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    host = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return host.rstrip(".")  # "localhost." is the same name as "localhost"


class RequestRules:
    """Which ``Host`` / ``Origin`` / content type a request may carry (403, 415, 413 otherwise).

    An IP literal in ``Host`` is always accepted: DNS rebinding needs a name, and a page served
    from another address or port of this machine is caught by its ``Origin``.
    """

    def __init__(self, config: ServerConfig) -> None:
        names = {"localhost", *(h.lower() for h in config.allowed_hosts)}
        if not is_loopback(config.host):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower(), config.host.lower()}
        self.names = frozenset(names)

    def refusal(self, request: web.Request) -> tuple[int, str] | None:
        """``(status, message)`` when the request breaks a rule, None when it may proceed."""
        host_header = request.headers.get("Host")
        if host_header is not None and not self._host_ok(_split_host(host_header)):
            return 403, (
                f"Host {host_header!r} does not name this server (DNS rebinding?); call it by "
                "IP address or localhost, or start it with --allow-host NAME"
            )
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower().rstrip("/") != f"http://{host_header}".lower():
            return 403, f"cross-origin request from Origin {origin!r} refused"
        if request.method == "POST":
            if request.content_type != "application/json":
                return 415, (
                    f"Content-Type {request.headers.get('Content-Type')!r} refused: send the "
                    "request body as Content-Type: application/json"
                )
            length = request.content_length
            if length is not None and length > MAX_REQUEST_BYTES:
                return 413, f"request body of {length} bytes exceeds {MAX_REQUEST_BYTES} bytes"
        return None

    def _host_ok(self, host: str) -> bool:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return host in self.names
        return True


class PathPolicy:
    """Which request paths the server accepts."""

    def __init__(self, config: ServerConfig) -> None:
        self.base = os.path.realpath(config.base_dir)
        self.dirs = tuple(os.path.realpath(_local_path(a)) for a in config.allow if not _is_url(a))
        self.urls = tuple(a.rstrip("/") for a in config.allow if _is_url(a))
        self.open = not config.allow

    def local_dir(self, path: str) -> str:
        """The real path of a request's local dir; :class:`PermissionError` if not allowed."""
        check_request_path(path, "local_checkpoint_dir")
        if _is_url(path) or not os.path.isabs(_local_path(path)):
            raise FormatError(f"local_checkpoint_dir {path!r} must be an absolute local path")
        real = os.path.realpath(_local_path(path))
        if real == self.base or _under(real, self.base) or _under(self.base, real):
            raise PermissionError(
                f"local_checkpoint_dir {path!r} is, holds or lies inside the base model "
                f"{self.base}; the base is never modified: pass a separate host-local dir"
            )
        if not self.open and not self._allowed(real):
            raise PermissionError(f"{path!r} is not under an allowed root {list(self.dirs)}")
        return real

    def source(self, source: str) -> str:
        """A request's source (dir or URL), checked against the allowed roots.

        With allowed roots, every file and directory of a local store must resolve inside them
        (checked by walking the store now; see docs/engines.md for the race this leaves).
        """
        check_request_path(source, "source_dir")
        if self.open:
            return source
        if _is_url(source):
            if any(source == u or source.startswith(u + "/") for u in self.urls):
                return source
            raise PermissionError(f"source {source!r} is not under an allowed URL {self.urls}")
        path = _local_path(source)
        real = os.path.realpath(path)
        if not os.path.isabs(path) or not self._allowed(real):
            raise PermissionError(f"source {source!r} is not under an allowed root {self.dirs}")
        self._check_links(real, source)
        return real

    @staticmethod
    def separate(local_dir: str, source: str) -> None:
        """Refuse a local dir that is, holds or lies inside a local source store."""
        if _is_url(source):
            return
        store = os.path.realpath(_local_path(source))
        if local_dir == store or _under(local_dir, store) or _under(store, local_dir):
            raise PermissionError(
                f"local_checkpoint_dir {local_dir!r} is, holds or lies inside the source store "
                f"{store}; pulling there would overwrite published versions: pass a host-local "
                "dir outside the store"
            )

    def _allowed(self, real: str) -> bool:
        return any(_under(real, root) for root in self.dirs)

    def _check_links(self, store: str, shown: str) -> None:
        seen: set[str] = set()
        for top, dirs, files in os.walk(store, followlinks=True):
            real_top = os.path.realpath(top)
            if real_top in seen:  # a link loop or a second link to one dir: walked already
                dirs[:] = []
                continue
            seen.add(real_top)
            for name in (*dirs, *files):
                path = os.path.join(top, name)
                if os.path.islink(path) and not self._allowed(os.path.realpath(path)):
                    raise PermissionError(
                        f"{path} in source store {shown!r} is a symlink to "
                        f"{os.path.realpath(path)}, outside the allowed roots {list(self.dirs)}; "
                        "refusing to read it"
                    )
