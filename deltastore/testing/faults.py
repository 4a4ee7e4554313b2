"""A fault-injecting HTTP proxy for testing stores against real servers.

:class:`FaultProxy` listens on ``127.0.0.1`` and forwards every request to an upstream server
(moto, fake-gcs-server), except that requests matching a :class:`Fault` rule are answered with
an error, stalled, or forwarded with their response dropped (a lost acknowledgement: the write
lands, the client never hears so). Point a client at :attr:`FaultProxy.endpoint_url` instead of
the server's.

A test utility: one thread per connection, whole bodies held in memory, no TLS.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from deltastore.testing.servers import StoppedOnExit

__all__ = ["Fault", "FaultProxy", "Injected"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
}

ACTIONS = ("status", "drop-response", "stall", "forward")


@dataclass
class Fault:
    """One rule: the next ``times`` requests that match get ``action`` instead of a normal
    forward.

    Actions:

    ``status``
        answer ``status`` with ``body`` (e.g. 503, or S3's 409 ``ConditionalRequestConflict``)
        without forwarding.
    ``drop-response``
        forward the request, then close the connection without answering (a lost ack).
    ``stall``
        hold the request ``stall_s`` seconds, then close the connection without forwarding
        (a client timeout).
    ``forward``
        forward normally, but call ``before`` first (to interleave another actor's step).
    """

    action: str
    method: str | None = None
    """HTTP method to match (``PUT``, ``POST``...); None matches any."""
    path_contains: str = ""
    """Substring of the URL-decoded path and query to match."""
    body_contains: bytes = b""
    """Bytes the request body must contain (GCS names an uploaded object in its body)."""
    times: int = 1
    status: int = 503
    body: bytes = b""
    content_type: str = "application/xml"
    stall_s: float = 2.0
    before: Callable[[], None] | None = None
    drop_headers: tuple[str, ...] = ()
    """Request headers to strip when forwarding (e.g. ``If-None-Match``: a backend that
    ignores conditional writes)."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {ACTIONS}")

    def matches(self, method: str, target: str, body: bytes) -> bool:
        return (
            (self.method is None or self.method == method)
            and self.path_contains in target
            and self.body_contains in body
        )


@dataclass(frozen=True)
class Injected:
    """A fault that was applied to one request."""

    action: str
    method: str
    target: str


def s3_error(code: str, message: str = "injected by FaultProxy") -> bytes:
    """An S3-style XML error body (what botocore parses into ``Error.Code``)."""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
    ).encode()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up (a dropped or stalled request) is expected here


class FaultProxy(StoppedOnExit):
    """Forwards HTTP requests to ``upstream`` (``http://host:port``), injecting faults.

    Start it with :meth:`start` (or use it as a context manager); add rules with :meth:`add`.
    :attr:`injected` records every fault applied, :attr:`seen` every request.
    """

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream {upstream!r} must be http://host:port")
        self._upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.injected: list[Injected] = []
        self.seen: list[tuple[str, str]] = []
        """(method, URL-decoded path and query) of every request, in arrival order."""
        self.requests = 0
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def storage_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A copy of s3fs or gcsfs storage ``options`` that sends requests through this proxy."""
        result = copy.deepcopy(options)
        client = result.get("client_kwargs")
        if isinstance(client, dict):
            client["endpoint_url"] = self.endpoint_url
        else:
            result["endpoint_url"] = self.endpoint_url
        return result

    def add(self, fault: Fault) -> Fault:
        """Arm a rule; rules are tried in the order they were added."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop every armed rule (the record of injected faults is kept)."""
        with self._lock:
            self._faults.clear()

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def _take(self, method: str, target: str, body: bytes) -> Fault | None:
        with self._lock:
            self.requests += 1
            self.seen.append((method, target))
            for fault in self._faults:
                if fault.times > 0 and fault.matches(method, target, body):
                    fault.times -= 1
                    self.injected.append(Injected(fault.action, method, target))
                    return fault
        return None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        # http.server builds one handler per request from a class: this one knows its proxy.
        return type("Handler", (_ProxyHandler,), {"proxy": self})


class _ProxyHandler(BaseHTTPRequestHandler):
    """One request through a :class:`FaultProxy`: answered by a fault, or forwarded."""

    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: tests read proxy.injected instead

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(
        self, body: bytes, strip: tuple[str, ...] = ()
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.proxy._upstream, timeout=120)
        skip = _HOP_BY_HOP | {h.lower() for h in strip}
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
            if body or self.command in ("PUT", "POST", "PATCH"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.getheaders(), data
        finally:
            conn.close()

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client hung up first
            self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self, fault: Fault) -> None:
        """Answer with the fault's status and body instead of forwarding."""
        self.send_response(fault.status)
        self.send_header("Content-Type", fault.content_type)
        self.send_header("Content-Length", str(len(fault.body)))
        self.end_headers()
        self.wfile.write(fault.body)

    def _relay(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        """Send the upstream's response on, with this connection's own framing headers."""
        self.send_response(status)
        upstream_length = None
        for key, value in headers:
            if key.lower() == "content-length":
                upstream_length = value
            elif key.lower() not in _HOP_BY_HOP and key.lower() not in ("date", "server"):
                self.send_header(key, value)
        no_body = self.command == "HEAD" or status in (204, 304) or status < 200
        length = upstream_length if no_body and upstream_length else str(len(data))
        if not (status in (204, 304) or status < 200):
            self.send_header("Content-Length", length)
        self.end_headers()
        if not no_body:
            self.wfile.write(data)

    def _handle(self) -> None:
        body = self._body()
        target = urllib.parse.unquote(self.path)
        fault = self.proxy._take(self.command, target, body)
        if fault is not None and fault.action == "status":
            self._answer(fault)
            return
        if fault is not None and fault.action == "stall":
            time.sleep(fault.stall_s)
            self._drop()
            return
        if fault is not None and fault.before is not None:
            fault.before()
        status, headers, data = self._forward(body, fault.drop_headers if fault else ())
        if fault is not None and fault.action == "drop-response":
            self._drop()
            return
        self._relay(status, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle
